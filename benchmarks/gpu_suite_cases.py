"""The GPU suite's cases (benchmarks/gpu_suite.py): plans, workloads and the rows kvlc posts for them.

A :class:`Group` is one pair of plans (producer, consumer) and the cases measured on it: the
engines of a mode are started once per group. Every request's NIXL rows are computed here once,
offline (the same ``pair`` + ``bind`` + ``instantiate`` a connection runs, with every storage at
its own base), as :class:`testkit.staging_pair.Ranges` of (storage index, offset, length): raw
NIXL moves exactly these, and the torch ceilings copy the same rows.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MiB, GiB = 1 << 20, 1 << 30
LLAMA = ROOT / "layouts" / "llama-3.1-8b.yaml"
DSV3 = ROOT / "layouts" / "deepseek-v3-tp1.yaml"
MIXED = (ROOT / "layouts" / "deepseek-v3.2-hisparse-tp8.yaml", ROOT / "layouts" / "deepseek-v3.2-tp8.yaml")
SPAN = 40  # offline bases: storage i at (i + 1) << SPAN
LLAMA_TOKEN, DSV3_TOKEN = 128 << 10, 72 << 10  # KV-cache bytes of one token at most (bf16; MLA 70,272 and padding)


@dataclass(frozen=True)
class Scale:
    """Sizes and counts of one run: an H200 run, or the CPU dry run (tiny pools, same code paths)."""

    gpu: bool
    llama_pool: int
    dsv3_pool: int
    mixed_pool: int
    check_pool: int
    handover_tokens: tuple[int, ...]
    dsv3_tokens: int
    bulk: tuple[tuple[int, int], ...]  # (tokens per request, requests in flight per round)
    mixed_tokens: int
    flight: int     # requests in flight per round (or per write_many batch) of the random-id "flight" cases
    n: int          # timed requests one at a time
    warm: int       # warm-up requests before them
    rounds: int     # timed rounds (bulk), after one warm round
    mixed_rounds: int
    check_tokens: int  # the content check's request: not a multiple of a block (its last block partial)
    ids: str = "random"  # how the scattered cases draw block ids (kvlc.demo.workload.ID_PATTERNS)


def scale(gpu: bool, quick: bool, tokens: tuple[int, ...] = (), dsv3_tokens: int = 0, ids: str = "random") -> Scale:
    """The run's sizes; ``tokens`` (the Llama handovers'), ``dsv3_tokens`` and ``ids`` (the scattered cases'
    pattern: ``random``, the producer's ids scattered, or ``scattered``, both sides') replace the defaults; for
    tokens given, a pool grows where it would not hold ``flight`` requests at once (with a quarter to spare)."""
    if gpu:  # Llama-3.1-8B: 2,048 tokens are 256 MiB, 16,384 tokens 2 GiB
        sc = Scale(True, 8 * GiB, 4 * GiB, 1 * GiB, 64 * MiB, (1024, 2048, 4096), 4096,
                   ((2048, 8), (16384, 2)), 2048, 4, 20 if quick else 50, 3 if quick else 5,
                   3 if quick else 7, 4 if quick else 8, 250)
    else:
        sc = Scale(False, 64 * MiB, 64 * MiB, 64 * MiB, 64 * MiB, (64, 128, 256), 256, ((64, 4), (256, 1)), 128, 2,
                   6 if quick else 10, 2, 2 if quick else 3, 3, 60)
    sc = replace(sc, ids=ids)
    if tokens:
        need = sc.flight * max(tokens) * LLAMA_TOKEN * 5 // 4
        sc = replace(sc, handover_tokens=tuple(tokens), llama_pool=max(sc.llama_pool, need))
    if dsv3_tokens:
        need = sc.flight * dsv3_tokens * DSV3_TOKEN * 5 // 4
        sc = replace(sc, dsv3_tokens=dsv3_tokens, dsv3_pool=max(sc.dsv3_pool, need))
    return sc


@dataclass
class Case:
    """One measured thing of a group: ``kind`` "handover" (one request at a time: latency), "bulk"
    (rounds of ``inflight`` requests: GB/s; ``batched``: each round one ``write_many`` of them) or "rounds"
    (one request per round, every round counted)."""

    name: str
    select: str       # the --only word that picks it
    kind: str
    tokens: int
    ids: str = "contiguous"
    direction: str = "push"  # push | pull_via_push (the consumer asks, the producer writes)
    inflight: int = 1
    batched: bool = False    # bulk: a round is one Peer.write_many of its requests (else one write() each)
    rounds: int = 0   # timed units: requests one at a time (handover), rounds (bulk, rounds)
    warm: int = 0     # warm-up requests before them (handover); bulk: one warm round
    requests: list = field(default_factory=list)  # (id, consumer ids, producer ids, tokens)
    ranges: list = field(default_factory=list)    # per request: one Ranges per NIXL part (push rows)

    @property
    def nbytes(self) -> int:
        """Bytes of one request."""
        return sum(r.nbytes for r in self.ranges[0]) if self.ranges else 0

    @property
    def descriptors(self) -> float:
        """Descriptors of one request (median over the requests)."""
        return statistics.median(sum(len(r.src) for r in rs) for rs in self.ranges) if self.ranges else 0

    def batches(self) -> list[list[int]]:
        """Request indices per timed unit: each request (handover), or each round (warm round first)."""
        if self.kind == "handover":
            return [[i] for i in range(len(self.requests))]
        k = self.inflight
        return [list(range(i, i + k)) for i in range(0, len(self.requests), k)]


@dataclass
class Group:
    """A producer and a consumer layout, their plans (timed and check) and the cases run on them."""

    name: str
    producer: Path
    consumer: Path
    pool: int
    cases: list[Case]
    check_tokens: int
    plans: tuple = ()        # (producer, consumer), pools of ``pool``
    check_plans: tuple = ()  # the same with small pools (content codes fill them); the timed ones if as small
    check_request: tuple = ()
    check_ranges: list = field(default_factory=list)

    @property
    def separate_check(self) -> bool:
        return self.check_plans[0] is not self.plans[0]

    @property
    def same_memory(self) -> bool:
        """Every storage of both plans in one memory type (what same-host copies cover)."""
        return len({s.mem for p in self.plans for s in p.storages}) == 1

    @property
    def mixed(self) -> bool:
        return "DRAM" in {s.mem for s in self.plans[0].storages} and not self.same_memory

    def has(self, direction: str) -> bool:
        return any(c.direction == direction for c in self.cases)


def groups(sc: Scale, only: set[str]) -> list[Group]:
    """The suite's groups, each with only the cases ``only`` selects (empty: all); empty groups left out."""
    b = [(f"push {_mib(sc, t)}", "push", t, k) for t, k in sc.bulk] + \
        [(f"pull_via_push {_mib(sc, t)}", "pull_via_push", t, k) for t, k in sc.bulk]
    llama = [Case(f"llama-8b handover {t} tokens {ids} ids", "handover", "handover", t, ids, rounds=sc.n,
                  warm=sc.warm)
             for ids in ("contiguous", sc.ids) for t in sc.handover_tokens]
    # What an engine hands over: a prompt's tokens less the one the decoder computes, so the last block is
    # partial (its tokens: entries of a slot of one tile in the block form).
    prompt = max(1, sc.handover_tokens[len(sc.handover_tokens) // 2] - 1)
    llama += [Case(f"llama-8b handover {prompt} tokens {sc.ids} ids (a prompt: last block partial)", "handover",
                   "handover", prompt, sc.ids, rounds=sc.n, warm=sc.warm)]
    llama += [Case(f"llama-8b {label}", "bulk", "bulk", t, direction=d, inflight=k, rounds=sc.rounds)
              for label, d, t, k in b]
    llama += _flight("llama-8b", sc, sc.handover_tokens)
    dsv3 = [Case(f"deepseek-v3 mla handover {sc.dsv3_tokens} tokens {sc.ids} ids", "deepseek", "handover",
                 sc.dsv3_tokens, sc.ids, rounds=sc.n, warm=sc.warm), *_flight("deepseek-v3 mla", sc, (sc.dsv3_tokens,))]
    out = [Group("llama-3.1-8b", LLAMA, LLAMA, sc.llama_pool, llama, sc.check_tokens),
           Group("deepseek-v3 mla", DSV3, DSV3, sc.dsv3_pool, dsv3, sc.check_tokens),
           Group("mixed dram->vram", *MIXED, sc.mixed_pool,
                 [Case(f"mixed dram->vram push {sc.mixed_tokens} tokens", "mixed", "rounds", sc.mixed_tokens,
                       rounds=sc.mixed_rounds)], sc.check_tokens)]
    for g in out:
        g.cases = [c for c in g.cases if not only or c.select in only]
    return [g for g in out if g.cases]


def _flight(model: str, sc: Scale, tokens: tuple[int, ...]) -> list[Case]:
    """Handovers of scattered ids (``sc.ids``) with ``sc.flight`` requests at once: each written as soon as the one
    before it was (one ``write()`` each, the engine not waiting in between), or all in one ``write_many``; GB/s
    per round, so kvlc's host work for one request overlaps the copies of the others."""
    k = sc.flight
    return [Case(f"{model} handover {t} tokens {sc.ids} ids, {k} {how}", "flight", "bulk", t, sc.ids,
                 inflight=k, batched=batched, rounds=sc.rounds)
            for t in tokens for batched, how in ((False, "in flight"), (True, "per write_many"))]


def _mib(sc: Scale, tokens: int) -> str:
    """Llama-3.1-8B: 128 KiB a token."""
    mib = tokens * 128 // 1024
    return f"{mib // 1024} GiB" if mib >= 1024 else f"{mib} MiB"


def prepare(g: Group, sc: Scale) -> None:
    """Compile the group's plans, draw every case's requests and compute their rows."""
    from kvlc.demo.run import scaled_plan

    to_dram = not sc.gpu
    g.plans = (scaled_plan(g.producer, g.pool, to_dram=to_dram),
               scaled_plan(g.consumer, g.pool, to_dram=to_dram))
    if g.pool <= sc.check_pool:
        g.check_plans = g.plans
    else:
        g.check_plans = (scaled_plan(g.producer, sc.check_pool, to_dram=to_dram),
                         scaled_plan(g.consumer, sc.check_pool, to_dram=to_dram))
    bound = offline_bound(*g.plans)
    for i, c in enumerate(g.cases):
        c.requests = _requests(g, c, seed=i)
        c.ranges = [push_ranges(bound, p, cids, n) for _, cids, p, n in c.requests]
    from kvlc.demo.run import make_workload

    g.check_request = make_workload(g.check_plans[1], g.check_plans[0], 1, g.check_tokens, seed=7,
                                    ids=sc.ids)[0][0]
    _, cids, pids, n = g.check_request
    g.check_ranges = push_ranges(offline_bound(*g.check_plans), pids, cids, n)


def _requests(g: Group, c: Case, seed: int) -> list:
    """The case's requests: handover ``warm + n`` (fresh random ids each), bulk one round of ``inflight``
    requests repeated (warm round first), rounds one request each."""
    from kvlc.demo.run import make_workload

    prod, cons = g.plans
    if c.kind == "handover":
        return [r for rnd in make_workload(cons, prod, c.warm + c.rounds, c.tokens, seed, c.ids) for r in rnd]
    if c.kind == "bulk" and c.ids != "contiguous":  # fresh scattered ids every round
        got = [make_workload(cons, prod, c.inflight, c.tokens, seed + 1000 * r, c.ids)[0]
               for r in range(c.rounds + 1)]
        if any(len(one) != c.inflight for one in got):
            raise RuntimeError(f"{c.name}: the pool holds fewer than {c.inflight} requests of {c.tokens} tokens")
        return [r for one in got for r in one]
    if c.kind == "bulk":
        one = make_workload(cons, prod, c.inflight, c.tokens, seed, "contiguous")[0]
        if len(one) != c.inflight:
            raise RuntimeError(f"{c.name}: the pool holds {len(one)} requests of {c.tokens} tokens at once, "
                               f"not {c.inflight}")
        return [r for _ in range(c.rounds + 1) for r in one]
    return [r for rnd in make_workload(cons, prod, c.rounds, c.tokens, seed, "contiguous") for r in rnd]


def offline_bound(producer, consumer):
    """The producer's push program bound with storage ``i`` of each side at ``(i + 1) << SPAN``."""
    from kvlc.compiler.pairing.pair import pair
    from kvlc.compiler.request.bind import bind

    prog = pair(producer, consumer, local_rank=0, direction="WRITE")

    def bases(plan):
        return {s.name: ((i + 1) << SPAN, s.device) for i, s in enumerate(plan.storages)}
    return bind(prog, bases(producer), {r: bases(consumer) for r in prog.peer_ranks})


def push_ranges(bound, producer_ids, consumer_ids, tokens) -> list:
    """One push request's rows, one :class:`Ranges` per NIXL part (peer 0 only: the suite's engines
    are rank 0 of each side)."""
    from kvlc.compiler.request.instantiate import instantiate
    from testkit.staging_pair import Ranges

    parts = instantiate(bound, producer_ids, consumer_ids, tokens)
    bad = [str(k) for k in parts if k.peer_rank != 0]
    if bad:
        raise RuntimeError(f"parts with peer ranks other than 0: {bad}")
    return [Ranges(_decode(p.local), _decode(p.remote)) for p in parts.values() if len(p)]


def _decode(rows: np.ndarray) -> np.ndarray:
    a = rows[:, 0].astype(np.int64)
    return np.stack([(a >> SPAN) - 1, a & ((1 << SPAN) - 1), rows[:, 1].astype(np.int64)], axis=1)
