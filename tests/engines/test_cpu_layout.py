"""What vLLM's CPU attention backend really writes into a KV block, proven with its own cache op.

The connector's plan must describe these bytes exactly; a whole-block copy hides a wrong
description, a copy across block sizes or of a partial block does not.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")


@pytest.mark.parametrize("block_size", [32, 64, 128])
@pytest.mark.parametrize("isa", ["vec", "vec16"])
def test_cpu_block_holds_k_as_head_dim_by_token_and_v_as_token_by_head_dim(isa, block_size):
    """Per block and KV head: K[head_dim][token], then V[token][head_dim] (not K[token][head_dim])."""
    import vllm._custom_ops as ops

    heads, head_size, num_blocks = 2, 64, 3
    cache = torch.zeros(num_blocks, heads, block_size, 2 * head_size, dtype=torch.float32)
    key_cache, value_cache = cache.view(num_blocks, heads, 2 * block_size, head_size).chunk(2, dim=2)
    tokens = block_size + 5  # one full block and a partial one
    t = torch.arange(tokens).view(-1, 1, 1)
    h = torch.arange(heads).view(1, -1, 1)
    c = torch.arange(head_size).view(1, 1, -1)
    key = (t * 10000 + h * 1000 + c).float()  # every element names (token, head, dim)
    value = key + 500
    slots = torch.arange(tokens, dtype=torch.int64) + block_size  # tokens start in block 1
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
    block = cache.view(num_blocks, heads, 2, block_size * head_size)[1]
    k_hnc = key[:block_size].permute(1, 0, 2)  # [head, token, dim]
    v_hnc = value[:block_size].permute(1, 0, 2)
    assert torch.equal(block[:, 0], k_hnc.transpose(1, 2).reshape(heads, -1))  # K: [head][dim][token]
    assert torch.equal(block[:, 1], v_hnc.reshape(heads, -1))  # V: [head][token][dim]
    tail = cache.view(num_blocks, heads, 2, head_size, block_size)[2, 0, 0, 3, :5]  # K, dim 3, tokens 0-4
    assert torch.equal(tail, key[block_size:, 0, 3])
