"""The layout value type and the shared integer rules hold their stated post-conditions (hypothesis)."""

from __future__ import annotations

from math import gcd, prod

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlc.compiler.algebra.layout import (Layout, ceildiv, head_range, holders, is_state_kind, kernel_ids, lcm,
                                  row_major, shard, slice_mode, split_mode, tile, valid_tp_sizes)

FAST = settings(max_examples=200, deadline=None)
shapes = st.lists(st.integers(1, 6), min_size=1, max_size=4)


@FAST
@given(shapes, st.sampled_from([1, 2, 4]))
def test_row_major_is_compact_and_bijective(shape, item):
    """row_major: offsets of row-major coordinates are 0, item, 2*item, … (size == cosize/item)."""
    L = row_major(shape, item)
    assert L.offsets().tolist() == [i * item for i in range(prod(shape))]
    assert L.size == prod(shape) and L.cosize == (prod(shape) - 1) * item + 1


@FAST
@given(shapes, st.data())
def test_call_matches_offsets_and_text_round_trips(shape, data):
    """L(coord) equals the dot product with the strides; L(i) follows row-major order; text parses back."""
    strides = tuple(data.draw(st.integers(0, 50)) for _ in shape)
    L = Layout(tuple(shape), strides)
    offs = L.offsets()
    for i in range(L.size):
        coord = np.unravel_index(i, shape)
        assert L(*coord) == sum(int(c) * s for c, s in zip(coord, strides)) == offs[i] == L(i)
    assert Layout.parse(str(L)) == L


@FAST
@given(shapes, st.data())
def test_slice_mode_shifts_by_its_base(shape, data):
    """slice_mode: base + sub(c) == L(c with start added to the mode)."""
    L = row_major(shape, 2)
    mode = data.draw(st.integers(0, len(shape) - 1))
    start = data.draw(st.integers(0, shape[mode] - 1))
    stop = data.draw(st.integers(start + 1, shape[mode]))
    sub, base = slice_mode(L, mode, start, stop)
    for i in range(sub.size):
        c = list(np.unravel_index(i, sub.shape))
        full = list(c)
        full[mode] += start
        assert base + sub(*c) == L(*full)


@FAST
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.integers(1, 5))
def test_split_mode_pieces_cover_the_layout(sizes, inner):
    """split_mode: the pieces' offsets, shifted by their bases, are exactly the layout's, in order."""
    L = row_major((sum(sizes), inner))
    got = np.concatenate([p.offsets() + b for p, b in split_mode(L, 0, sizes)])
    assert got.tolist() == L.offsets().tolist()


def test_bad_layouts_are_refused():
    """Rank mismatch, empty modes and slices outside a mode raise ValueError."""
    with pytest.raises(ValueError):
        Layout((2, 3), (1,))
    with pytest.raises(ValueError):
        Layout((0,), (1,))
    with pytest.raises(ValueError):
        slice_mode(row_major((4,)), 0, 3, 5)


@FAST
@given(st.integers(1, 512), st.integers(1, 512))
def test_tile_lcm_and_ceildiv(a, b):
    """tile: tokens = lcm(a, b), a_blocks*a == b_blocks*b == tokens, chunk = gcd; ceildiv is the ceiling."""
    t = tile(a, b)
    assert t.tokens == lcm(a, b) == a * b // gcd(a, b)
    assert t.a_blocks * a == t.b_blocks * b == t.tokens and t.chunk == gcd(a, b)
    q = ceildiv(a, b)
    assert q * b >= a > (q - 1) * b


@FAST
@given(st.integers(1, 64), st.integers(1, 64))
def test_shard_rule_and_head_ranges(heads, tp):
    """shard / head_range / holders agree: ranges cover every head; each head's holders hold it."""
    per = shard(heads, tp)
    assert (tp in valid_tp_sizes(heads, 64)) == (per is not None)
    if per is None:
        assert heads % tp and tp % heads
        return
    ranges = [head_range(r, heads, tp) for r in range(tp)]
    assert all(h1 - h0 == per for h0, h1 in ranges)
    assert sorted({h for h0, h1 in ranges for h in range(h0, h1)}) == list(range(heads))
    if heads % tp == 0:  # sharded: disjoint
        assert sum(h1 - h0 for h0, h1 in ranges) == heads
    for h in range(heads):
        for r in holders(h, heads, tp):
            h0, h1 = ranges[r]
            assert h0 <= h < h1
        assert len(holders(h, heads, tp)) == max(1, tp // heads)


@FAST
@given(st.lists(st.integers(0, 1000), max_size=20), st.integers(1, 4))
def test_kernel_ids_expand_each_block(ids, m):
    """kernel_ids: m kernel ids per block id, ``out // m`` repeats each id m times, ``out % m`` counts up."""
    out = kernel_ids(np.array(ids, dtype=np.int64), m)
    assert len(out) == len(ids) * m
    assert (out // m).tolist() == [i for i in ids for _ in range(m)]
    assert (out % m).tolist() == list(range(m)) * len(ids)


def test_state_kinds():
    """Mamba and linear attention are per-request state; attention kinds are not."""
    assert is_state_kind("mamba") and is_state_kind("linear_attention")
    assert not any(is_state_kind(k) for k in ("full_attention", "sliding_window", "indexer", "chunked_local"))


@pytest.mark.parametrize("path", ["layouts/llama-3.1-8b.yaml", "layouts/llama-3.1-70b-hnd-tp4.yaml",
                                  "layouts/nemotron-h-8b-tp2.yaml", "layouts/deepseek-v3.2-tp8.yaml"])
def test_plan_field_layouts_give_each_element_its_offset(path):
    """PlanField.layout maps every element coordinate to the byte offset the dims' strides give."""
    import kvlc

    for r in kvlc.compile_spec(path).regions[:4]:
        for f in r.fields:
            L = f.layout
            assert L.shape == tuple(d.size for d in f.dims) and str(L) == str(Layout.parse(str(L)))
            want = np.zeros(1, dtype=np.int64)
            for d in f.dims:
                want = (want[:, None] + np.arange(d.size)[None, :] * d.stride).ravel()
            assert L.offsets().tolist() == want.tolist()
            assert f.offset + L.cosize - 1 + f.itemsize == f.offset + f.extent
