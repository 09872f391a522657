"""A part in block form on the same-host route (``_Windows.blocks``) against its rows (``_Windows.table``).

The launch a GPU's block kernel gets (entries with the peer's bases moved into its mapped windows, and the
request's ids) must stand for the same (source, destination, length) bytes as the row table the route builds
from the part's rows; where an entry's extent (where any of its rows can lie) reaches outside the windows,
or they hold another memory type, there is no block launch (checked once per table, for every entry's
extent: the rows then decide, and word any refusal).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import kvlc
from kvlc import bind
from kvlc.compiler.algebra.copies import coalesce_rows
from kvlc.compiler.pairing.pair import pair
from kvlc.compiler.request.blocks import block_copies
from kvlc.compiler.request.check import check_request
from kvlc.compiler.request.instantiate import emit
from kvlc.runtime.ipc.copy import ENTRY
from kvlc.runtime.ipc.cuda import IpcError
from kvlc.runtime.ipc.memory import Mapped, Window
from kvlc.runtime.ipc.route import GRID_YZ, _Windows

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_native import pair_requests  # noqa: E402
from test_pair_properties import PROPS, pair_case  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LOCAL, REMOTE, MAPPED = 1 << 40, 2 << 40, 7 << 40


def _bound(path: str, direction: str):
    plan = kvlc.compile_spec(ROOT / path)
    prog = pair(plan, plan, local_rank=0, direction=direction)
    at = lambda base: {s.name: base + i * (1 << 36) for i, s in enumerate(plan.storages)}  # noqa: E731
    return plan, bind(prog, at(LOCAL), {0: at(REMOTE)})


def _windows(plan, mem: str = "VRAM", short: int = 0) -> _Windows:
    return _Windows(Mapped("peer", [Window(s.name, mem, REMOTE + i * (1 << 36), s.size - short,
                                           MAPPED + i * (1 << 36), 0) for i, s in enumerate(plan.storages)]))


def _launch_rows(b) -> np.ndarray:
    """(source, destination, length) of every row the block kernel moves, from its entries and ids."""
    ent, ids, out = b.entries.reshape(-1, ENTRY), b.ids, []
    for lb, ls, rb, rs, length, slot, lsub, lblk, rsub, rblk in ent.tolist():
        la, ra, n = ids[3 * slot:3 * slot + 3].tolist()
        k = np.arange(n)
        a = lb + ids[la + k * lsub + lblk] * ls
        r = rb + ids[ra + k * rsub + rblk] * rs
        s, d = (a, r) if b.write else (r, a)
        out.append(np.stack([s, d, np.full(n, length)], axis=1))
    return np.concatenate(out)


def _canonical(src, dst, lens) -> np.ndarray:
    rows = lambda a: np.stack([np.asarray(a, np.int64).view(np.uint64), np.asarray(lens, np.uint64),  # noqa: E731
                               np.zeros(len(lens), np.uint64)], axis=1)
    s, d = rows(src), rows(dst)
    order = np.argsort(s[:, 0], kind="stable")
    s, d = coalesce_rows(s[order], d[order])
    return np.concatenate([s[:, :2], d[:, :1]], axis=1)


@settings(deadline=None, max_examples=30)
@given(data=st.data())
def test_block_launch_moves_the_bytes_of_the_row_table(data):
    path = data.draw(st.sampled_from(["layouts/llama-3.1-8b.yaml", "layouts/deepseek-v3-tp1.yaml"]))
    direction = data.draw(st.sampled_from(["READ", "WRITE"]))
    plan, bound = _bound(path, direction)
    group = plan.groups[0]
    n = data.draw(st.integers(1, 40))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    cap = plan.regions[0].capacity
    ids = {"local": rng.permutation(cap)[:n].tolist(), "remote": rng.permutation(cap)[:n].tolist()}
    cut = data.draw(st.integers(0, group.block_size - 1))  # tokens short of the last block's end (a partial tile)
    req = check_request(bound.program, {group.name: ids["local"]}, {group.name: ids["remote"]},
                        n * group.block_size - cut)
    parts, forms = emit(bound, req), block_copies(bound, req)
    assert set(forms) == set(parts)
    w = _windows(plan)
    write = direction == "WRITE"
    for key, form in forms.items():
        b = w.blocks(form, key.remote_mem, write)
        assert b is not None and b.write == write and b.vec
        assert (form.table.slots > len(form.table.blocks)) == (cut > 0)  # the partial tiles' slots
        assert w.blocks(form, key.remote_mem, write).kept is b.kept  # the table's entries, once per peer
        t = w.table(parts[key].local, parts[key].remote, key.remote_mem, write, "part", chunk=1 << 62)
        table = t.table.reshape(3, -1)
        got = _launch_rows(b)
        assert np.array_equal(_canonical(got[:, 0], got[:, 1], got[:, 2]), _canonical(*table))
        assert w.blocks(form, "DRAM", write) is None  # the windows hold VRAM


@settings(PROPS, max_examples=60)
@given(case=pair_case(), data=st.data())
def test_block_launch_of_random_pairs_moves_the_bytes_of_the_row_table(case, data):
    """The engine pairs of test_pair_properties (TP, block sizes, dim orders, MLA, Mamba state, sliding windows;
    tiles of several runs and kernel blocks), every rank, both directions, counts and token ranges: each part's
    block launch (the peer's storages mapped at another address) moves the bytes of its row table."""
    checked = 0
    for bound, req, *_ in pair_requests(case, data):
        parts, forms = emit(bound, req), block_copies(bound, req)
        assert set(forms) == set(parts)
        remote = bound.program.remote
        for key, form in forms.items():
            bases = bound.remote[key.peer_rank].addr.tolist()
            w = _Windows(Mapped(f"peer{key.peer_rank}", [Window(st_.name, st_.mem, a, st_.size, a + MAPPED, 0)
                                                          for st_, a in zip(remote.storages, bases)]))
            write = bound.program.direction == "WRITE"
            b = w.blocks(form, key.remote_mem, write)
            if b is None:  # only where the grid could not hold the entries
                assert form.table.entries > GRID_YZ
                continue
            t = w.table(parts[key].local, parts[key].remote, key.remote_mem, write, "part", chunk=1 << 62)
            got = _launch_rows(b)
            assert np.array_equal(_canonical(got[:, 0], got[:, 1], got[:, 2]), _canonical(*t.table.reshape(3, -1)))
            checked += 1
    assume(checked)


def test_no_block_launch_where_an_extent_reaches_past_its_window():
    """A window cut one byte short of its storage: the last block of a region lies past it, so no request of
    that table gets a block launch (checked once, for the extents); the rows path then moves a request that
    stays inside and refuses one that touches the last block, in its words."""
    plan, bound = _bound("layouts/llama-3.1-8b.yaml", "WRITE")
    group, region = plan.groups[0], plan.regions[0]
    w = _windows(plan, short=1)
    last = region.capacity - 1
    near = check_request(bound.program, {group.name: [0]}, {group.name: [1]}, group.block_size)
    far = check_request(bound.program, {group.name: [0]}, {group.name: [last]}, group.block_size)
    for req in (near, far):
        (key, form), = block_copies(bound, req).items()
        assert w.blocks(form, "VRAM", True) is None
    (key, part), = emit(bound, near).items()
    assert w.table(part.local, part.remote, "VRAM", True, "WRITE").rows
    (key, part), = emit(bound, far).items()
    with pytest.raises(IpcError, match="lies outside every storage it shared"):
        w.table(part.local, part.remote, "VRAM", True, "WRITE")
    assert _windows(plan).blocks(form, "VRAM", True) is not None  # whole windows: a launch


class _Agent:
    """The executor's agent, recording what it was handed: ``by_blocks`` says whether it takes a block form."""

    def __init__(self, by_blocks: bool):
        self.by_blocks, self.calls = by_blocks, []

    def initialize_blocks(self, op, blocks, local_mem, remote_mem, peer, rows, what=""):
        self.calls.append(("blocks", rows))
        return "by-blocks" if self.by_blocks else None

    def initialize(self, op, local, local_mem, remote, remote_mem, peer, what=""):
        self.calls.append(("rows", len(local)))
        return "by-rows"


@pytest.mark.parametrize("by_blocks", [True, False])
def test_the_executor_builds_rows_only_where_the_block_form_is_not_taken(by_blocks):
    """Every part in block form: parts whose copy takes the form never build their rows; where it is not
    taken (NIXL, DRAM, an extent outside the windows) the rows are built then, once for the request."""
    from kvlc.compiler.request.blocks import BlockPart
    from kvlc.runtime.transfer import Executor

    plan, bound = _bound("layouts/llama-3.1-8b.yaml", "WRITE")
    group = plan.groups[0]
    req = check_request(bound.program, {group.name: [5, 9, 2]}, {group.name: [1, 2, 3]}, 3 * group.block_size)
    parts = emit(bound, req, blocks=True)
    assert parts and all(isinstance(p, BlockPart) and not p.built for p in parts.values())
    agent = _Agent(by_blocks)
    runs = [Executor(agent, 0)._one("r", "WRITE", key, p, "peer") for key, p in parts.items()]
    rows = emit(bound, req)
    assert [r.xfer for r in runs] == ["by-blocks" if by_blocks else "by-rows"] * len(parts)
    assert [r.nbytes for r in runs] == [p.nbytes for p in rows.values()]
    assert all(p.built is not by_blocks for p in parts.values())
    want = [c for p in rows.values() for c in [("blocks", len(p))] + ([] if by_blocks else [("rows", len(p))])]
    assert agent.calls == want


def test_partial_tile_tables_are_made_once_per_span_and_kept_within_bounds(monkeypatch):
    """A part's table with a request's partial tiles is made once per token span and shared by the requests
    that end there; the binding keeps the last EDGE_TABLES of them and a peer's windows the entries of the last
    ENTRIES_KEPT tables; one made again after it went moves the same bytes."""
    from kvlc.compiler.request import blocks as blocks_mod
    from kvlc.runtime.ipc import route as route_mod

    monkeypatch.setattr(blocks_mod, "EDGE_TABLES", 3)
    monkeypatch.setattr(route_mod, "ENTRIES_KEPT", 2)
    plan, bound = _bound("layouts/llama-3.1-8b.yaml", "WRITE")
    group = plan.groups[0]
    w = _windows(plan)
    first = []
    for cut in range(1, 6):
        lids, rids = list(range(cut, cut + 8)), list(range(100 - cut, 108 - cut))  # other ids, the same span
        req = check_request(bound.program, {group.name: lids}, {group.name: rids}, 8 * group.block_size - cut)
        (key, form), = block_copies(bound, req).items()
        again = check_request(bound.program, {group.name: rids}, {group.name: lids}, 8 * group.block_size - cut)
        assert block_copies(bound, again)[key].table is form.table
        b = w.blocks(form, key.remote_mem, True)
        t = w.table(emit(bound, req)[key].local, emit(bound, req)[key].remote, key.remote_mem, True, "part",
                    chunk=1 << 62)
        got = _launch_rows(b)
        assert np.array_equal(_canonical(got[:, 0], got[:, 1], got[:, 2]), _canonical(*t.table.reshape(3, -1)))
        first.append(form.table)
        assert len(bound.memo.get("block_edge_tables", dict)) <= 3 and len(w._entries) <= 2
    req = check_request(bound.program, {group.name: list(range(8))}, {group.name: list(range(8))},
                        8 * group.block_size - 1)
    (key, form), = block_copies(bound, req).items()
    assert form.table is not first[0]  # (its span's table went: made again, the same entries)
    assert all(np.array_equal(getattr(form.table, f), getattr(first[0], f)) for f in blocks_mod._FIELDS)


def test_a_part_with_host_memory_goes_by_its_rows():
    """The same-host route takes a part's block form only where both sides are VRAM: a part with host memory on
    either side (the GPU reading or writing pinned DRAM) moves by its rows, whose merged rows cross PCIe in long
    pieces (run 36: 0.49 of the pinned copy by block ids against 0.79-0.88 by rows)."""
    import types

    from kvlc.runtime.ipc.copy import GpuCopy
    from kvlc.runtime.ipc.route import IpcRoute
    from testkit.gpu_standin import TorchStandIn

    plan, bound = _bound("layouts/llama-3.1-8b.yaml", "WRITE")
    group = plan.groups[0]
    req = check_request(bound.program, {group.name: [3, 9]}, {group.name: [4, 1]}, 2 * group.block_size)
    (key, form), = block_copies(bound, req).items()
    storages = {s.name: types.SimpleNamespace(device=0, mem="VRAM", addr=LOCAL, nbytes=s.size) for s in plan.storages}
    route = IpcRoute(None, storages)
    route._gpu_copy = GpuCopy(0, torch=TorchStandIn(), kernel=None)
    route._dram_reach = True  # (this side's DRAM pinned and mapped: the GPU copies it)
    route.peers["peer"] = _windows(plan)
    assert route.copies_part("peer", "DRAM", "VRAM", 1 << 20)
    assert route.initialize_blocks("WRITE", form, "DRAM", "VRAM", "peer", form.runs) is None
    x = route.initialize_blocks("WRITE", form, "VRAM", "VRAM", "peer", form.runs)
    assert x is not None and x.launch is None and route.block_copies == 1
    x.release()
