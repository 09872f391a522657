"""The block form of a request's parts (kvlc.compiler.request.blocks) against the rows it stands for.

Hypothesis draws the engine pairs of test_pair_properties (TP, block sizes, dim orders, MLA, Mamba state,
sliding windows, shared regions, fp4) and a request over a random token range; wherever a part has a
block form, its rows (entry by entry, id by id) must move exactly the bytes of the part's rows as
``emit`` writes them: both sorted and coalesced, row for row the same; every row must lie in its entry's
extent on the peer's side. Where every part has a form, ``emit(..., blocks=True)`` gives the parts lazily:
their bytes and row counts without rows, their rows (when asked for) those of ``emit``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import kvlc
from kvlc import bind
from kvlc.compiler.algebra.copies import coalesce_rows
from kvlc.compiler.pairing.pair import pair
from kvlc.compiler.pairing.program import Part
from kvlc.compiler.request.blocks import BlockPart, block_copies, block_tables
from kvlc.compiler.request.check import check_request
from kvlc.compiler.request.instantiate import emit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_native import pair_requests  # noqa: E402
from test_pair_properties import PROPS, pair_case  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _canonical(local: np.ndarray, remote: np.ndarray) -> np.ndarray:
    """(addr, len) rows of both sides, sorted by the local address and merged where both continue."""
    def rows(a):
        out = np.zeros((len(a), 3), dtype=np.uint64)
        out[:, :2] = np.asarray(a)[:, :2].astype(np.uint64)
        return out
    lo, re = rows(local), rows(remote)
    order = np.argsort(lo[:, 0], kind="stable")
    lo, re = coalesce_rows(lo[order], re[order])
    return np.concatenate([lo[:, :2], re[:, :1]], axis=1)


def _same_bytes(bound, req) -> int:
    parts = emit(bound, req)
    forms = block_copies(bound, req)
    for key, form in forms.items():
        assert key in parts, f"part {key} has a block form but no rows"
        bl, br = form.rows()
        want = _canonical(parts[key].local, parts[key].remote)
        assert np.array_equal(_canonical(bl, br), want), f"part {key}: the block form moves other bytes"
        t = form.table
        which = np.repeat(np.arange(t.entries), form.counts()[t.slot])  # each row's entry (partial tiles' last)
        assert len(which) == len(br) and t.slots == len(t.blocks) + len(form.edge_pieces)
        assert (br[:, 0] >= t.remote_lo[which]).all() and (br[:, 0] + br[:, 1] <= t.remote_hi[which]).all()
        assert (form.counts()[len(t.blocks):] == 1).all()  # a partial tile: a slot of one tile
        assert form.nbytes == parts[key].nbytes
        assert form.runs >= len(parts[key])  # (rows of different entries may continue one another)
    lazy = emit(bound, req, blocks=True)
    if set(forms) == set(bound.program.part_keys):
        assert all(isinstance(p, BlockPart) and not p.built for p in lazy.values())
        for key, p in lazy.items():
            assert p.nbytes == parts[key].nbytes and len(p) == forms[key].runs and not p.built
            assert np.array_equal(p.local, parts[key].local) and np.array_equal(p.remote, parts[key].remote)
            assert p.built
    else:
        assert all(isinstance(p, Part) and (p.blocks is None) == (k not in forms) for k, p in lazy.items())
    return len(forms)


@settings(PROPS, max_examples=150)
@given(case=pair_case(), data=st.data())
def test_block_form_moves_the_bytes_of_the_rows(case, data):
    """Every part with a block form, for every rank and both directions, with counts and token ranges."""
    checked = 0
    for bound, req, *_ in pair_requests(case, data):
        checked += 1 + _same_bytes(bound, req)
    assume(checked)


def _llama(path: str = "layouts/llama-3.1-8b.yaml"):
    plan = kvlc.compile_spec(ROOT / path)
    prog = pair(plan, plan, local_rank=0, direction="WRITE")
    at = lambda base: {s.name: base + i * (1 << 36) for i, s in enumerate(plan.storages)}  # noqa: E731
    return plan, bind(prog, at(1 << 40), {0: at(2 << 40)})  # (each storage apart: no row continues another's)


@settings(deadline=None, max_examples=40)
@given(data=st.data())
def test_whole_blocks_of_a_same_layout_pair_have_a_block_form(data):
    """A same-layout pair (Llama-3.1-8B, DeepSeek-V3 MLA) moving whole blocks: one block form per part, one id
    slot per index block, as many ids as blocks; a partial last block: the same forms, one id fewer per slot
    and a slot of one tile per index block whose entries move the last block's tokens (the rows ``emit`` gives)."""
    plan, bound = _llama(data.draw(st.sampled_from(["layouts/llama-3.1-8b.yaml", "layouts/deepseek-v3-tp1.yaml"])))
    group = plan.groups[0]
    bs, cap = group.block_size, plan.regions[0].capacity
    n = data.draw(st.integers(1, 64))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    if data.draw(st.booleans()):  # random ids, or runs of consecutive ones (rows that merge)
        lids, rids = rng.permutation(cap)[:n].tolist(), rng.permutation(cap)[:n].tolist()
    else:
        lo, ro = int(rng.integers(0, cap - n)), int(rng.integers(0, cap - n))
        lids, rids = list(range(lo, lo + n)), list(range(ro, ro + n))
    req = check_request(bound.program, {group.name: lids}, {group.name: rids}, n * bs)
    forms = block_copies(bound, req)
    assert set(forms) == set(block_tables(bound)) == set(emit(bound, req))
    for key, form in forms.items():
        assert form.count == n and (form.counts() == n).all()
        assert form.runs == len(emit(bound, req)[key])  # separate regions: the estimate is exact
    assert _same_bytes(bound, req) == len(forms)
    if bs > 1:
        cut = data.draw(st.integers(1, bs - 1))
        short = check_request(bound.program, {group.name: lids}, {group.name: rids}, n * bs - cut)
        edged = block_copies(bound, short)
        assert set(edged) == set(forms)
        last = check_request(bound.program, {group.name: lids[-1:]}, {group.name: rids[-1:]}, bs - cut)
        rows = emit(bound, short)
        for key, form in edged.items():
            t, whole = form.table, len(form.table.blocks)
            assert form.count == max(n - 1, 1) and (form.counts()[:whole] == n - 1).all()
            assert len(form.edge_pieces) == whole and (form.counts()[whole:] == 1).all()  # a slot per partial tile
            assert form.runs == len(rows[key])  # (a partial tile's row that continues its entry's last tile: once)
            want = emit(bound, last)[key]  # the last block alone, as rows: the partial tiles' entries' bytes
            m = int(np.count_nonzero(t.slot >= whole))
            bl, br = form.rows()
            got = _canonical(bl[len(bl) - m:], br[len(br) - m:])
            assert got.tolist() == _canonical(want.local, want.remote).tolist()
        assert _same_bytes(bound, short) == len(forms)
        if n * bs - cut >= 2:  # a range from inside the first block: a head edge as well
            start = data.draw(st.integers(1, min(bs, n * bs - cut) - 1))
            ranged = check_request(bound.program, {group.name: lids}, {group.name: rids}, tokens=(start, n * bs - cut))
            rows = emit(bound, ranged)
            for key, form in block_copies(bound, ranged).items():
                assert form.runs == len(rows[key]) and form.nbytes == rows[key].nbytes


def test_only_the_parts_a_caller_wants_get_a_block_form():
    """``emit(blocks=wants)``: a form for the parts ``wants`` says yes to (a same-host GPU copy takes block forms
    for VRAM on both sides only), none for the others, whose rows are built as without forms."""
    plan, bound = _llama("layouts/deepseek-v3.2-hisparse-tp8.yaml")
    tokens = 2 * max(g.block_size for g in plan.groups) + 1  # (the last block of each group partial)
    n = {g.name: -(-tokens // g.block_size) for g in plan.groups}
    req = check_request(bound.program, {g: [2 * i + 1 for i in range(k)] for g, k in n.items()},
                        {g: [3 * i for i in range(k)][::-1] for g, k in n.items()}, tokens)
    rows = emit(bound, req)
    vram = lambda k: k.local_mem == k.remote_mem == "VRAM"  # noqa: E731
    assert any(vram(k) for k in rows) and not all(vram(k) for k in rows)  # (a mixed pair: both kinds of part)
    parts = emit(bound, req, blocks=vram)
    assert {k for k, p in parts.items() if p.blocks is not None} == {k for k in rows if vram(k)}
    assert all(np.array_equal(parts[k].local, rows[k].local) for k in rows)
    assert all(p.blocks is None for p in emit(bound, req, blocks=lambda k: False).values())
