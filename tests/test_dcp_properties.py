"""Proof tests of decode context parallelism: random DCP pairs move every byte right, and nothing else.

Hypothesis draws a model (an MLA latent, or GQA K/V, optionally a per-block field and a Mamba
state) and two engines for it with their own TP size, DCP size, DCP interleave, block and
kernel block sizes, dim orders, capacities and memory types: DCP on one side only, on both,
with different sizes and interleaves. A random request (tokens ``[0, N)`` or a token range
``[start, stop)``) is executed READ from every consumer rank and WRITE from every producer
rank on the content-coded memory model and checked:

* every requested destination byte holds its content code, no other byte changes
  (``memory_model.verify``, whose expectation follows vLLM's slot mapping, written out in
  :mod:`kvlc.demo.content` independently of :mod:`kvlc.compiler.algebra.sharding`), no byte twice;
* each part's byte map equals a reference map computed here from token positions;
* each part's descriptor count equals the coalesced minimum of the reference map (after
  sorting; as produced for ascending ids, the minimum within each region and group).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlc
from kvlc.compiler.pairing.pair import check_pair, pair

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_model import Engine, verify  # noqa: E402
from test_pair_properties import PROPS, check_parts, execute_counting, minimum_from_bytes  # noqa: E402
from kvlc import bind, instantiate


# ============================================================================ the case
@dataclass
class SideT:
    tp: int
    dcp: int
    inter: int
    block: int
    kernel: int
    mem: str
    text: str = ""
    draft: int = 0               # 0: no draft group; 1: a draft (MTP) group DCP shards; 2: one it leaves whole
    pcp: int = 1                 # prefill context parallelism: tp * pcp ranks

    @property
    def draft_dcp(self) -> int:
        """DCP ranks the draft group's tokens are spread over (1: `dcp: replicated`, every rank holds them all)."""
        return 1 if self.draft == 2 else self.dcp


@dataclass
class DcpCase:
    cons: SideT
    prod: SideT
    tokens: int                  # stop: the request moves tokens [start, tokens)
    cids: dict
    pids: dict
    id_mode: str
    start: int = 0

    def kw(self) -> dict:
        """The request's tokens as instantiate / verify keywords."""
        return {"tokens": (self.start, self.tokens)} if self.start else {"num_tokens": self.tokens}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def pcp_dcp_sizes(tp: int, pcp: int, heads: int | None) -> list[int]:
    """vLLM's DCP sizes beside PCP ``pcp`` > 1 (``ParallelConfig``: 1, pcp, tp * pcp) whose DCP groups hold one
    head's tokens: DCP over every rank only where every rank holds every head (MLA, one KV head, or TP1)."""
    every = heads is None or heads == 1 or tp == 1
    return sorted({1, pcp} | ({tp * pcp} if every else set()))


@st.composite
def side_t(draw, heads: int | None, tps=(1, 2, 4, 8), dcp=None, pcps=(1,)) -> SideT:
    tp = draw(st.sampled_from([t for t in tps if heads is None or heads % t == 0 or t % heads == 0]))
    pcp = draw(st.sampled_from(pcps))
    per = tp if heads is None else (tp // heads if tp > heads else 1)  # ranks holding one head
    sizes = _divisors(per) if pcp == 1 else pcp_dcp_sizes(tp, pcp, heads)
    d = dcp if dcp is not None else draw(st.sampled_from(sizes))
    kernel = draw(st.sampled_from((2, 4, 8)))
    block = kernel * draw(st.sampled_from((1, 1, 2)))
    inter = draw(st.sampled_from(_divisors(kernel))) if d > 1 else 1
    return SideT(tp, d, inter, block, kernel, draw(st.sampled_from(("VRAM", "DRAM"))), pcp=pcp)


def _dims(draw, kind: str, lat_size: int) -> dict:
    """Fields of one layout in a random dim order."""
    tok, head, hd = {"name": "token", "role": "token"}, {"name": "head", "role": "head"}, {"name": "head_dim"}
    if kind == "mla":
        lat = [tok, {"name": "lat", "size": lat_size}]
        return {"latent": [dict(d) for d in draw(st.permutations(lat))]}
    return {n: [dict(d) for d in draw(st.permutations([tok, head, hd]))] for n in ("k", "v")}


def _spec(s: SideT, label: str, heads, fields: dict, per_block: bool, mamba: int, cap: int, draft_cap: int) -> str:
    ys = [{"name": n, "dtype": "bf16" if n != "latent" else "fp16", "dims": list(d)} for n, d in fields.items()]
    if per_block:
        ys.append({"name": "scale", "dtype": "fp32", "dims": [{"name": "head", "role": "head"} if heads
                                                                else {"name": "sc", "size": 2}]})
    model = {"name": "prop/dcp", "num_layers": 1, **({"num_kv_heads": heads, "head_dim": 2} if heads else {})}
    par = {"tp_size": s.tp, **({"pcp_size": s.pcp} if s.pcp > 1 else {}), "dcp_size": s.dcp,
           **({"dcp_interleave": s.inter} if s.inter > 1 else {})}
    spec = {"kvlc": 1, "name": f"dcp-{label}", "model": model, "parallel": par, "block_size": s.block,
            "kernel_block_size": s.kernel, "groups": [{"name": "full", "kind": "full_attention"}],
            "storages": [{"name": "s", "mem": s.mem}], "layouts": {"kv": {"fields": ys}},
            "regions": [{"name": f"attn.{i}", "storage": "s", "layout": "kv", "groups": ["full"],
                         "num_blocks": cap * (s.block // s.kernel)} for i in range(2)]}
    if s.draft:   # a draft (MTP) cache in a group of its own, replicated under DCP where s.draft == 2
        spec["groups"].append({"name": "mtp", "kind": "full_attention", **({"dcp": "replicated"} if s.draft == 2
                                                                          else {})})
        spec["regions"].append({"name": "draft.0", "storage": "s", "layout": "kv", "groups": ["mtp"],
                                "num_blocks": draft_cap * (s.block // s.kernel)})
    if mamba:
        spec["groups"].append({"name": "mamba", "kind": "mamba"})
        spec["layouts"]["st"] = {"fields": [{"name": "ssm", "dtype": "bf16", "dims": [
            {"name": "ssm_head", "role": "head", "size": mamba}, {"name": "x", "size": 2}]}]}
        spec["regions"].append({"name": "state.0", "storage": "s", "layout": "st", "num_blocks": 3,
                                "groups": ["mamba"]})
    return yaml.safe_dump(spec, sort_keys=False)


@st.composite
def dcp_case(draw, kind=None, heads=None, sides=None, max_tokens=70, draft=None) -> DcpCase:
    kind = kind or draw(st.sampled_from(("mla", "gqa")))
    heads = None if kind == "mla" else heads or draw(st.sampled_from((1, 2, 4)))
    cons, prod = sides or (draw(side_t(heads)), draw(side_t(heads)))
    same = all(getattr(cons, a) == getattr(prod, a) for a in ("dcp", "inter", "kernel"))
    per_block = same and draw(st.booleans())
    mamba = math.lcm(cons.tp, prod.tp) if draw(st.booleans()) else 0
    tokens = draw(st.integers(1, max_tokens))
    # a token range [start, stop) (a prefix-cache hit); per-block fields start on a whole block of both sides
    step = math.lcm(cons.kernel * cons.dcp, prod.kernel * prod.dcp) if per_block else 1
    start = draw(st.sampled_from((0, 0, draw(st.integers(0, tokens - 1)) // step * step)))
    lat_size = draw(st.integers(1, 5))
    id_mode = draw(st.sampled_from(("contiguous", "ascending", "arbitrary")))
    if draft if draft is not None else draw(st.booleans()):   # a per-block field needs equal sharding of it
        cons.draft = draw(st.sampled_from((1, 2)))
        prod.draft = cons.draft if per_block else draw(st.sampled_from((1, 2)))
    ids = []
    for s, label in ((cons, "c"), (prod, "p")):
        chosen, cap = _ids(draw, id_mode, tokens, start, s.block * s.dcp)
        drafted, draft_cap = _ids(draw, id_mode, tokens, start, s.block * s.draft_dcp) if s.draft else ((), 0)
        s.text = _spec(s, label, heads, _dims(draw, kind, lat_size), per_block, mamba, cap, draft_cap)
        ids.append({"full": chosen, **({"mamba": [draw(st.integers(0, 2))]} if mamba else {}),
                    **({"mtp": drafted} if s.draft else {})})
    return DcpCase(cons, prod, tokens, ids[0], ids[1], id_mode, start)


def _ids(draw, id_mode: str, tokens: int, start: int, per_id: int) -> tuple[list[int], int]:
    """Block ids of the blocks ``[start, tokens)`` touches (``per_id`` tokens each) and a capacity that holds them."""
    need = -(-tokens // per_id) - start // per_id
    cap = need + draw(st.sampled_from((0, 1, 3)))
    if id_mode == "contiguous":
        at = draw(st.integers(0, cap - need))
        return list(range(at, at + need)), cap
    chosen = draw(st.permutations(range(cap)))[:need]
    return (sorted(chosen) if id_mode == "ascending" else chosen), cap


# ============================================================================ reference map
def holds(t, size: int, inter: int, rank: int):
    """vLLM's slot mapping: DCP rank ``(t // interleave) % size`` stores token ``t``."""
    return (t // inter) % size == rank


def local_pos(t, size: int, inter: int):
    return (t // (size * inter)) * inter + t % inter


def global_pos(j, size: int, inter: int, rank: int):
    return (j // inter) * size * inter + rank * inter + j % inter


def vllm_dcp_rank(par, r: int) -> int:
    """vLLM's DCP rank of engine rank ``r``: world ``(pcp, tp)``, TP innermost; DCP groups over ``(tp, pcp)``."""
    return ((r % par.tp_size) * par.pcp_size + r // par.tp_size) % par.dcp_size


def owners(heads: int, tp: int) -> list[range]:
    if heads % tp == 0:
        n = heads // tp
        return [range(r * n, r * n + n) for r in range(tp)]
    return [range(r // (tp // heads), r // (tp // heads) + 1) for r in range(tp)]


def source_rank(c: int, head: int | None, heads: int, prod, dp: int | None) -> int:
    """The documented rule: among producer ranks holding the head (and the token), the (c mod count)-th."""
    own = owners(heads, prod.tp_size)
    ranks = [r for r in range(prod.tp_size * prod.pcp_size) if head is None or head in own[r % prod.tp_size]]
    cands = [r for r in ranks if dp is None or vllm_dcp_rank(prod, r) == dp]
    return cands[c % len(cands)]


def _sharding(plan, region):
    """The token sharding of ``region``: the engine's DCP, or none where its group is `dcp: replicated` (every
    rank holds every token of it, as vLLM keeps a draft model's cache whole)."""
    p = plan.parallel
    if plan.group(region.groups[0]).dcp_replicated:
        return SimpleNamespace(tp_size=p.tp_size, pcp_size=p.pcp_size, dcp_size=1, dcp_interleave=1)
    return p


def _kpb(plan, group: str) -> int:
    g = plan.group(group)
    return g.block_size // g.kernel_block_size


def kernel_ids(plan, group: str, ids) -> np.ndarray:
    g = plan.group(group)
    m = 1 if g.is_state else g.block_size // g.kernel_block_size
    return (np.asarray(ids, np.int64)[:, None] * m + np.arange(m)).ravel()


def _field_ref(cp, c: int, pp, rc, rp, fc, ck, pk, start: int, tokens: int):
    """(consumer byte offsets in storage, producer rank, producer byte offsets) of one field."""
    fp = rp.field(fc.name)
    grid = np.indices([d.size for d in fc.dims], dtype=np.int64).reshape(len(fc.dims), -1)
    idx = {d.name: grid[i] for i, d in enumerate(fc.dims)}
    coff = fc.offset + sum(grid[i] * d.stride for i, d in enumerate(fc.dims))
    cpar, ppar = _sharding(cp, rc), _sharding(pp, rp)
    state = rc.is_state
    if state:
        j = np.arange(len(ck))[:, None]
        kc, kp, keep, t = j, j, np.ones((len(ck), grid.shape[1]), bool), None
    else:
        span_c = rc.block_tokens * cpar.dcp_size                   # global tokens of one kernel block id
        c0 = start // (cp.group(rc.groups[0]).block_size * cpar.dcp_size) * _kpb(cp, rc.groups[0])
        p0 = start // (pp.group(rc.groups[0]).block_size * ppar.dcp_size) * _kpb(pp, rc.groups[0])
        j = np.arange(start // span_c, -(-tokens // span_c))[:, None]   # this rank's kernel blocks touched
        tok = fc.dim("token")
        if tok is None:  # per-block field: equal sharding on both sides
            kc, kp = j - c0, j - p0
            keep, t = np.ones((len(j), grid.shape[1]), bool), None
        else:
            jl = j * rc.block_tokens + idx[tok.name][None, :]
            t = global_pos(jl, cpar.dcp_size, cpar.dcp_interleave, vllm_dcp_rank(cpar, c))
            keep = (t >= start) & (t < tokens)
            jp = local_pos(t, ppar.dcp_size, ppar.dcp_interleave)
            kc, kp = j - c0, jp // rp.block_tokens - p0
    shape = keep.shape
    hd = fc.dim("head")
    heads = hd.global_size if hd else 1
    hglob = idx[hd.name] + owners(heads, cpar.tp_size)[c % cpar.tp_size].start if hd else \
        np.zeros(grid.shape[1], np.int64)
    if state or ppar.dcp_size == 1:
        dps = np.full(shape, -1)                      # any rank holding the head: TP alone
    elif t is None:
        dps = np.full(shape, vllm_dcp_rank(cpar, c))  # per-block field, equal sharding: the same DCP rank
    else:
        dps = (t // ppar.dcp_interleave) % ppar.dcp_size
    hb = np.broadcast_to(hglob, shape)
    keyed = np.stack([hb.ravel(), dps.ravel()], 1).tolist()
    table = {(h, d): source_rank(c, h if hd else None, heads, ppar, None if d < 0 else d)
             for h, d in {tuple(x) for x in keyed}}
    prank = np.array([table[tuple(x)] for x in keyed], np.int64).reshape(shape)
    pstart = np.array([owners(heads, ppar.tp_size)[r % ppar.tp_size].start
                       for r in range(ppar.tp_size * ppar.pcp_size)]) if hd else None
    poff = np.full(shape, fp.offset, np.int64)
    for d in fp.dims:
        if d.role == "head":
            poff = poff + (hb - pstart[prank]) * d.stride
        elif d.role == "token":
            poff = poff + (jp % rp.block_tokens) * d.stride
        else:
            poff = poff + np.broadcast_to(idx[d.name], shape) * d.stride
    cblk = np.broadcast_to(ck[np.clip(kc, 0, len(ck) - 1)], shape)
    pblk = np.broadcast_to(pk[np.clip(kp, 0, len(pk) - 1)], shape)
    caddr = rc.offset + cblk * rc.block_stride + np.broadcast_to(coff, shape)
    paddr = rp.offset + pblk * rp.block_stride + poff
    return caddr[keep], prank[keep], paddr[keep]


def reference(cp, c: int, pp, C: Engine, P: Engine, cids, pids, start: int, tokens: int) -> dict:
    """(producer, cmem, pmem) → (consumer bytes, producer bytes, entry) of consumer rank ``c``."""
    acc: dict = {}
    entries: dict = {}
    holders = {(r.content, f.name): r for r in pp.regions for f in r.fields}  # by region (part_of) and name
    for rc in cp.regions:
        g = rc.groups[0]
        ck, pk = kernel_ids(cp, g, cids[g]), kernel_ids(pp, g, pids[g])
        for fc in rc.fields:
            rp = holders[(rc.content, fc.name)]
            e = entries.setdefault((rc.name, rp.name), len(entries))
            ca, pr, pa = _field_ref(cp, c, pp, rc, rp, fc, ck, pk, start, tokens)
            b = np.arange(fc.itemsize)
            ca = (ca[:, None] + b).ravel() + C.bases[(c, rc.storage)]
            pbase = np.array([P.bases[(p, rp.storage)] for p in range(pp.parallel.ranks)])
            pa = (pa[:, None] + b).ravel() + np.repeat(pbase[pr], fc.itemsize)
            pr = np.repeat(pr, fc.itemsize)
            for p in np.unique(pr).tolist():
                sel = pr == p
                acc.setdefault((p, rc.mem, rp.mem), []).append((ca[sel], pa[sel], np.full(int(sel.sum()), e)))
    return {k: tuple(np.concatenate([x[i] for x in v]) for i in range(3)) for k, v in acc.items()}


# ============================================================================ running a case
def run_case(case: DcpCase) -> int:
    cons, prod = kvlc.compile_spec(case.cons.text), kvlc.compile_spec(case.prod.text)
    ctp, ptp = cons.parallel.ranks, prod.parallel.ranks   # tp_size * pcp_size ranks each
    P = Engine(prod, 1, True)
    C = Engine(cons, 0, False)
    checked = 0
    refs = {}
    for c in range(ctp):
        rep = check_pair(cons, prod, local_rank=c, direction="READ")
        assert rep.ok, rep.render()
        prog = pair(cons, prod, local_rank=c, direction="READ")
        before = {k: v.copy() for k, v in C.buffers[c].items()}
        bases = {p: P.rank_bases(p) for p in prog.peer_ranks}
        parts = instantiate(bind(prog, C.rank_bases(c), bases), case.cids, case.pids, **case.kw())
        refs[c] = set(prog.peer_ranks)
        ref = reference(cons, c, prod, C, P, case.cids, case.pids, case.start, case.tokens)
        assert {k[0] for k in ref} <= set(prog.peer_ranks), "peer ranks"  # the program serves any request
        for key, part in instantiate(bind(prog, C.rank_bases(c), bases), case.cids, case.pids, **case.kw(),
                                          coalesce="sort").items():
            wl, wr, _ = ref[(key.peer_rank, key.local_mem, key.remote_mem)]
            assert len(part) == minimum_from_bytes(wl, wr), f"part {key}: coalesce='sort' above the minimum"
        check_parts(parts, ref, case.id_mode, C, c, P)
        writes: dict = {}
        execute_counting(parts, C, c, P, "READ", writes)
        assert all(w.max(initial=0) <= 1 for w in writes.values()), "a destination byte written twice"
        checked += verify(C, c, P, case.cids, case.pids, case.kw().get("num_tokens"), before, case.kw().get("tokens"))
    C2 = Engine(cons, 2, False)
    befores = {c: {k: v.copy() for k, v in C2.buffers[c].items()} for c in range(ctp)}
    refs2 = {c: reference(cons, c, prod, C2, P, case.cids, case.pids, case.start, case.tokens)
             for c in range(ctp)}
    writes = {}
    for p in range(ptp):
        prog = pair(prod, cons, local_rank=p, direction="WRITE")
        parts = instantiate(bind(prog, P.rank_bases(p), {c: C2.rank_bases(c) for c in prog.peer_ranks}),
                            case.pids, case.cids, **case.kw())
        want = {(c, pm, cm): (pb, cb, e) for c in range(ctp) for (q, cm, pm), (cb, pb, e) in refs2[c].items()
                if q == p}
        check_parts(parts, want, case.id_mode, P, p, C2)
        execute_counting(parts, P, p, C2, "WRITE", writes)
        assert set(prog.peer_ranks) == {c for c in range(ctp) if p in refs[c]}, "push peers mirror pull peers"
    assert all(w.max(initial=0) <= 1 for w in writes.values()), "a destination byte written twice"
    for c in range(ctp):
        verify(C2, c, P, case.cids, case.pids, case.kw().get("num_tokens"), befores[c],
               case.kw().get("tokens"))
    readers = {p: sum(1 for c in range(ctp) if p in refs[c]) for p in range(ptp)}
    assert dict(prog.consumer_counts) == readers, "consumer counts: the consumer ranks reading each producer"
    return checked


# ============================================================================ the properties
@pytest.mark.parametrize("c,p", [((8, 8), (8, 1)), ((8, 1), (8, 8)), ((8, 8), (8, 8)), ((4, 2), (8, 4)),
                                 ((8, 8), (1, 1)), ((2, 2), (4, 4))])
@settings(PROPS, max_examples=10)
@given(data=st.data())
def test_replicated_draft_group_under_dcp(c, p, data):
    """A draft (MTP) group that DCP leaves whole (`dcp: replicated`) beside a DCP-sharded one, on either side or
    both, against a peer that shards it or not: every byte once, read from one rank, never written twice."""
    sides = tuple(data.draw(side_t(None, tps=(tp,), dcp=d)) for tp, d in (c, p))
    run_case(data.draw(dcp_case(kind="mla", sides=sides, draft=True)))



@settings(PROPS, max_examples=60)
@given(dcp_case())
def test_random_dcp_pairs_move_exact_bytes(case):
    """Any DCP pair (TP, DCP, interleave, block sizes each side): every byte once, nothing else, fewest rows."""
    assert run_case(case) > 0


@pytest.mark.parametrize("c,p", [((8, 8), (8, 1)), ((8, 1), (8, 8)), ((4, 2), (8, 4)), ((2, 2), (8, 8)),
                                 ((8, 8), (1, 1)), ((1, 1), (4, 4))])
@settings(PROPS, max_examples=10)
@given(data=st.data())
def test_mla_dcp_one_side_or_both(c, p, data):
    """MLA (one latent, every rank holds it): DCP on the decode side only, the prefill side only, or both."""
    sides = tuple(data.draw(side_t(None, tps=(tp,), dcp=d)) for tp, d in (c, p))
    run_case(data.draw(dcp_case(kind="mla", sides=sides)))


@pytest.mark.parametrize("c,p", [((8, 2), (2, 1)), ((2, 1), (8, 2)), ((8, 2), (8, 4)), ((8, 4), (4, 2))])
@settings(PROPS, max_examples=10)
@given(data=st.data())
def test_gqa_dcp_within_head_replicas(c, p, data):
    """GQA with TP beyond the KV heads: DCP splits a head's replicas, on one side or both."""
    run_case(data.draw(dcp_case(kind="gqa", heads=2, sides=tuple(
        data.draw(side_t(2, tps=(tp,), dcp=d)) for tp, d in (c, p)))))


# ============================================================================ prefill context parallelism
@settings(PROPS, max_examples=40)
@given(data=st.data())
def test_random_pcp_pairs_move_exact_bytes(data):
    """Any pair with PCP on one side or both (PCP alone: a whole replica per PCP rank; PCP x DCP with DCP along
    the PCP ranks or over all of them), any TP, interleave and block sizes: every byte once, nothing else,
    fewest rows, READ from every consumer rank and WRITE from every producer rank."""
    kind = data.draw(st.sampled_from(("mla", "gqa")))
    heads = None if kind == "mla" else data.draw(st.sampled_from((1, 2, 4)))
    sides = [data.draw(side_t(heads, tps=(1, 2, 4), pcps=(1, 2, 4))) for _ in range(2)]
    if sides[0].pcp == 1 and sides[1].pcp == 1:
        sides[data.draw(st.integers(0, 1))] = data.draw(side_t(heads, tps=(1, 2, 4), pcps=(2, 4)))
    assert run_case(data.draw(dcp_case(kind=kind, heads=heads, sides=tuple(sides)))) > 0


# the issue's five cases (the fifth, PCP decoding, twice), (tp, pcp, dcp) of the consumer and the producer, MLA as vLLM's PCP requires
PCP_CASES = {
    "pcp-x-dcp-producer-to-dcp-consumer": ((8, 1, 8), (2, 2, 4)),
    "replicated-pcp-producer-to-dcp-consumer": ((8, 1, 8), (8, 2, 1)),
    "dcp-producer-to-replicated-pcp-consumer": ((4, 2, 1), (8, 1, 8)),
    "pcp-producer-to-tp-consumer": ((1, 1, 1), (4, 2, 2)),
    "pcp-x-dcp-consumer-from-tp-producer": ((4, 2, 8), (8, 1, 1)),
    "pcp-consumer-from-pcp-producer": ((2, 2, 2), (4, 2, 8)),
}


@pytest.mark.parametrize("c,p", list(PCP_CASES.values()), ids=list(PCP_CASES))
@settings(PROPS, max_examples=8)
@given(data=st.data())
def test_pcp_issue_cases(c, p, data):
    """The issue's PCP cases (a PCP x DCP producer pulled by a DCP consumer, replicated PCP against a
    DCP-sharded peer either way, PCP on either role), with a draft group sharded or replicated: exact bytes."""
    sides = []
    for tp, pcp, d in (c, p):
        s = data.draw(side_t(None, tps=(tp,), dcp=d, pcps=(pcp,)))
        sides.append(s)
    run_case(data.draw(dcp_case(kind="mla", sides=tuple(sides))))
