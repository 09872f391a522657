"""Pairing, step 1 — tensor-parallel mapping: which producer rank serves which heads of a consumer rank.

For every consumer rank and field, each head it holds is assigned one producer rank that
holds it (replicas: spread by consumer rank; replicated fields: producer
``consumer_rank % producer_tp``). The shard rule itself is :func:`kvlc.compiler.layout.shard`.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from kvlc.compiler.layout import ceildiv, head_range, holders
from kvlc.compiler.plan import PlanField

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
        p = cands[consumer_rank % len(cands)]
        if out and out[-1].producer == p and out[-1].h1 == h:
            out[-1] = out[-1]._replace(h1=h + 1)
        else:
            out.append(Source(p, h, h + 1))
    return tuple(out)


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


def consumer_counts(cons_fields, consumer_tp: int, producer_tp: int) -> dict[int, int]:
    """Per producer rank: how many consumer ranks read from it, over the given fields.

    >>> from kvlc import compile_spec
    >>> fields = compile_spec("layouts/llama-3.1-8b.yaml").regions[0].fields
    >>> consumer_counts(fields, 2, 4)
    {0: 1, 1: 1, 2: 1, 3: 1}
    """
    readers: dict[int, set] = {p: set() for p in range(producer_tp)}
    seen = set()
    for f in cons_fields:
        hd = f.dim("head")
        key = hd.global_size if hd else None
        if key in seen:
            continue
        seen.add(key)
        for c in range(consumer_tp):
            for s in sources(c, f, consumer_tp, producer_tp):
                readers[s.producer].add(c)
    return {p: len(c) for p, c in readers.items()}
