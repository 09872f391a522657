"""Which keys vLLM's CPU attention kernel reads under a sliding window: the rule kvlc's window encodes.

kvlc moves, for a sliding-window group, only the blocks the receiver's next token still attends
(:func:`kvlc.compiler.request.tokens.window_start`: token ``q`` attends ``[q - window + 1, q]``, as vLLM's
``SlidingWindowManager`` counts). Here vLLM's own kernel (``cpu_attention_with_kv_cache``, the ops
the CPU backend calls, with the integer window the backend passes) is asked directly: a query at ``q``
whose cache holds, at one position, a key far from every other (and a large value) changes its output
exactly when that position is inside ``[q - window + 1, q]``. So a key at ``q - window + 1`` must be
moved, one at ``q - window`` need not be, and kvlc's first moved token is never after the first key read.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from kvlc.compiler.request.tokens import TokenRange, window_start  # noqa: E402

HEAD_DIM, BLOCK = 64, 32


def _output(isa: str, dtype, window: int, length: int, odd: int | None) -> torch.Tensor:
    """The kernel's output for the last of ``length`` tokens (keys and values of all of them in blocks
    1.. of the cache); ``odd``: the position whose key and value are made far from the rest."""
    import vllm._custom_ops as ops

    gen = torch.Generator().manual_seed(length)
    blocks = -(-length // BLOCK)
    cache = torch.zeros(blocks + 1, 1, BLOCK, 2 * HEAD_DIM, dtype=dtype)
    keys, values = cache.view(blocks + 1, 1, 2 * BLOCK, HEAD_DIM).chunk(2, dim=2)
    k = torch.randn(length, 1, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(length, 1, HEAD_DIM, generator=gen).to(dtype)
    q = torch.randn(1, 1, HEAD_DIM, generator=gen).to(dtype)
    if odd is not None:
        k[odd], v[odd] = 50.0, 1000.0
    table = torch.arange(1, blocks + 1, dtype=torch.int32)[None, :]
    slots = torch.tensor([(1 + t // BLOCK) * BLOCK + t % BLOCK for t in range(length)], dtype=torch.int64)
    ops.cpu_attn_reshape_and_cache(k, v, keys, values, slots, isa)
    starts, lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([length], dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(1, 1, 1, HEAD_DIM, lens, dtype, starts, True, window, isa, False)
    out = torch.empty_like(q)
    ops.cpu_attention_with_kv_cache(q, keys, values, out, starts, lens, HEAD_DIM ** -0.5, True, None, window, table,
                                    0.0, meta, None)
    return out


@pytest.mark.parametrize("isa", ["vec", "vec16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window,length", [(8, 40), (64, 159), (64, 100)])
def test_the_kernel_reads_the_window_kvlc_moves(isa, dtype, window, length):
    q = length - 1
    plain = _output(isa, dtype, window, length, None)
    read = {p: not torch.equal(_output(isa, dtype, window, length, p), plain) for p in (q - window, q - window + 1, q)}
    assert read == {q - window: False, q - window + 1: True, q: True}, read
    # kvlc's rule for a receiver that computes token q next (it received tokens [0, q)): the first token it
    # moves is at or before the first key the kernel reads, and block-aligned
    first = window_start(TokenRange(0, q), window, BLOCK)
    assert first <= q - window + 1 and first % BLOCK == 0 and q - window + 1 - first < BLOCK
