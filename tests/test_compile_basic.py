"""Basic contracts of the compiler on a checked-in layout."""

from pathlib import Path

import kvlc
from kvlc.compiler.plan import Plan

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
