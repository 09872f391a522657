"""Pairing, step 1 — tensor-parallel mapping: which producer rank serves which heads of a consumer rank.

For every consumer rank and field, each head it holds is assigned one producer rank that
holds it (replicas: spread by consumer rank; replicated fields: producer
``consumer_rank % producer_tp``). The shard rule itself is :func:`kvlc.compiler.algebra.layout.shard`.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from kvlc.compiler.algebra.sharding import Shard, ShardPair
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
    """Per DCP rank of an engine (parallel ``par``): the TP ranks that hold ``head``'s tokens of it.

    ``head`` None: a replicated field (every rank). The ranks of one DCP group are consecutive
    TP ranks (DCP rank ``tp_rank % dcp_size``); an empty list means no rank stores those tokens.

    >>> class P: tp_size, dcp_size = 8, 2
    >>> dcp_holders(1, 4, P)    # TP8 over 4 heads: head 1 on ranks 2, 3
    [[2], [3]]
    >>> dcp_holders(None, 1, P)[1]
    [1, 3, 5, 7]
    """
    ranks = range(par.tp_size) if head is None else holders(head, heads, par.tp_size)
    return [[r for r in ranks if r % par.dcp_size == d] for d in range(par.dcp_size)]


def dcp_sources(consumer_rank: int, f: PlanField, cons, prod) -> tuple[Source, ...]:
    """Like :func:`sources` where the producer has DCP: per producer DCP rank, who serves each head.

    Each DCP rank of the producer stores a different part of the tokens, so the consumer rank
    reads from one producer rank per (head, producer DCP rank); among the ranks that hold both,
    it picks ``cands[consumer_rank % len(cands)]``. Which of those tokens the consumer rank itself
    holds is the pairing's business (:class:`kvlc.compiler.algebra.sharding.ShardPair`).

    >>> from kvlc import compile_spec
    >>> plan = compile_spec("layouts/deepseek-v3-tp8.yaml")
    >>> f = plan.regions[0].fields[0]
    >>> class P: tp_size, dcp_size = 8, 8
    >>> [s.producer for s in dcp_sources(0, f, plan.parallel, P)]
    [0, 1, 2, 3, 4, 5, 6, 7]
    """
    if prod.dcp_size == 1:
        return sources(consumer_rank, f, cons.tp_size, prod.tp_size)
    hd = f.dim("head")
    if hd is None:
        return tuple(Source(c[consumer_rank % len(c)], 0, 0) for c in dcp_holders(None, 1, prod))
    h0, h1 = head_range(consumer_rank, hd.global_size, cons.tp_size)
    out: list[Source] = []
    for d in range(prod.dcp_size):
        for h in range(h0, h1):
            cands = dcp_holders(h, hd.global_size, prod)[d]
            _add_head(out, cands[consumer_rank % len(cands)], h)
    return tuple(out)


def reader_counts(by_sharding: dict, consumer_tp: int, producer_tp: int) -> dict[int, int]:
    """Per producer rank: how many consumer ranks read from it; ``by_sharding`` maps a DCP pair of parallels
    (``(consumer, producer)``, or None: TP alone) to the consumer fields sharded that way.

    >>> from kvlc import compile_spec
    >>> fields = compile_spec("layouts/llama-3.1-8b.yaml").regions[0].fields
    >>> reader_counts({None: fields}, 2, 4)
    {0: 1, 1: 1, 2: 1, 3: 1}
    """
    readers: dict[int, set] = {p: set() for p in range(producer_tp)}
    for dcp, fields in by_sharding.items():
        _add_readers(readers, fields, consumer_tp, producer_tp, dcp)
    return {p: len(c) for p, c in readers.items()}


def _add_readers(readers: dict[int, set], fields, consumer_tp: int, producer_tp: int, dcp) -> None:
    seen = set()
    for f in fields:
        hd = f.dim("head")
        key = hd.global_size if hd else None
        if key in seen:
            continue
        seen.add(key)
        for c in range(consumer_tp):
            for s in (sources(c, f, consumer_tp, producer_tp) if dcp is None else dcp_sources(c, f, *dcp)):
                if dcp is None or shards_meet(dcp[0], c, dcp[1], s.producer):
                    readers[s.producer].add(c)


def shards_meet(cons, c: int, prod, p: int) -> bool:
    """Do consumer rank ``c`` and producer rank ``p`` (parallels ``cons``, ``prod``) hold a token in common?"""
    return ShardPair(Shard(cons.dcp_size, cons.dcp_interleave, c % cons.dcp_size),
                     Shard(prod.dcp_size, prod.dcp_interleave, p % prod.dcp_size)).meets()
