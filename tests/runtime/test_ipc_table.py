"""The same-host copy's row table in C (kvlc/runtime/ipc/table.c) against its numpy reference.

``_Windows.table`` builds a part's launch: the peer's rows moved into their mapped windows, sources
first, rows cut at a chunk. With the C library it is one pass; with ``KVLC_NATIVE=0`` (the library not
loaded) numpy's ``translate`` + ``row_table`` build it. Hypothesis draws windows (several storages, two
memory types), rows anywhere up to 2**64 (lengths that wrap), rows inside and outside them, lengths around the chunk and zero,
both directions: the tables, their launch constants and the refusals (row index and sentence) agree.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlc.runtime.ipc import native
from kvlc.runtime.ipc.cuda import IpcError
from kvlc.runtime.ipc.memory import Mapped, Window
from kvlc.runtime.ipc.route import _Windows

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"table.c: {native.status()}")

TOP = (1 << 64) - 1


def _reference(w: _Windows, *args, **kw):
    """``w.table`` as it runs where the library is not loaded (route.py asks ``native.library()``)."""
    saved = native.library
    native.library = lambda: None  # noqa: E731
    try:
        return w.table(*args, **kw)
    finally:
        native.library = saved


def _both(w: _Windows, *args, **kw):
    out = []
    for build in (w.table, lambda *a, **k: _reference(w, *a, **k)):
        try:
            out.append(build(*args, **kw))
        except IpcError as exc:
            out.append(str(exc))
    return out


@st.composite
def _case(draw):
    n_win = draw(st.integers(1, 4))
    user = 1 << 56  # pointers of a process (5-level paging at most): every shift fits an int64
    starts = sorted(draw(st.lists(st.integers(0, user - (1 << 24)), min_size=n_win, max_size=n_win, unique=True)))
    windows = []
    for i, a in enumerate(starts):
        room = (starts[i + 1] - a) if i + 1 < len(starts) else (1 << 24)
        size = draw(st.integers(1, min(room, 1 << 24)))
        base = draw(st.integers(0, user)) & ~draw(st.sampled_from([0, 7, 15]))
        windows.append(Window(f"s{i}", draw(st.sampled_from(["VRAM", "DRAM"])), a, size, base, 0))
    chunk = draw(st.sampled_from([16, 64, 4096]))
    n = draw(st.integers(0, 12))
    rows = []
    for _ in range(n):
        w = draw(st.sampled_from(windows))
        if draw(st.integers(0, 9)) == 0:  # anywhere (mostly outside, up to 2**64 - 1), or a length that wraps
            addr, length = draw(st.integers(0, TOP)), draw(st.integers(0, TOP))
        else:
            off = draw(st.integers(0, w.size - 1))
            length = draw(st.integers(0, min(w.size - off, 3 * chunk + 5)))
            addr = w.addr + off
        mine = draw(st.integers(0, 1 << 60)) & ~draw(st.sampled_from([0, 1, 15]))
        rows.append(((mine, length, 0), (addr, length, 1)))
    local = np.array([r[0] for r in rows], dtype=np.uint64).reshape(-1, 3)
    remote = np.array([r[1] for r in rows], dtype=np.uint64).reshape(-1, 3)
    return windows, local, remote, chunk, draw(st.sampled_from(["VRAM", "DRAM"])), draw(st.booleans())


@settings(max_examples=300, deadline=None)
@given(_case())
def test_native_table_equals_the_reference(case):
    windows, local, remote, chunk, mem, write = case
    w = _Windows(Mapped("peer", windows))
    got, ref = _both(w, local, remote, mem, write, "WRITE part", chunk=chunk)
    if isinstance(ref, str):
        assert got == ref  # the same row refused, in the same words
        return
    assert not isinstance(got, str), got
    assert (got.rows, got.wide, got.vec) == (ref.rows, ref.wide, ref.vec)
    assert got.table.dtype == np.int64 and np.array_equal(got.table, ref.table)


def test_native_table_of_a_part_in_one_window():
    """The usual case, by hand: a WRITE's sources are this side's rows, destinations the peer's moved by
    its window's shift; a row longer than the chunk is cut, in order."""
    w = _Windows(Mapped("peer", [Window("kv", "VRAM", 1 << 40, 1 << 20, 7 << 40, 0)]))
    local = np.array([[4096, 64, 0], [8192, 160, 0]], dtype=np.uint64)
    remote = np.array([[(1 << 40) + 128, 64, 0], [(1 << 40) + 4096, 160, 0]], dtype=np.uint64)
    g = w.table(local, remote, "VRAM", True, "WRITE", chunk=64)
    t = g.table.view(np.uint64).reshape(3, -1)
    assert g.rows == 4 and g.wide and g.vec  # every address and length a multiple of 16
    assert t[0].tolist() == [4096, 8192, 8256, 8320]
    assert t[1].tolist() == [(7 << 40) + 128, (7 << 40) + 4096, (7 << 40) + 4160, (7 << 40) + 4224]
    assert t[2].tolist() == [64, 64, 64, 32]
    with pytest.raises(IpcError, match=r"WRITE: row 0 \(\[0x10000000080, \+64\) of the peer's DRAM\) lies outside"):
        w.table(local, remote, "DRAM", True, "WRITE")  # the window holds VRAM
    remote[1, 1] = 1 << 20  # past the window's end
    with pytest.raises(IpcError, match=r"row 1 \(\[0x10000001000, \+1048576\) of the peer's VRAM\)"):
        w.table(local, remote, "VRAM", False, "READ")


@st.composite
def _regions_and_rows(draw):
    """Non-overlapping regions anywhere below 2**64 and rows in, across, beside and past them (zero lengths too)."""
    cuts = sorted(draw(st.sets(st.integers(0, TOP), min_size=2, max_size=12)))
    bounds = [(a, b) for a, b in zip(cuts[::2], cuts[1::2]) if b > a]
    rows = []
    for _ in range(draw(st.integers(1, 40))):
        if bounds and draw(st.booleans()):
            a, b = draw(st.sampled_from(bounds))
            at = draw(st.integers(a, b - 1))
            rows.append((at, draw(st.sampled_from([0, 1, b - at, b - at + 1, (b - at) // 2 + 1]))))
        else:
            rows.append((draw(st.integers(0, TOP)), draw(st.integers(0, TOP))))
    return bounds, rows


@settings(max_examples=300, deadline=None)
@given(_regions_and_rows())
def test_dram_rows_inside_regions_in_c_agree_with_the_reference(case):
    """HostCopy's check in C (``native.first_outside``) against :meth:`Regions.locate`: the same verdict, and
    the first row outside is the one the reference names."""
    from kvlc.runtime.staging.copy import Region, Regions, StagingError

    bounds, rows = case
    regions = Regions([Region(a, b - a, None) for a, b in bounds])
    addr = np.array([r[0] for r in rows], dtype=np.uint64)
    lens = np.array([r[1] for r in rows], dtype=np.uint64)
    starts = np.array([a for a, _ in bounds], dtype=np.uint64)
    stops = np.array([b for _, b in bounds], dtype=np.uint64)
    got = native.first_outside(addr, lens, starts, stops)
    try:
        regions.locate(np.stack([addr, lens], axis=1), "row")
        want = -1
    except StagingError as exc:
        want = int(str(exc).split()[1])
    assert got == want
