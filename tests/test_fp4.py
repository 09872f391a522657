"""fp4_e2m1 (two values per byte along the innermost dim): plan geometry, explain, and pairing refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvlc
from kvlc.compiler.pairing.pair import check_pair
from kvlc.errors import SpecError
from kvlc.explain.numbers import field_short

ROOT = Path(__file__).resolve().parents[1]
NVFP4 = ROOT / "layouts" / "llama-3.1-8b-nvfp4-tp2.yaml"


def test_nvfp4_plan_counts_bytes_of_two_values():
    """128 fp4 values of head_dim are 64 bytes; block scales are one fp8 per 16 values."""
    r = kvlc.compile_spec(NVFP4).region("layer.0")
    k, ks = r.field("k"), r.field("k_scale")
    assert (k.dtype, k.itemsize, k.dims[-1].size, k.nbytes) == ("fp4_e2m1", 1, 64, 4 * 16 * 64)
    assert field_short(k) == "k@0:fp4_e2m1[head=4/8,token=16,head_dim=64x2]"
    assert ks.nbytes == 4 * 16 * 8 and r.block_bytes == 2 * 4096 + 2 * 512


def test_nvfp4_pairs_across_tp():
    """NVFP4 K/V and scales pair TP2 -> TP4 (head-major: one descriptor per field and head slice)."""
    a, b = kvlc.compile_spec(NVFP4), kvlc.compile_spec(str(NVFP4).replace("tp2", "tp4"))
    for rank in range(4):
        assert check_pair(b, a, local_rank=rank, direction="READ").ok


def _spec(order: str, head_dim: int = 128) -> str:
    return NVFP4.read_text().replace("head_dim: 128", f"head_dim: {head_dim}").replace(
        "dims: [{name: head, role: head}, {name: token, role: token}, {name: head_dim}]", order, 1)


def test_packed_dim_must_match():
    """Two engines whose fp4 field packs different innermost dims are refused with `packed-dim`."""
    a = kvlc.compile_spec(_spec("dims: [{name: head, role: head}, {name: token, role: token}, {name: head_dim}, "
                                "{name: two, size: 2}]"))
    b = kvlc.compile_spec(_spec("dims: [{name: head, role: head}, {name: token, role: token}, {name: two, size: 2}, "
                                "{name: head_dim}]"))
    rep = check_pair(a, b, local_rank=0, direction="READ")
    assert [f.code for f in rep.errors] == ["packed-dim"] * 32
    assert rep.errors[0].local == "two" and rep.errors[0].remote == "head_dim"


@pytest.mark.parametrize("head_dim", [7, 129])
def test_odd_innermost_refused(head_dim):
    """An odd innermost size would leave half a byte: refused at the dim with even sizes as the fix."""
    with pytest.raises(SpecError) as info:
        kvlc.compile_spec(_spec("dims: [{name: head, role: head}, {name: token, role: token}, {name: head_dim}]",
                                head_dim))
    text = info.value.render()
    assert "dims[2]" in text and f"has {head_dim}" in text and "even size" in text
