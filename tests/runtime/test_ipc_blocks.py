"""A part in block form on the same-host route (``_Windows.blocks``) against its rows (``_Windows.table``).

The launch a GPU's block kernel gets (entries with the peer's bases moved into its mapped windows, and the
request's ids) must stand for the same (source, destination, length) bytes as the row table the route builds
from the part's rows; where a request's rows reach outside the windows, or the windows hold another memory
type, there is no block launch (the rows decide, and word the refusal).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlc
from kvlc import bind
from kvlc.compiler.algebra.copies import coalesce_rows
from kvlc.compiler.pairing.pair import pair
from kvlc.compiler.request.blocks import block_copies
from kvlc.compiler.request.check import check_request
from kvlc.compiler.request.instantiate import emit
from kvlc.runtime.ipc.copy import ENTRY
from kvlc.runtime.ipc.memory import Mapped, Window
from kvlc.runtime.ipc.route import _Windows

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
    for lb, ls, rb, rs, length, slot in ent.tolist():
        la, ra, n = ids[3 * slot:3 * slot + 3].tolist()
        a = lb + ids[la:la + n] * ls
        r = rb + ids[ra:ra + n] * rs
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
    req = check_request(bound.program, {group.name: ids["local"]}, {group.name: ids["remote"]}, n * group.block_size)
    parts, forms = emit(bound, req), block_copies(bound, req)
    w = _windows(plan)
    write = direction == "WRITE"
    for key, form in forms.items():
        b = w.blocks(form, key.remote_mem, write)
        assert b is not None and b.write == write and b.vec
        t = w.table(parts[key].local, parts[key].remote, key.remote_mem, write, "part", chunk=1 << 62)
        table = t.table.reshape(3, -1)
        got = _launch_rows(b)
        assert np.array_equal(_canonical(got[:, 0], got[:, 1], got[:, 2]), _canonical(*table))
        assert w.blocks(form, "DRAM", write) is None  # the windows hold VRAM


def test_no_block_launch_where_a_row_reaches_past_its_window():
    """The last block of a region lies past a window cut short: requests that touch it get no block launch
    (their rows are refused, in the route's words); the others get one."""
    plan, bound = _bound("layouts/llama-3.1-8b.yaml", "WRITE")
    group, region = plan.groups[0], plan.regions[0]
    w = _windows(plan, short=1)
    last = region.capacity - 1
    near = check_request(bound.program, {group.name: [0]}, {group.name: [1]}, group.block_size)
    far = check_request(bound.program, {group.name: [0]}, {group.name: [last]}, group.block_size)
    (key, form), = block_copies(bound, near).items()
    assert w.blocks(form, "VRAM", True) is not None
    (key, form), = block_copies(bound, far).items()
    assert w.blocks(form, "VRAM", True) is None
