"""Prepared strided lists (``prepared_rows(bound)`` / ``prepared_indices(bound, ...)``) move exactly the
bytes of ``instantiate``.

* For every checked-in layout pair (hetero TP both ways, HND/NHD, block-size ratio, Mamba state,
  mixed DRAM/VRAM, unequal capacities), pull and push, random ids and token counts: expanding
  the strided rows the way NIXL does (row after row, ``count`` descriptors every ``stride``
  bytes), taking the request's indices, and adding the tail rows gives the same byte map
  (local byte → remote byte, per part) as ``instantiate``.
* On the content-coded memory model (small runtime layouts): every requested byte arrives
  with its content code, nothing else changes, for every consumer and producer rank.
* Refusals: ids out of range (same checks as ``instantiate``), lists past int32 indices.
* One loopback test with two real NIXL UCX agents in this process (DRAM, numpy buffers).
"""

from __future__ import annotations

import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import yaml

import kvlc
import kvlc.compiler.request.prepared as pairmod
from kvlc.compiler.pairing.pair import pair
from kvlc.compiler.pairing.program import Part
from kvlc.errors import TransferError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_model import Engine, execute, verify  # noqa: E402
from kvlc import bind, instantiate
from kvlc.compiler.request.prepared import prepared_indices, prepared_rows

ROOT = Path(__file__).resolve().parents[1]
PAIRS = yaml.safe_load((ROOT / "layouts" / "pairs" / "pairs.yaml").read_text())["pairs"]
SMALL = ROOT / "tests" / "runtime" / "layouts"
_plans: dict = {}


def plan(path: Path):
    if path not in _plans:
        _plans[path] = kvlc.compile_spec(path)
    return _plans[path]


def fake_bases(p, tag: int, rank: int) -> dict:
    """Distinct made-up base addresses per (engine, rank, storage); nothing is allocated."""
    return {s.name: (((tag * 64 + rank) << 44) + (i << 36), s.device) for i, s in enumerate(p.storages)}


def random_request(local, remote, rng, max_tokens: int = 200, links=None):
    """Random distinct ids per group in range on both sides, and random token counts.

    ``links``: the (local group, remote group) pairs whose ids a request gives (a region may be in groups of
    other names on the two sides); default each local group with the remote group of its name. Where a group
    serves several links, every token group moves one token count (its ids then fit each link).
    """
    lids, rids, tokens = {}, {}, {}
    links = [(g.name, g.name) for g in local.groups] if links is None else list(links)
    one = int(rng.integers(1, max_tokens)) if len({g for g, _ in links}) < len(links) or \
        len({h for _, h in links}) < len(links) else None
    # groups of one aliased page pool take distinct pages (as the allocator gives them)
    taken = {side: set() for side in ("l", "r")}
    pooled = {g for p in (local, remote) for r in p.regions if r.aliases
              for g in r.groups + sum((p.region(a).groups for a in r.aliases), ())}
    for g, h in links:
        lcap = [r.capacity for r in local.regions if g in r.groups]
        rcap = [r.capacity for r in remote.regions if h in r.groups]
        if not lcap or not rcap:
            continue
        if any(r.is_state for r in local.regions if g in r.groups):
            n = len(lids[g]) if g in lids else len(rids[h]) if h in rids else int(rng.integers(1, 4))
            nr = n
        else:
            tokens[g] = one or int(rng.integers(1, max_tokens))
            n = local.blocks_for(g, tokens[g])   # DCP: a block id covers block_size * dcp_size
            nr = remote.blocks_for(h, tokens[g])
        for side, cap, k, out, name in (("l", lcap, n, lids, g), ("r", rcap, nr, rids, h)):
            if name in out:
                continue   # a group of several links: its ids already drawn
            free = [i for i in range(min(cap)) if name not in pooled or i not in taken[side]]
            out[name] = rng.choice(free, k, replace=False).tolist()
            if name in pooled:
                taken[side] |= set(out[name])
    return lids, rids, tokens


def expand(rows5: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """(N, 3) descriptors that ``idx`` selects in the expansion of strided ``rows5`` (NIXL's order)."""
    rows5 = rows5.astype(np.int64)
    start = np.concatenate(([0], np.cumsum(rows5[:, 4])[:-1]))
    idx = idx.astype(np.int64)
    r = np.searchsorted(start, idx, side="right") - 1
    k = idx - start[r]
    assert (idx >= 0).all() and (k < rows5[r, 4]).all(), "index past the expanded list"
    out = np.empty((len(idx), 3), dtype=np.int64)
    out[:, 0] = rows5[r, 0] + k * rows5[r, 3]
    out[:, 1] = rows5[r, 1]
    out[:, 2] = rows5[r, 2]
    return out.view(np.uint64)


def as_parts(bound, req) -> dict:
    """Prepared request → ordinary parts (expanded whole tiles, then the tail), for comparison."""
    lists = prepared_rows(bound)
    out = {}
    for key in set(req.indices) | set(req.tail):
        ls, rs = [], []
        if key in req.indices:
            li, ri = req.indices[key]
            assert li.dtype == np.int32 and ri.dtype == np.int32 and len(li) == len(ri)
            ls.append(expand(lists[key].local, li))
            rs.append(expand(lists[key].remote, ri))
        if key in req.tail:
            ls.append(req.tail[key].local)
            rs.append(req.tail[key].remote)
        out[key] = Part(np.concatenate(ls), np.concatenate(rs))
    return out


def byte_map(parts) -> dict:
    """Canonical form of each part's byte map: rows sorted by local (dev, addr), merged to the maximum."""
    out = {}
    for key, p in parts.items():
        if not len(p):
            continue
        L, R = p.local.astype(np.int64), p.remote.astype(np.int64)
        assert (L[:, 1] == R[:, 1]).all()
        o = np.lexsort((L[:, 0], L[:, 2]))
        L, R = L[o], R[o]
        cont = ((L[1:, 2] == L[:-1, 2]) & (L[1:, 0] == L[:-1, 0] + L[:-1, 1])
                & (R[1:, 2] == R[:-1, 2]) & (R[1:, 0] == R[:-1, 0] + R[:-1, 1]))
        starts = np.flatnonzero(np.concatenate(([True], ~cont)))
        lens = np.add.reduceat(L[:, 1], starts)
        ends = L[starts, 0] + lens
        same_dev = L[starts[1:], 2] == L[starts[:-1], 2]
        assert not (same_dev & (L[starts[1:], 0] < ends[:-1])).any(), f"part {key}: a local byte mapped twice"
        out[key] = np.column_stack([L[starts, 2], L[starts, 0], R[starts, 2], R[starts, 0], lens])
    return out


def check_lists(lists) -> None:
    """Row starts are where NIXL's expansion puts each row; rows are aligned local ↔ remote."""
    for key, pl in lists.items():
        assert pl.local.shape == pl.remote.shape == (len(pl), 5)
        assert pl.local.dtype == pl.remote.dtype == np.uint64
        for rows, start in ((pl.local, pl.local_start), (pl.remote, pl.remote_start)):
            want = np.concatenate(([0], np.cumsum(rows[:, 4].astype(np.int64))[:-1]))
            assert np.array_equal(start, want)
        assert (pl.local[:, 1] == pl.remote[:, 1]).all()


def compare(bound, lids, rids, tokens) -> tuple[int, int]:
    want = instantiate(bound, lids, rids, tokens)
    req = prepared_indices(bound, lids, rids, tokens)
    got = as_parts(bound, req)
    wm, gm = byte_map(want), byte_map(got)
    assert wm.keys() == gm.keys()
    for key in wm:
        assert np.array_equal(wm[key], gm[key]), f"part {key}: prepared byte map differs from instantiate"
    return sum(len(p) for p in want.values()), sum(len(i[0]) for i in req.indices.values())


@pytest.mark.parametrize("direction", ["READ", "WRITE"])
@pytest.mark.parametrize("entry", PAIRS, ids=[p["name"] for p in PAIRS])
def test_checked_in_pairs_same_byte_map_as_instantiate(entry, direction):
    """Every checked-in pair, pull and push, first and last local rank, random requests."""
    cons, prod = plan(ROOT / "layouts" / entry["consumer"]), plan(ROOT / "layouts" / entry["producer"])
    local, remote = (cons, prod) if direction == "READ" else (prod, cons)
    rng = np.random.default_rng(zlib.crc32(f"{entry['name']}/{direction}".encode()))
    for rank in sorted({0, local.parallel.tp_size - 1}):
        prog = pair(local, remote, local_rank=rank, direction=direction)
        bound = bind(prog, fake_bases(local, 0, rank), {p: fake_bases(remote, 1, p) for p in prog.peer_ranks})
        lists = prepared_rows(bound)
        check_lists(lists)
        assert set(lists) == set(prog.part_keys)
        links = list(dict.fromkeys((e.group, e.remote_group) for e in prog.entries))
        for _ in range(3):
            compare(bound, *random_request(local, remote, rng, links=links))
        # tokens filling whole tiles exactly: no tail at all
        lids, rids, tokens = random_request(local, remote, rng, links=links)
        per_id = {(g, h): (local.group(g).block_size * local.group_dcp(g),    # tokens per block id
                           remote.group(h).block_size * remote.group_dcp(h)) for g, h in links if g in tokens}
        for (g, h), (lbs, rbs) in per_id.items():
            # one tile for every link of a group that serves several (their ids must fit each)
            tile = int(np.lcm.reduce([x for (a, b), bs in per_id.items() if a == g or b == h for x in bs]))
            tokens[g] = tile
            # ids of other groups stay out of the way (pooled groups never share a page)
            lused = set().union(*(lids[k] for k in lids if k != g))
            rused = set().union(*(rids[k] for k in rids if k != h))
            lids[g] = [i for i in range(tile // lbs + len(lused)) if i not in lused][:tile // lbs]
            rids[h] = [i for i in range(tile // rbs + len(rused)) if i not in rused][:tile // rbs]
        compare(bound, lids, rids, tokens)
        assert not prepared_indices(bound, lids, rids, tokens).tail


SMALL_PAIRS = [("dense-tp1.yaml", "dense-tp2-hnd-b32.yaml"), ("dense-tp2-hnd-b32.yaml", "dense-tp1.yaml"),
               ("hybrid-tp1.yaml", "hybrid-tp2.yaml"), ("hybrid-tp2.yaml", "hybrid-tp1.yaml")]


@pytest.mark.parametrize("producer,consumer", SMALL_PAIRS, ids=[f"{a}->{b}" for a, b in SMALL_PAIRS])
def test_memory_model_content(producer, consumer):
    """Content-coded memory: prepared pulls by every consumer rank and pushes by every producer rank
    land every requested byte with its code and change nothing else."""
    prod, cons = plan(SMALL / producer), plan(SMALL / consumer)
    rng = np.random.default_rng(7)
    P = Engine(prod, 1, True)
    for trial in range(3):
        cids, pids, tokens = random_request(cons, prod, rng, max_tokens=120)
        C = Engine(cons, 10 + trial, False)
        for c in range(cons.parallel.tp_size):
            prog = pair(cons, prod, local_rank=c, direction="READ")
            bound = bind(prog, C.rank_bases(c), {p: P.rank_bases(p) for p in prog.peer_ranks})
            before = {k: v.copy() for k, v in C.buffers[c].items()}
            execute(as_parts(bound, prepared_indices(bound, cids, pids, tokens)), C, c, P, "READ")
            assert verify(C, c, P, cids, pids, tokens, before) > 0
        C2 = Engine(cons, 20 + trial, False)
        befores = {c: {k: v.copy() for k, v in C2.buffers[c].items()} for c in range(cons.parallel.tp_size)}
        for p in range(prod.parallel.tp_size):
            prog = pair(prod, cons, local_rank=p, direction="WRITE")
            bound = bind(prog, P.rank_bases(p), {c: C2.rank_bases(c) for c in prog.peer_ranks})
            execute(as_parts(bound, prepared_indices(bound, pids, cids, tokens)), P, p, C2, "WRITE")
        for c in range(cons.parallel.tp_size):
            assert verify(C2, c, P, cids, pids, tokens, befores[c]) > 0


def test_bad_ids_refused_like_instantiate():
    prod, cons = plan(SMALL / "dense-tp1.yaml"), plan(SMALL / "dense-tp2-hnd-b32.yaml")
    prog = pair(cons, prod, local_rank=0, direction="READ")
    bound = bind(prog, fake_bases(cons, 0, 0), {0: fake_bases(prod, 1, 0)})
    for lids, rids, tokens, msg in (({"full": [40]}, {"full": [0, 1]}, 32, "out of range"),
                                    ({"full": [0]}, {"full": [0, 1, 2]}, 32, "expected 2"),
                                    ({"full": [0]}, {"full": [0, 1]}, 0, "positive"),
                                    ({}, {"full": [0, 1]}, 32, "no block ids")):
        with pytest.raises(TransferError, match=msg):
            instantiate(bound, lids, rids, tokens)
        with pytest.raises(TransferError, match=msg):
            prepared_indices(bound, lids, rids, tokens)


def test_lists_past_int32_indices_refused(monkeypatch):
    """A part whose expanded list needs indices past int32 is refused with the sizes named."""
    p = plan(ROOT / "layouts" / "llama-3.1-70b-tp4.yaml")
    prog = pair(p, p, local_rank=0, direction="READ")
    bound = bind(prog, fake_bases(p, 0, 0), {0: fake_bases(p, 1, 0)})
    need = max(pl.local_size for pl in prepared_rows(bound).values())
    prog2 = pair(p, p, local_rank=0, direction="READ")
    bound2 = bind(prog2, fake_bases(p, 0, 0), {0: fake_bases(p, 1, 0)})
    monkeypatch.setattr(pairmod, "INDEX_LIMIT", need - 1)
    with pytest.raises(TransferError, match=r"expands to .* descriptors, more than make_prepped_xfer's int32"):
        prepared_rows(bound2)
    with pytest.raises(TransferError, match="int32"):
        prepared_indices(bound2, {"full": [0]}, {"full": [0]}, 16)


# ----------------------------------------------------------------------------- real NIXL
@pytest.mark.runtime
@pytest.mark.parametrize("producer,consumer", [SMALL_PAIRS[0], SMALL_PAIRS[2]],
                         ids=[f"{a}->{b}" for a, b in (SMALL_PAIRS[0], SMALL_PAIRS[2])])
def test_nixl_loopback_prepared_read(producer, consumer):
    """Two UCX agents in this process: strided lists prepared once, a prepped READ with the indices,
    the tail moved directly; every destination byte checked against its content code."""
    pytest.importorskip("nixl")
    from kvlc.runtime.nixl.core import Agent, XferState

    prod, cons = plan(SMALL / producer), plan(SMALL / consumer)
    assert prod.parallel.tp_size == 1 and set(prod.mem_types) == set(cons.mem_types) == {"DRAM"}
    P, C = Engine(prod, 1, True), Engine(cons, 0, False)   # numpy buffers: real memory here
    c = cons.parallel.tp_size - 1
    real = lambda eng, r: {s.name: (eng.buffers[r][s.name].ctypes.data, 0) for s in eng.plan.storages}  # noqa: E731
    # the memory model resolves addresses through its bases: give it the real ones
    for eng, r in ((P, 0), (C, c)):
        for name, (addr, _) in real(eng, r).items():
            eng.bases[(r, name)] = addr
    rng = np.random.default_rng(3)
    cids, pids, tokens = random_request(cons, prod, rng, max_tokens=120)
    for g in tokens:   # whole tiles and a 7-token tail (tiles of 16 or 32 tokens)
        tokens[g] = 71
        cids[g] = rng.choice(min(r.capacity for r in cons.regions if g in r.groups),
                             -(-71 // cons.group(g).block_size), replace=False).tolist()
        pids[g] = rng.choice(min(r.capacity for r in prod.regions if g in r.groups),
                             -(-71 // prod.group(g).block_size), replace=False).tolist()
    before = {k: v.copy() for k, v in C.buffers[c].items()}

    prog = pair(cons, prod, local_rank=c, direction="READ")
    bound = bind(prog, real(C, c), {0: real(P, 0)})
    req = prepared_indices(bound, cids, pids, tokens)
    assert req.indices and req.tail

    agents = [Agent(f"kvlc-prep-cons-{c}"), Agent("kvlc-prep-prod")]
    cons_agent, prod_agent = agents
    try:
        for agent, eng, r in ((cons_agent, C, c), (prod_agent, P, 0)):
            for name, buf in eng.buffers[r].items():
                agent.register(np.array([[buf.ctypes.data, buf.nbytes, 0]], dtype=np.uint64), "DRAM", name)
        remote = cons_agent.add_remote(prod_agent.metadata())
        xfers = []
        for key, pl in prepared_rows(bound).items():
            lh = cons_agent.prep(None, pl.local, key.local_mem)          # "NIXL_INIT_AGENT"
            rh = cons_agent.prep(remote, pl.remote, key.remote_mem)
            assert lh.count == pl.local_size and rh.count == pl.remote_size
            if key in req.indices:
                li, ri = req.indices[key]
                xfers.append(cons_agent.make_prepped("READ", lh, li, rh, ri, f"prepared {key}"))
        for key, part in req.tail.items():
            xfers.append(cons_agent.initialize("READ", part.local, key.local_mem, part.remote,
                                               key.remote_mem, remote, f"tail {key}"))
        for x in xfers:
            assert cons_agent.post(x) is not XferState.ERR, x.error
        deadline = time.monotonic() + 30
        while any(cons_agent.state(x) is XferState.PROC for x in xfers):
            prod_agent.notifs()   # let the producer side progress too
            assert time.monotonic() < deadline, "transfers did not finish"
            time.sleep(0.001)
        assert all(x.state is XferState.DONE for x in xfers), [x.error for x in xfers]
        checked = verify(C, c, P, cids, pids, tokens, before)
        assert checked == sum(p.nbytes for p in instantiate(bound, cids, pids, tokens).values())
    finally:
        for agent in agents:
            assert agent.close() == []
