"""Binding refuses storages bound to overlapping memory, exactly: real torch views, slices and as_strided
tensors, checked against a brute-force byte map; adjacent ranges and disjoint views of one allocation bind."""

from __future__ import annotations

from functools import lru_cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlc import compile_spec
from kvlc.compiler.plan.model import PlanStorage
from kvlc.runtime import BindingError
from kvlc.runtime.binding import Bound, bind, overlaps

torch = pytest.importorskip("torch")


@lru_cache(maxsize=None)
def plan_of(sizes: tuple[int, ...]):
    """A DRAM plan with storages ``s.0 .. s.n`` of the given sizes (one 8-byte block each)."""
    storages = "\n".join(f"  - {{name: s.{i}, mem: DRAM, size: {n}}}" for i, n in enumerate(sizes))
    regions = "\n".join(f"  - {{name: r.{i}, storage: s.{i}, layout: cell, num_blocks: 1, groups: [g]}}"
                        for i in range(len(sizes)))
    return compile_spec(f"""kvlc: 1
name: overlap-test
model: {{name: t, num_layers: 1}}
parallel: {{tp_size: 1}}
block_size: 8
groups: [{{name: g, kind: full_attention}}]
storages:
{storages}
layouts:
  cell: {{fields: [{{name: c, dtype: fp8_e4m3, dims: [{{name: token, role: token}}]}}]}}
regions:
{regions}
""")


def test_disjoint_views_of_one_allocation_bind():
    """Per-layer views of one allocation (as vLLM hands FLASH_ATTN layers) bind: equal base, adjacent ranges."""
    plan = plan_of((64, 64, 64))
    raw = torch.zeros(3 * 64, dtype=torch.uint8)
    views = raw.view(3, 64)
    bound = bind(plan, {f"s.{i}": views[i] for i in range(3)})
    assert [b.addr - raw.data_ptr() for b in bound.values()] == [0, 64, 128]
    assert {b.tensor.untyped_storage().data_ptr() for b in bound.values()} == {raw.data_ptr()}


def test_overlapping_slices_are_refused_naming_both_ranges_and_the_fix():
    plan = plan_of((64, 64))
    raw = torch.zeros(256, dtype=torch.uint8)
    a, b = raw[0:64], raw[48:112]
    base = raw.data_ptr()
    with pytest.raises(BindingError) as err:
        bind(plan, {"s.0": a, "s.1": b})
    assert str(err.value) == (
        "1 binding problem for plan 'overlap-test':\n"
        f"  storages 's.0' and 's.1' are bound to overlapping memory on DRAM:0: 's.0' at [{base:#x}, "
        f"{base + 64:#x}) and 's.1' at [{base + 48:#x}, {base + 112:#x}) share 16 bytes [{base + 48:#x}, "
        f"{base + 64:#x}); the compiler checks overlap only between regions of one storage; fix: declare one "
        "storage for the allocation with a region per part ('s.1' at offset 48 of 's.0'), and 'aliases' between "
        "regions that really share pages")


def test_one_tensor_for_two_storages_is_refused():
    """The same tensor given twice (identical ranges) overlaps in every byte."""
    plan = plan_of((64, 64))
    t = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(BindingError, match=r"storages 's.0' and 's.1' .* share 64 bytes"):
        bind(plan, {"s.0": t, "s.1": t})


def test_as_strided_and_typed_views_use_their_byte_ranges():
    """An as_strided window at a storage offset and a bf16 view are placed by data_ptr and element size."""
    plan = plan_of((64, 64))
    raw = torch.zeros(512, dtype=torch.uint8)
    first = raw.view(torch.bfloat16)[:32]                       # bytes [0, 64)
    second = raw.as_strided((64,), (1,), storage_offset=64)      # bytes [64, 128): adjacent
    assert set(bind(plan, {"s.0": first, "s.1": second})) == {"s.0", "s.1"}
    third = raw.as_strided((64,), (1,), storage_offset=63)       # bytes [63, 127): one shared byte
    with pytest.raises(BindingError, match=r"share 1 bytes"):
        bind(plan, {"s.0": first, "s.1": third})


def test_tail_beyond_the_storage_does_not_count():
    """Only the storage's bytes count: a longer tensor whose tail lies under another storage binds."""
    plan = plan_of((64, 64))
    raw = torch.zeros(256, dtype=torch.uint8)
    bound = bind(plan, {"s.0": raw[0:200], "s.1": raw[64:128]})
    assert bound["s.0"].nbytes == 200 and bound["s.0"].stop == bound["s.1"].addr


def test_many_overlaps_are_capped_in_the_message():
    plan = plan_of((16,) * 6)
    t = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(BindingError) as err:
        bind(plan, {f"s.{i}": t for i in range(6)})
    lines = str(err.value).splitlines()
    assert lines[0] == "9 binding problems for plan 'overlap-test':" and lines[-1] == "  ... and 7 more overlapping pairs"


def _bound(name: str, mem: str, device: int, addr: int, size: int) -> Bound:
    return Bound(PlanStorage(name=name, mem=mem, device=device, size=size), None, addr, size, device)


def test_overlap_only_on_one_memory_type_and_device():
    """Equal addresses on different devices or memory types are different bytes."""
    xs = [_bound("a", "VRAM", 0, 4096, 100), _bound("b", "VRAM", 1, 4096, 100), _bound("c", "DRAM", 0, 4096, 100)]
    assert overlaps(xs) == []
    y = _bound("d", "VRAM", 1, 4100, 10)
    assert [(o.first.name, o.second.name, o.start, o.stop) for o in overlaps(xs + [y])] == [("b", "d", 4100, 4110)]


def brute_pairs(ranges: list[tuple[int, int]]) -> set[tuple[int, int]]:
    """Storage index pairs sharing a byte, from a byte → storages map."""
    owners: dict[int, list[int]] = {}
    for i, (start, stop) in enumerate(ranges):
        for byte in range(start, stop):
            owners.setdefault(byte, []).append(i)
    return {(i, j) for who in owners.values() for i in who for j in who if i < j}


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(8, 48), st.integers(0, 160), st.integers(0, 24)), min_size=2, max_size=6))
def test_overlaps_equal_a_brute_force_byte_map(specs):
    """For storages bound to random slices of one buffer (some longer than their storage), the pairs
    reported are exactly the pairs whose storage bytes share a byte, and bind succeeds iff there are none."""
    sizes = tuple(size for size, _, _ in specs)
    plan = plan_of(sizes)
    raw = torch.zeros(256, dtype=torch.uint8)
    tensors = {f"s.{i}": raw[off:off + size + tail] for i, (size, off, tail) in enumerate(specs)}
    want = brute_pairs([(off, off + size) for size, off, _ in specs])
    bounds = [Bound(s, tensors[s.name], tensors[s.name].data_ptr(), tensors[s.name].numel(), 0)
              for s in plan.storages]
    got = {tuple(sorted((int(o.first.name[2:]), int(o.second.name[2:])))) for o in overlaps(bounds)}
    assert got == want
    for o in overlaps(bounds):
        assert o.first.addr <= o.second.addr and o.stop - o.start == len(
            set(range(o.first.addr, o.first.stop)) & set(range(o.second.addr, o.second.stop)))
    if want:
        with pytest.raises(BindingError, match="bound to overlapping memory"):
            bind(plan, tensors)
    else:
        assert set(bind(plan, tensors)) == set(tensors)
