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
