"""Basic contracts of the compiler on a checked-in layout."""

from pathlib import Path

import kvlc
from kvlc.compiler.plan.model import Plan

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ROOT / "layouts" / "llama-3.1-8b.yaml"


def test_same_spec_same_bytes():
    """Compiling the same spec twice yields byte-identical JSON and the same digest."""
    a, b = kvlc.compile_spec(LLAMA), kvlc.compile_spec(LLAMA)
    assert a.to_json() == b.to_json()
    assert a.digest == b.digest and len(a.digest) == 64


def test_json_round_trip():
    """Plan.from_json(plan.to_json()) equals the plan and keeps its digest."""
    plan = kvlc.compile_spec(LLAMA)
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.digest == plan.digest


def test_llama_geometry():
    """Llama-3.1-8B: 32 layers, K then V per block, 16 tokens x 8 heads x 128 bf16 each."""
    plan = kvlc.compile_spec(LLAMA)
    assert len(plan.regions) == 32
    r = plan.region("layer.7")
    assert (r.block_bytes, r.block_stride, r.num_blocks) == (65536, 65536, 4096)
    assert [f.name for f in r.fields] == ["k", "v"] and r.field("v").offset == 32768
    assert [(d.name, d.size, d.stride) for d in r.field("k").dims] == [
        ("token", 16, 2048), ("head", 8, 256), ("head_dim", 128, 2)]


def test_repeat_steps_values_and_unsharded_sections():
    """range [a, b, step] and values [...] stamp exactly those layers; sections without role head stay whole."""
    plan = kvlc.compile_spec(ROOT / "tests" / "fixtures" / "repeat_steps.yaml")
    assert [r.name for r in plan.regions] == ["a0", "a2", "a4", "b1", "b5", "m"]
    conv_x = plan.region("m").field("conv.x")
    assert [(d.name, d.role, d.size) for d in conv_x.dims] == [("tap", "", 3), ("ch", "", 8)]
    assert plan.group("swa").kernel_block_size == 4      # its own block size, not the spec's kernel
    assert plan.storage("s").size == max(r.offset + r.num_blocks * r.block_stride for r in plan.regions)


def test_repeat_needs_exactly_one_source():
    """A repeat with both 'range' and 'values' is refused with a located message."""
    text = (ROOT / "tests" / "fixtures" / "repeat_steps.yaml").read_text().replace(
        "{var: l, values: [1, 5]}", "{var: l, values: [1, 5], range: layers}")
    try:
        kvlc.compile_spec(text)
    except kvlc.SpecError as exc:
        assert "exactly one of 'range' and 'values'" in str(exc) and "<string>:" in str(exc)
    else:
        raise AssertionError("a repeat with range and values compiled")


def one_group_mamba(tp: int, replicated: tuple[str, ...] = ("B", "C")) -> str:
    """A Mamba-2 state layer of a one-group model at TP ``tp``: x 8 channels, B and C 2 each, 3 taps;
    4 SSM heads x 2."""
    rep = f"        replicated: [{', '.join(replicated)}]\n" if replicated else ""
    return f"""kvlc: 1
name: g1-tp{tp}
model: {{name: g1, num_layers: 1, num_kv_heads: 1, head_dim: 8}}
parallel: {{tp_size: {tp}}}
block_size: 4
groups: [{{name: ssm, kind: mamba}}]
storages: [{{name: s, mem: DRAM}}]
layouts:
  mamba:
    fields:
      - name: conv
        kind: sections
        dtype: fp32
{rep}        dims:
          - {{name: conv_tap, size: 3}}
          - {{name: channel, role: head, sections: {{x: 8, B: 2, C: 2}}}}
      - name: ssm
        dtype: fp32
        dims:
          - {{name: ssm_head, role: head, size: 4}}
          - {{name: ssm_state, size: 2}}
regions:
  - {{name: layer.0, storage: s, layout: mamba, num_blocks: 4, groups: [ssm]}}
"""


def test_replicated_sections_are_whole_on_every_rank():
    """replicated: [B, C] at TP 2: conv.x holds 4 of 8 channels (head role), conv.B and conv.C all 2 (plain dims),
    packed x|B|C per tap as vLLM keeps a one-group Mamba-2 conv state; the SSM state stays split by heads."""
    r = kvlc.compile_spec(one_group_mamba(2)).region("layer.0")
    got = {f.name: (f.offset, [(d.name, d.role, d.size, d.global_size, d.stride) for d in f.dims])
           for f in r.fields}
    assert got == {"conv.x": (0, [("conv_tap", "", 3, 3, 32), ("channel", "head", 4, 8, 4)]),
                   "conv.B": (16, [("conv_tap", "", 3, 3, 32), ("channel", "", 2, 2, 4)]),
                   "conv.C": (24, [("conv_tap", "", 3, 3, 32), ("channel", "", 2, 2, 4)]),
                   "ssm": (96, [("ssm_head", "head", 2, 4, 8), ("ssm_state", "", 2, 2, 4)])}
    assert r.block_bytes == 96 + 2 * 2 * 4


def test_replicated_sections_pair_across_tp():
    """TP 2 -> TP 1: the consumer reads x and the SSM heads half from each producer rank, B and C once, whole,
    from rank 0; TP 1 -> TP 2: each consumer rank reads its x half and all of B and C from the one producer."""
    from kvlc.compiler.pairing.pair import pair

    tp1, tp2 = kvlc.compile_spec(one_group_mamba(1)), kvlc.compile_spec(one_group_mamba(2))
    prog = pair(tp1, tp2, local_rank=0, direction="READ")
    pieces = {(e.peer, p.field, p.h0, p.h1) for e in prog.entries for p in e.pieces}
    assert pieces == {(0, "conv.x", 0, 4), (1, "conv.x", 4, 8), (0, "conv.B", 0, 0), (0, "conv.C", 0, 0),
                      (0, "ssm", 0, 2), (1, "ssm", 2, 4)}
    for rank in (0, 1):
        prog = pair(tp2, tp1, local_rank=rank, direction="READ")
        pieces = {(e.peer, p.field, p.h0, p.h1) for e in prog.entries for p in e.pieces}
        assert pieces == {(0, "conv.x", 4 * rank, 4 * rank + 4), (0, "conv.B", 0, 0), (0, "conv.C", 0, 0),
                          (0, "ssm", 2 * rank, 2 * rank + 2)}
