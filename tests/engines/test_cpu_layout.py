"""What vLLM's CPU attention backend really writes into a KV block, per ISA, proven with its own cache op.

The connector's plan must describe these bytes exactly; a whole-block copy hides a wrong
description, a copy across block sizes or of a partial block does not. vLLM's
``cpu_attn_reshape_and_cache`` only moves memory (no AMX tile instruction), so every ISA the
x86 build carries (``vec``, ``vec16``, ``amx``) is checked here on any x86 host, AMX or not.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

import kvlc  # noqa: E402
from kvlc.engines.vllm.derive.cpu import ISA_LAYOUTS, isa_layout  # noqa: E402
from kvlc.engines.vllm.derive.offline import published_view  # noqa: E402
from kvlc.engines.vllm.derive.spec import derive_plan, exact_plan  # noqa: E402
from kvlc.engines.vllm.derive.view import ViewError  # noqa: E402

HEADS = 2
TOKENS = 192  # a multiple of every entry size, 1.5 blocks of 128


def _model(head_dim: int) -> dict:
    return {"num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": HEADS, "head_dim": head_dim}


def _view(isa: str, block: int, head_dim: int = 64):
    return published_view(_model(head_dim), "tiny", backend="CPU_ATTN", block_size=block,
                          num_blocks=-(-TOKENS // block), kv_dtype="bf16", cpu_isa=isa)


def _vllm_cache(isa: str, block: int, head_dim: int, code: torch.Tensor) -> np.ndarray:
    """The layer's cache after vLLM's own op wrote ``code`` ([token, head, dim]) as K and ``code + 1`` as V."""
    import vllm._custom_ops as ops

    blocks = -(-TOKENS // block)
    cache = torch.zeros(blocks, HEADS, block, 2 * head_dim, dtype=torch.bfloat16)
    key_cache, value_cache = cache.view(blocks, HEADS, 2 * block, head_dim).chunk(2, dim=2)
    slots = torch.arange(TOKENS, dtype=torch.int64)
    try:
        ops.cpu_attn_reshape_and_cache(code.bfloat16(), (code + 1).bfloat16(), key_cache, value_cache, slots, isa)
    except RuntimeError as exc:  # an ISA this build of vLLM does not carry
        pytest.skip(f"vLLM's CPU build has no '{isa}' cache op here: {exc}")
    return cache.view(torch.int16).numpy().reshape(-1)


def _entries(plan, field: str, flat: np.ndarray) -> dict[tuple[int, int], np.ndarray]:
    """(head, entry index in the request) -> the elements of that entry, read at the plan's addresses."""
    r = plan.regions[0]
    f = r.field(field)
    other = [d for d in f.dims if d.role not in ("head", "token")]
    grid = np.zeros(1, dtype=np.int64)
    for d in other:  # element offsets of one entry, in the field's dim order
        grid = (grid[:, None] + np.arange(d.size)[None, :] * d.stride).reshape(-1)
    token, head = f.dim("token"), f.dim("head")
    out = {}
    for b in range(r.num_blocks):
        for h in range(head.size):
            for e in range(token.size):
                at = r.offset + b * r.block_stride + f.offset + h * head.stride + e * token.stride
                out[(h, b * token.size + e)] = flat[(at + grid) // f.itemsize]
    return out


def _coded(head_dim: int, what: str) -> torch.Tensor:
    """Values bf16 holds exactly: the token, the dim or the head of each element (1-based)."""
    t = torch.arange(TOKENS).view(-1, 1, 1)
    h = torch.arange(HEADS).view(1, -1, 1)
    d = torch.arange(head_dim).view(1, 1, -1)
    shape = (TOKENS, HEADS, head_dim)
    return {"token": t, "dim": d, "head": h}[what].expand(shape).float() + 1


CASES = [("vec", 64), ("vec16", 64), ("vec16", 80), ("amx", 64), ("amx", 128)]


@pytest.mark.parametrize("isa,head_dim", CASES, ids=[f"{i}-d{d}" for i, d in CASES])
def test_each_plan_entry_holds_exactly_its_tokens_as_vllm_writes_them(isa, head_dim):
    """For every ISA, block size and head: each token entry of exact_plan's k and v fields holds the K (V)
    elements of exactly its ``tokens_per_entry`` tokens and that head, every dim once, and (one token per
    entry) in head_dim order; the entry's bytes are the same at block sizes 32, 64 and 128, so plans
    of different block sizes pair entry for entry."""
    per = ISA_LAYOUTS[isa].tokens_per_entry
    seen: dict[str, dict] = {}
    for block in (32, 64, 128):
        plan = exact_plan(_view(isa, block, head_dim))
        assert plan.regions[0].tokens_per_entry == per and plan.groups[0].tokens_per_entry == per
        read = {what: _vllm_cache(isa, block, head_dim, _coded(head_dim, what)) for what in ("token", "dim", "head")}
        for kv, shift in (("k", 0), ("v", 1)):
            got = {what: _entries(plan, kv, flat) for what, flat in read.items()}
            for (h, e), tokens in got["token"].items():
                if e * per >= TOKENS:
                    continue
                tok = torch.tensor(tokens).view(torch.bfloat16).float().numpy() - 1 - shift
                dim = torch.tensor(got["dim"][(h, e)]).view(torch.bfloat16).float().numpy() - 1 - shift
                head = torch.tensor(got["head"][(h, e)]).view(torch.bfloat16).float().numpy() - 1 - shift
                assert set(head.tolist()) == {h}
                pairs = sorted(zip(tok.astype(int).tolist(), dim.astype(int).tolist()))
                assert pairs == [(t, d) for t in range(e * per, (e + 1) * per) for d in range(head_dim)]
                if per == 1:
                    assert dim.astype(int).tolist() == list(range(head_dim))
                key = (kv, h, e)
                order = list(zip(tok.tolist(), dim.tolist()))
                assert seen.setdefault(key, order) == order  # the same entry bytes at every block size


def test_amx_plans_pair_across_block_sizes_and_refuse_vec_saying_why():
    """AMX plans of block 32 and 128 pair (entries of 16 tokens); an AMX engine and a vec engine do not:
    the tokens-per-entry finding names 16 and 1, in the exact plans and in the derived specs."""
    a32, a128 = exact_plan(_view("amx", 32)), exact_plan(_view("amx", 128))
    assert kvlc.check_pair(a32, a128, local_rank=0, direction="READ").ok
    for amx, vec in ((a32, exact_plan(_view("vec", 32))), (derive_plan(_view("amx", 32)),
                                                           derive_plan(_view("vec", 32)))):
        report = kvlc.check_pair(amx, vec, local_rank=0, direction="READ")
        assert not report.ok and "tokens-per-entry" in report.codes()
        assert "tokens_per_entry 16" in str(report) and "tokens_per_entry 1" in str(report)


def test_cpu_isa_mismatch_names_both_isas_and_the_fix():
    """The connector's own check says why an AMX and a vec engine cannot pair and how to make them."""
    from kvlc.engines.vllm.derive.cpu import isa_mismatch

    assert isa_mismatch("vec", "vec16") is None and isa_mismatch("amx", "amx") is None
    why = isa_mismatch("vec", "amx")
    assert "'vec'" in why and "'amx'" in why and "16 tokens" in why and "fix: " in why and "float16" in why
    assert isa_mismatch("", "vec") is None  # not a CPU engine on one side: pairing decides


@pytest.mark.parametrize("isa", ["neon", "rvv", "vxe", "vsx", ""])
def test_isas_kvlc_has_not_established_are_refused_with_a_fix(isa):
    """exact_plan refuses an ISA whose in-block order kvlc has not established, naming it and the fix."""
    with pytest.raises(ViewError, match=r"has not established .* fix: give both engines the spec"):
        isa_layout(isa)
    with pytest.raises(ViewError, match="fix: "):
        exact_plan(_view(isa, 32))


def test_vllm_picks_the_isas_this_module_knows():
    """vLLM 0.32's ISA choice (cpu_attn._get_attn_isa) on this host is one kvlc establishes, for bf16, fp16
    and fp32 engines of head size 64 and 80."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for head in (64, 80):
            assert _get_attn_isa(dtype, 32, head) in ISA_LAYOUTS
    assert _get_attn_isa(torch.float32, 32, 80) == "vec16"


@pytest.mark.parametrize("amx", [False, True], ids=["no-amx", "amx"])
def test_pick_isa_is_vllms_own_choice_on_hosts_with_and_without_amx(monkeypatch, amx):
    """kvlc's offline ISA choice (``derive.cpu.pick_isa``, what ``kvlc init --cpu-isa auto`` writes) equals vLLM
    0.32's ``cpu_attn._get_attn_isa`` for every dtype, block size and head size tried, with the host's AMX
    answer set both ways (vLLM asks torch at each call), so it holds on hosts this suite never ran on."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvlc.engines.vllm.derive.cpu import pick_isa

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    seen = set()
    for kv, dtype in dtypes.items():
        for block in (16, 32, 48, 64, 96, 128, 160, 3200):
            for head in (32, 48, 64, 80, 96, 112, 128, 256):
                want = _get_attn_isa(dtype, block, head)
                assert pick_isa(kv, block, head, amx) == want, (kv, block, head)
                seen.add(want)
    for block in (32, 64, 128):  # an fp8 cache of a bf16 model (vLLM tests the model dtype)
        for head in (64, 128):
            assert pick_isa("fp8_e4m3", block, head, amx) == _get_attn_isa(torch.bfloat16, block, head, "fp8")
    assert seen == ({"vec", "vec16", "amx"} if amx else {"vec", "vec16"})
