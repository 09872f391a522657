"""Proof tests of token-range requests: ``tokens=(start, stop)`` moves exactly those tokens.

Hypothesis draws a random engine pair (the pairing proofs' strategy: TP, block and kernel
block sizes on each side, dim orders, padding, storages, hybrid groups) and a random range
``[start, stop)`` per token group; each side's ids are the blocks of that side the range
touches. Executed READ and WRITE on the content-coded memory model it must:

* write every requested byte with its content code, and nothing else — in particular the
  receiver's tokens ``[0, start)`` in a block shared with the range stay as they were
  (``memory_model.verify`` checks every other byte unchanged; no byte is written twice);
* give, per part, the byte map of the reference — the pairing proofs' map for ``[0, stop)``
  on the same physical blocks, less the receiver bytes of ``[0, start)`` (of what a sliding
  window still needs) — in no more descriptors than that map's coalesced minimum.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlc
from kvlc.compiler.pairing.pair import pair
from kvlc.errors import TransferError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_model import Engine, verify  # noqa: E402
from test_pair_properties import (PROPS, check_parts, execute_counting, minimum_from_bytes,  # noqa: E402
                                  pair_case, reference)
from kvlc import bind, instantiate
from kvlc.compiler.request.prepared import prepared_indices, prepared_rows
from kvlc.explain.docs import program_summary
from kvlc.compiler.request.windows import window_stats

LAYOUTS = Path(__file__).resolve().parents[1] / "layouts"


def needed(plan, group: str, start: int, stop: int) -> int:
    """First token a receiver gets: a window group drops whole receiver blocks before token stop-window+1."""
    g = plan.group(group)
    if g.kind != "sliding_window":
        return start
    return max(start, max(0, stop - g.window + 1) // g.block_size * g.block_size)


def range_ids(plan, group: str, ids, start: int, stop: int):
    """The blocks of ``ids`` (blocks 0.. of the sequence) that ``[start, stop)`` touches."""
    bs = plan.group(group).block_size
    return list(ids[start // bs: -(-stop // bs)])


def state_entries(plan) -> set[int]:
    """Entry numbers (as ``reference`` assigns them) of state regions."""
    order = list(dict.fromkeys((r.name, g) for r in plan.regions for g in r.groups))
    return {i for i, (name, _) in enumerate(order) if plan.region(name).is_state}


def range_reference(cons, c, prod, C, P, case, spans, needs) -> dict:
    """Reference byte map of consumer rank ``c`` for the ranges: ``[0, stop)`` less ``[0, need)``."""
    whole = reference(cons, c, prod, C, P, case.cids, case.pids, {g: b for g, (_, b) in spans.items()})
    before = reference(cons, c, prod, C, P, case.cids, case.pids, needs)
    states = state_entries(cons)
    out = {}
    for key, (cb, pb, e) in whole.items():
        drop = np.isin(cb, before[key][0]) if key in before else np.zeros(len(cb), bool)
        keep = ~drop | np.isin(e, list(states))
        if keep.any():
            out[key] = (cb[keep], pb[keep], e[keep])
    return out


@st.composite
def range_case(draw, cut_window: bool = False, **kw):
    """A pairing case and one range per token group (``cut_window``: ranges the 64-token window cuts)."""
    case = draw(pair_case(**kw))
    cons, prod = kvlc.compile_spec(case.cons.text), kvlc.compile_spec(case.prod.text)
    spans = {}
    for g, n in case.tokens.items():
        if cut_window and cons.group(g).kind == "sliding_window" and n > 64:
            stop = draw(st.integers(65, n))
            start = draw(st.one_of(st.just(0), st.integers(0, stop - 64)))
        else:
            stop = draw(st.integers(1, n))
            start = draw(st.integers(0, stop - 1))
        if any(f.dim("token") is None for r in cons.regions if g in r.groups for f in r.fields):
            k = cons.region(next(r.name for r in cons.regions if g in r.groups)).block_tokens
            start = start // k * k     # a per-block field moves whole blocks (mid-block: refused, tested below)
        spans[g] = (start, stop)
    return case, cons, prod, spans


def run_range(case, cons, prod, spans, as_range: bool) -> int:
    cids = {g: range_ids(cons, g, ids, *spans[g]) if g in spans else ids for g, ids in case.cids.items()}
    pids = {g: range_ids(prod, g, ids, *spans[g]) if g in spans else ids for g, ids in case.pids.items()}
    arg = {g: range(a, b) if as_range else (a, b) for g, (a, b) in spans.items()}
    moved = 0
    P = Engine(prod, 1, True)
    C = Engine(cons, 0, False)
    for c in range(cons.parallel.tp_size):                      # READ: the consumer pulls
        prog = pair(cons, prod, local_rank=c, direction="READ")
        needs = {g: needed(cons, g, a, b) for g, (a, b) in spans.items()}
        ref = range_reference(cons, c, prod, C, P, case, spans, needs)
        before = {k: v.copy() for k, v in C.buffers[c].items()}
        bases = (C.rank_bases(c), {p: P.rank_bases(p) for p in prog.peer_ranks})
        parts = instantiate(bind(prog, *bases), cids, pids, tokens=arg)
        check_parts(parts, ref, case.id_mode, C, c, P)
        for key, part in instantiate(bind(prog, *bases), cids, pids, tokens=arg, coalesce="sort").items():
            wl, wr, _ = ref[(key.peer_rank, key.local_mem, key.remote_mem)]
            assert len(part) == minimum_from_bytes(wl, wr), f"part {key}: coalesce='sort' above the minimum"
        writes: dict = {}
        execute_counting(parts, C, c, P, "READ", writes)
        assert all(w.max(initial=0) <= 1 for w in writes.values()), "a destination byte written twice"
        moved += verify(C, c, P, cids, pids, None, before, tokens=arg)
        assert sum(p.nbytes for p in parts.values()) == sum(len(v[0]) for v in ref.values())
        _prepared_agrees(prog, bases, cids, pids, arg, parts)
    C2 = Engine(cons, 2, False)                                 # WRITE: every producer rank pushes
    befores = {c: {k: v.copy() for k, v in C2.buffers[c].items()} for c in range(cons.parallel.tp_size)}
    writes = {}
    for p in range(prod.parallel.tp_size):
        prog = pair(prod, cons, local_rank=p, direction="WRITE")
        parts = instantiate(bind(prog, P.rank_bases(p), {c: C2.rank_bases(c) for c in prog.peer_ranks}),
                            pids, cids, tokens=arg)
        execute_counting(parts, P, p, C2, "WRITE", writes)
    assert all(w.max(initial=0) <= 1 for w in writes.values()), "a destination byte written twice"
    for c in range(cons.parallel.tp_size):
        verify(C2, c, P, cids, pids, None, befores[c], tokens=arg)
    return moved


def _prepared_agrees(prog, bases, cids, pids, arg, parts) -> None:
    """Prepared indices plus their tail move exactly the bytes of instantiate."""
    bound = bind(prog, *bases)
    lists = prepared_rows(bound)
    req = prepared_indices(bound, cids, pids, tokens=arg)
    for key, part in parts.items():
        got = []
        if key in req.indices:
            li, ri = req.indices[key]
            pl = lists[key]
            lrow = np.searchsorted(pl.local_start, li, side="right") - 1
            rrow = np.searchsorted(pl.remote_start, ri, side="right") - 1
            la = pl.local[lrow, 0].astype(np.int64) + (li - pl.local_start[lrow]) * pl.local[lrow, 3].astype(np.int64)
            ra = pl.remote[rrow, 0].astype(np.int64) + (ri - pl.remote_start[rrow]) * pl.remote[rrow, 3].astype(np.int64)
            got.append(np.stack([la, ra, pl.local[lrow, 1].astype(np.int64)], 1))
        if key in req.tail:
            t = req.tail[key]
            got.append(np.stack([t.local[:, 0], t.remote[:, 0], t.local[:, 1]], 1).astype(np.int64))
        rows = np.concatenate(got) if got else np.zeros((0, 3), np.int64)
        want = np.stack([part.local[:, 0], part.remote[:, 0], part.local[:, 1]], 1).astype(np.int64)
        assert _bytes(rows) == _bytes(want), f"part {key}: prepared lists move other bytes than instantiate"


def _bytes(rows: np.ndarray) -> set:
    return {(int(a) + i, int(b) + i) for a, b, n in rows.tolist() for i in range(n)}


# ============================================================================ properties
@settings(PROPS, max_examples=150)
@given(range_case(), st.booleans())
def test_random_ranges_move_exact_bytes(drawn, as_range):
    """Any engine pair, any [start, stop) per group: exactly those bytes move, in the fewest rows."""
    run_range(*drawn, as_range)


@settings(PROPS, max_examples=40)
@given(range_case(cut_window=True, swa="own", mamba=False, max_tokens=160), st.booleans())
def test_sliding_window_moves_only_its_window(drawn, as_range):
    """Windows of 64 tokens over requests of up to 160: only the blocks the window keeps move."""
    run_range(*drawn, as_range)


@pytest.mark.parametrize("blocks", [((16, 16), (24, 24)), ((24, 8), (16, 16)), ((8, 4), (12, 6))])
@settings(PROPS, max_examples=10)
@given(data=st.data())
def test_different_block_sizes(blocks, data):
    """Non-divisible block sizes on each side (tiles of lcm tokens, ranges cutting tiles on both ends)."""
    run_range(*data.draw(range_case(blocks=blocks, scale=False)), False)


# ============================================================================ examples and refusals
@pytest.fixture(scope="module")
def gemma():
    """Gemma-3 b16 consumer pulling from b32 (sliding window 1024 + global groups), rank 0."""
    c = kvlc.compile_spec(LAYOUTS / "gemma-3-27b-tp2-b16.yaml")
    p = kvlc.compile_spec(LAYOUTS / "gemma-3-27b-tp2-b32.yaml")
    prog = pair(c, p, local_rank=0, direction="READ")
    bases = ({s.name: 1 << 40 for s in c.storages}, {r: {s.name: 2 << 40 for s in p.storages} for r in prog.peer_ranks})
    return prog, bases


def _ids(n16: int, n32: int):
    return {"local": list(range(n16)), "global": list(range(n16))}, {"local": list(range(n32)), "global": list(range(n32))}


def test_num_tokens_is_the_range_from_zero(gemma):
    """num_tokens=N and tokens=(0, N) give the same descriptors, row for row."""
    prog, bases = gemma
    for n in (1, 16, 40, 1500):
        lids, rids = _ids(-(-n // 16), -(-n // 32))
        a = instantiate(bind(prog, *bases), lids, rids, n)
        b = instantiate(bind(prog, *bases), lids, rids, tokens=(0, n))
        c = instantiate(bind(prog, *bases), lids, rids, tokens=range(0, n))
        for key in a:
            assert np.array_equal(a[key].local, b[key].local) and np.array_equal(a[key].remote, c[key].remote)


def test_window_group_moves_what_the_window_keeps(gemma):
    """3000 tokens, window 1024, consumer blocks of 16: the window group moves tokens [1968, 3000), 1032 of them."""
    prog, bases = gemma
    lids, rids = _ids(188, 94)
    one = {"local": [0], "global": [0]}

    def moved(n):
        return sum(p.nbytes for p in instantiate(bind(prog, *bases), one, one, n).values())

    per_local = moved({"local": 2, "global": 1}) - moved({"local": 1, "global": 1})
    per_global = moved({"local": 1, "global": 2}) - moved({"local": 1, "global": 1})
    full = sum(p.nbytes for p in instantiate(bind(prog, *bases), lids, rids, 3000).values())
    assert full == per_local * 1032 + per_global * 3000
    w, = window_stats(prog)
    assert (w.group, w.max_receiver_blocks, w.max_sender_blocks, w.max_tokens) == ("local", 65, 33, 1038)
    assert program_summary(prog)["windows"][0]["max_receiver_blocks"] == 65


def test_window_placeholders_are_never_read(gemma):
    """Ids of blocks before the window may repeat or lie past the pool; inside the window they are checked."""
    prog, bases = gemma
    lids, rids = _ids(188, 94)
    lids["local"] = [0] * 122 + [10 ** 6] + list(range(100, 165))
    rids["local"] = [0] * 60 + [5] + list(range(200, 233))
    instantiate(bind(prog, *bases), lids, rids, 3000)
    lids["local"][-1] = 100
    with pytest.raises(TransferError) as e:
        instantiate(bind(prog, *bases), lids, rids, 3000)
    assert str(e.value) == ("local block ids of group 'local': block id 100 appears 2 times; the receiving side "
                            "writes each block once, so give distinct ids")


BAD_RANGES = [
    (dict(tokens=(20, 20)), "group 'local': tokens (20, 20) must have 0 <= start < stop"),
    (dict(tokens=(30, 20)), "group 'local': tokens (30, 20) must have 0 <= start < stop"),
    (dict(tokens=(-1, 20)), "group 'local': tokens (-1, 20) must have 0 <= start < stop"),
    (dict(tokens=(20, 40.0)), "group 'local': tokens (start, stop) must be integers; found 40.0 (float)"),
    (dict(tokens=(True, 40)), "group 'local': tokens (start, stop) must be integers; found True (bool)"),
    (dict(tokens=40), "group 'local': tokens must be (start, stop) or range(start, stop); found 40 (int)"),
    (dict(tokens=(1, 2, 3)), "group 'local': tokens must be (start, stop) or range(start, stop); found (1, 2, 3) "
                             "(tuple)"),
    (dict(tokens=range(20, 40, 2)), "group 'local': tokens range(20, 40, 2) must have step 1 (a token range moves "
                                    "every token in it)"),
    (dict(tokens=(20, 40), num_tokens=40), "give the tokens to move as num_tokens=N (tokens [0, N)) or "
                                           "tokens=(start, stop), not both"),
    (dict(tokens={"global": (20, 40)}), "tokens has no entry for group 'local' (give one per token group: "
                                        "['global', 'local'])"),
]


@pytest.mark.parametrize("kw, message", BAD_RANGES, ids=[m[:40] for _, m in BAD_RANGES])
def test_bad_ranges_are_refused(gemma, kw, message):
    prog, bases = gemma
    with pytest.raises(TransferError) as e:
        instantiate(bind(prog, *bases),
                    {"local": [5, 6], "global": [7, 8]}, {"local": [1, 2], "global": [3, 4]}, **kw)
    assert str(e.value) == message


@pytest.mark.parametrize("lids, rids, message", [
    ([5], [1, 2], "group 'local': 1 local block ids for tokens [20, 40); expected 2, one per block the range "
                  "touches (block size 16: logical blocks 1..2)"),
    ([5, 6], [1], "group 'local': 1 remote block ids for tokens [20, 40); expected 2, one per block the range "
                  "touches (block size 32: logical blocks 0..1)"),
    ([5, 6, 7], [1, 2], "group 'local': 3 local block ids for tokens [20, 40); expected 2, one per block the "
                        "range touches (block size 16: logical blocks 1..2)"),
])
def test_id_counts_follow_the_range(gemma, lids, rids, message):
    """Each side lists its own blocks the range touches: [20, 40) is blocks 1..2 of 16 and 0..1 of 32."""
    prog, bases = gemma
    with pytest.raises(TransferError) as e:
        instantiate(bind(prog, *bases), {"local": lids, "global": [7, 8]}, {"local": rids, "global": [3, 4]},
                         tokens=(20, 40))
    assert str(e.value) == message


def test_per_block_field_needs_a_block_aligned_start():
    """A scale per block (no token dim) cannot be split: a range starting mid-block is refused, aligned is fine."""
    plan = kvlc.compile_spec(LAYOUTS / "llama-3.1-8b-fp8-tp2.yaml")
    prog = pair(plan, plan, local_rank=0, direction="READ")
    bases = ({s.name: 1 << 40 for s in plan.storages}, {0: {s.name: 2 << 40 for s in plan.storages}})
    with pytest.raises(TransferError) as e:
        instantiate(bind(prog, *bases), {"full": [1, 2]}, {"full": [3, 4]}, tokens=(20, 40))
    assert str(e.value) == ("group 'full': tokens [20, 40) start inside a block of region 'layer.0' (16 tokens per "
                            "block), whose field 'k_scale' has no token dim (one value per block); start the range "
                            "on a multiple of 16")
    assert instantiate(bind(prog, *bases), {"full": [1, 2]}, {"full": [3, 4]}, tokens=(16, 40))


# ============================================================================ golden requests
GOLDEN = Path(__file__).resolve().parent / "golden" / "requests"
GOLDEN_CASES = {   # name: (ids local, ids remote, range): gemma-3 b16 decode rank 0 pulling from b32
    "gemma3-b16-from-b32-prefix-hit-20-40": ({"local": [5, 6], "global": [7, 8]}, {"local": [1, 2], "global": [3, 4]},
                                             (20, 40)),
    "gemma3-b16-from-b32-window-0-1100": ({"local": [0] * 4 + list(range(100, 165)), "global": list(range(69))},
                                          {"local": [0] * 2 + list(range(200, 233)), "global": list(range(35))},
                                          (0, 1100)),
}


def request_text(prog, bases, lids, rids, span) -> str:
    """Descriptor rows of one request, addresses relative to the bases: one line per row (a part of
    more than 400 rows: its row and byte counts only)."""
    lbase, rbase = 1 << 40, 2 << 40
    lines = [f"request tokens [{span[0]}, {span[1]}) windows {[w.text() for w in window_stats(prog)]}"]
    for key, part in instantiate(bind(prog, *bases), lids, rids, tokens=span).items():
        lines.append(f"part {key} rows={len(part)} bytes={part.nbytes}")
        lines.extend(f"{int(la) - lbase:#x} <- {int(ra) - rbase:#x} x{int(n)}"
                     for (la, n, _), (ra, _, _) in zip(part.local.tolist(), part.remote.tolist()) if len(part) <= 400)
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden_requests(gemma, name):
    """A prefix hit ending mid-block and a window request: their descriptors equal the checked-in text.
    Regenerate with KVLC_UPDATE_GOLDEN=1 and review the diff."""
    import os
    prog, bases = gemma
    text = request_text(prog, bases, *GOLDEN_CASES[name])
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("KVLC_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.read_text() == text, f"request descriptors differ from {path}"
