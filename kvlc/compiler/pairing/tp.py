"""Pairing, step 1 — tensor-parallel mapping: which producer rank serves which heads of a consumer rank.

For every consumer rank and field, each head it holds is assigned one producer rank that
holds it (replicas: spread by consumer rank; replicated fields: producer
``consumer_rank % producer_tp``). The shard rule itself is :func:`kvlc.compiler.algebra.layout.shard`.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from kvlc.compiler.algebra.sharding import Shard, ShardPair, dcp_rank
from kvlc.compiler.algebra.layout import ceildiv, head_range, holders
from kvlc.compiler.plan.model import PlanField

heads_of = head_range  # the name the pairing API has always had


class Source(NamedTuple):
    """Producer rank ``producer`` serves global heads ``[h0, h1)`` (``0, 0``: a replicated field)."""

    producer: int
    h0: int
    h1: int


@lru_cache(maxsize=4096)
def assign(consumer_rank: int, heads: int, consumer_tp: int, producer_tp: int) -> tuple[Source, ...]:
    """Producer rank per head slice of one consumer rank: ``(Source(producer, h0, h1), ...)``.

    Each head is read once (replicas deduplicated); among replicas the consumer
    rank picks ``replicas[consumer_rank % len(replicas)]`` so readers spread.

    >>> [tuple(s) for s in assign(0, 8, 2, 4)]   # TP4 -> TP2: heads 0-1 from rank 0, 2-3 from 1
    [(0, 0, 2), (1, 2, 4)]
    >>> [tuple(s) for s in assign(1, 8, 16, 2)]  # consumer holds one replicated head
    [(0, 0, 1)]
    """
    h0, h1 = head_range(consumer_rank, heads, consumer_tp)
    if heads % producer_tp == 0:  # no replicas on the producer: intersect contiguous ranges
        per = heads // producer_tp
        return tuple(Source(p, max(h0, p * per), min(h1, (p + 1) * per))
                     for p in range(h0 // per, ceildiv(h1, per)))
    out: list[Source] = []
    for h in range(h0, h1):
        cands = holders(h, heads, producer_tp)
        _add_head(out, cands[consumer_rank % len(cands)], h)
    return tuple(out)


def _add_head(out: list[Source], producer: int, h: int) -> None:
    """Append head ``h`` read from ``producer``: it extends the last source when that one ends at ``h``."""
    if out and out[-1].producer == producer and out[-1].h1 == h:
        out[-1] = out[-1]._replace(h1=h + 1)
    else:
        out.append(Source(producer, h, h + 1))


def sources(consumer_rank: int, f: PlanField, consumer_tp: int, producer_tp: int) -> tuple[Source, ...]:
    """Producer rank per head slice of field ``f`` for one consumer rank (replicated: one rank).

    >>> from kvlc import compile_spec
    >>> f = compile_spec("layouts/llama-3.1-8b.yaml").regions[0].field("k")
    >>> [tuple(s) for s in sources(1, f, 2, 1)]
    [(0, 4, 8)]
    """
    hd = f.dim("head")
    if hd is None:
        return (Source(consumer_rank % producer_tp, 0, 0),)
    return assign(consumer_rank, hd.global_size, consumer_tp, producer_tp)


def dcp_holders(head: int | None, heads: int, par) -> list[list[int]]:
    """Per DCP rank of an engine (parallel ``par``): the engine ranks that hold ``head``'s tokens of it.

    ``head`` None: a replicated field (every rank). A rank holds the heads of its TP rank and the
    tokens of its DCP rank (:func:`kvlc.compiler.algebra.sharding.dcp_rank`; without PCP, consecutive
    TP ranks form a DCP group); an empty list means no rank stores those tokens.

    >>> class P: tp_size, pcp_size, dcp_size = 8, 1, 2
    >>> dcp_holders(1, 4, P)    # TP8 over 4 heads: head 1 on ranks 2, 3
    [[2], [3]]
    >>> dcp_holders(None, 1, P)[1]
    [1, 3, 5, 7]
    >>> class Q: tp_size, pcp_size, dcp_size = 8, 2, 2
    >>> dcp_holders(None, 1, Q)[1]   # TP8 x PCP2, DCP along the PCP ranks: the second PCP rank
    [8, 9, 10, 11, 12, 13, 14, 15]
    """
    tp = par.tp_size
    held = range(tp) if head is None else holders(head, heads, tp)
    ranks = [q * tp + t for q in range(par.pcp_size) for t in held]
    return [[r for r in ranks if dcp_rank(par, r) == d] for d in range(par.dcp_size)]


def dcp_sources(consumer_rank: int, f: PlanField, cons, prod) -> tuple[Source, ...]:
    """Like :func:`sources` for engines with context parallelism (DCP on the producer, PCP on either side):
    per producer DCP rank, who serves each head.

    Each DCP rank of the producer stores a different part of the tokens, so the consumer rank
    reads from one producer rank per (head, producer DCP rank); among the ranks that hold both
    (PCP replicas included), it picks ``cands[consumer_rank % len(cands)]``. The consumer rank's
    heads follow its TP rank. Which of those tokens the consumer rank itself holds is the
    pairing's business (:class:`kvlc.compiler.algebra.sharding.ShardPair`).

    >>> from kvlc import compile_spec
    >>> plan = compile_spec("layouts/deepseek-v3-tp8.yaml")
    >>> f = plan.regions[0].fields[0]
    >>> class P: tp_size, pcp_size, dcp_size = 8, 1, 8
    >>> [s.producer for s in dcp_sources(0, f, plan.parallel, P)]
    [0, 1, 2, 3, 4, 5, 6, 7]
    >>> class Q: tp_size, pcp_size, dcp_size = 8, 2, 1
    >>> [s.producer for s in dcp_sources(9, f, Q, plan.parallel)]   # a PCP consumer rank: TP rank 1
    [1]
    """
    if prod.dcp_size == 1 and prod.pcp_size == 1 and cons.pcp_size == 1:
        return sources(consumer_rank, f, cons.tp_size, prod.tp_size)
    hd = f.dim("head")
    if hd is None:
        return tuple(Source(c[consumer_rank % len(c)], 0, 0) for c in dcp_holders(None, 1, prod))
    h0, h1 = head_range(consumer_rank % cons.tp_size, hd.global_size, cons.tp_size)
    out: list[Source] = []
    for d in range(prod.dcp_size):
        for h in range(h0, h1):
            cands = dcp_holders(h, hd.global_size, prod)[d]
            _add_head(out, cands[consumer_rank % len(cands)], h)
    return tuple(out)


def reader_counts(by_sharding: dict, cons, prod) -> dict[int, int]:
    """Per producer rank: how many consumer ranks read from it; ``by_sharding`` maps a DCP pair of parallels
    (``(consumer, producer)``, or None: TP alone) to the consumer fields sharded that way; ``cons`` and
    ``prod`` are the two engines' parallels (their ranks, PCP included).

    >>> from kvlc import compile_spec
    >>> a, b = compile_spec("layouts/llama-3.1-70b-tp4.yaml"), compile_spec("layouts/llama-3.1-70b-tp8.yaml")
    >>> reader_counts({None: a.regions[0].fields}, a.parallel, b.parallel)
    {0: 1, 1: 1, 2: 1, 3: 1, 4: 1, 5: 1, 6: 1, 7: 1}
    """
    readers: dict[int, set] = {p: set() for p in range(prod.ranks)}
    for dcp, fields in by_sharding.items():
        _add_readers(readers, fields, cons, prod, dcp)
    return {p: len(c) for p, c in readers.items()}


def _add_readers(readers: dict[int, set], fields, cons, prod, dcp) -> None:
    seen = set()
    for f in fields:
        hd = f.dim("head")
        key = hd.global_size if hd else None
        if key in seen:
            continue
        seen.add(key)
        for c in range(cons.ranks):
            for s in dcp_sources(c, f, *(dcp or (tp_alone(cons), tp_alone(prod)))):
                if dcp is None or shards_meet(dcp[0], c, dcp[1], s.producer):
                    readers[s.producer].add(c)


def tp_alone(par):
    """``par`` without token sharding (DCP 1): how a region that neither side DCP-shards is served.

    >>> from kvlc import compile_spec
    >>> p = tp_alone(compile_spec("layouts/deepseek-v3.2-tp8-pcp2-dcp2.yaml").parallel)
    >>> p.tp_size, p.pcp_size, p.dcp_size, p.dcp_interleave
    (8, 2, 1, 1)
    """
    return par.model_copy(update={"dcp_size": 1, "dcp_interleave": 1}) if par.dcp_size > 1 else par


def shards_meet(cons, c: int, prod, p: int) -> bool:
    """Do consumer rank ``c`` and producer rank ``p`` (parallels ``cons``, ``prod``) hold a token in common?"""
    return ShardPair(Shard(cons.dcp_size, cons.dcp_interleave, dcp_rank(cons, c)),
                     Shard(prod.dcp_size, prod.dcp_interleave, dcp_rank(prod, p))).meets()
