"""The demo's workload: rounds of requests that fit both engines' pools, and the check of their bytes.

:func:`make_workload` draws block ids for each request (destinations disjoint within a round);
:func:`verify` compares a consumer rank's memory after a round with what the content codes of the
producer say every requested byte must hold, and checks that nothing else changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from kvlc.compiler.plan.model import Plan
from kvlc.errors import KvlcError

MAX_TOKENS = 1 << 24
ID_PATTERNS = ("random", "scattered", "contiguous")  # how make_workload draws block ids


class DemoError(KvlcError):
    """A demo option or workload that cannot run (says which option and what would)."""


def _capacities(plan: Plan) -> dict[str, int]:
    """Per group, the block ids a request may give it: its pool's, or its share of a page pool that groups
    share (:func:`kvlc.demo.content.page_shares`)."""
    from kvlc.demo.content import own_pages, page_shares

    shares = page_shares(plan)
    return {g.name: len(own_pages(plan, g.name, shares)) for g in plan.groups
            if any(g.name in r.groups for r in plan.regions)}


def linked_groups(consumer: Plan, producer: Plan) -> tuple[list[str], list[str]]:
    """The groups a request gives ids of on each side, as pairing links them (every consumer rank): the
    consumer's, then the producer's (a region may be in another group on each side, e.g. an MTP layer in its
    own group on one engine and in the main one on the other). In each plan's group order."""
    from kvlc.compiler.pairing.pair import pair
    from kvlc.compiler.request.rules import request_rules

    cg: set[str] = set()
    pg: set[str] = set()
    for r in range(consumer.parallel.ranks):
        rules = request_rules(pair(consumer, producer, local_rank=r, direction="READ"))
        cg |= rules.local_names
        pg |= rules.remote_names
    return [g.name for g in consumer.groups if g.name in cg], [g.name for g in producer.groups if g.name in pg]


def default_tokens(consumer: Plan, producer: Plan, limit: int = 128,
                   linked: tuple[list[str], list[str]] | None = None) -> int:
    """Tokens per request so that at least two requests fit each consumer pool (at most ``limit``) and one
    each producer pool (``linked``: :func:`linked_groups`, where the caller has them)."""
    cap_c, cap_p = _capacities(consumer), _capacities(producer)
    cg, pg = linked_groups(consumer, producer) if linked is None else linked
    best = limit
    for plan, groups, cap, k in ((consumer, cg, cap_c, 2), (producer, pg, cap_p, 1)):
        for g in groups:
            if not plan.group(g).is_state:
                best = min(best, max(1, cap[g] // k) * plan.group(g).block_size)
    return max(1, best)


def max_fit(plan: Plan, group: str) -> int:
    """The most tokens one request of ``group`` can carry in ``plan``'s pool."""
    return _capacities(plan)[group] * plan.group(group).block_size


def check_pair(consumer: Plan, producer: Plan) -> None:
    """Pair every consumer rank with the producer before any engine starts (``CompatError`` with the report)."""
    from kvlc.compiler.pairing.pair import pair

    for r in range(consumer.parallel.ranks):
        pair(consumer, producer, local_rank=r, direction="READ")


@dataclass(frozen=True)
class _Side:
    """One engine's pools for a request: the ids each group may be given (``pages``: all of its pool's, or its
    share of a pool it shares) and how many one request needs."""

    pages: dict[str, np.ndarray]
    need: dict[str, int]

    @classmethod
    def of(cls, plan: Plan, groups: list[str], tokens: int) -> _Side:
        from kvlc.demo.content import own_pages, page_shares

        shares = page_shares(plan)
        return cls({g: own_pages(plan, g, shares) for g in groups}, {g: plan.blocks_for(g, tokens) for g in groups})

    def cap(self, g: str) -> int:
        return len(self.pages[g])

    def per_round(self) -> int:
        return max(1, min(self.cap(g) // self.need[g] for g in self.need))

    def runs(self, j: int) -> dict[str, list[int]]:
        """Request ``j``'s ids: the ``j``-th run of each group's ids."""
        return {g: self.pages[g][j * n:(j + 1) * n].tolist() for g, n in self.need.items()}

    def drawn(self, rng: np.random.Generator) -> dict[str, list[int]]:
        """One request's ids, drawn at random."""
        return {g: self.pages[g][rng.choice(self.cap(g), n, replace=False)].tolist() for g, n in self.need.items()}

    def orders(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """One round's random order of each group's ids."""
        return {g: rng.permutation(self.cap(g)) for g in self.need}

    def sliced(self, order: dict[str, np.ndarray], j: int) -> dict[str, list[int]]:
        """Request ``j``'s ids in a round's ``order``."""
        return {g: self.pages[g][order[g][j * n:(j + 1) * n]].tolist() for g, n in self.need.items()}


@dataclass(frozen=True)
class _Pools:
    """What one request of ``tokens`` tokens needs of each linked group's pools (:func:`linked_groups`), on each
    side."""

    tokens: int
    consumer: _Side
    producer: _Side

    @classmethod
    def of(cls, consumer: Plan, producer: Plan, tokens: int, linked: tuple[list[str], list[str]]) -> _Pools:
        cg, pg = linked
        return cls(tokens, _Side.of(consumer, cg, tokens), _Side.of(producer, pg, tokens))

    def check_fit(self, consumer: Plan, producer: Plan) -> None:
        for side, plan, name in ((self.consumer, consumer, "consumer"), (self.producer, producer, "producer")):
            for g, n in side.need.items():
                if n > side.cap(g):
                    raise DemoError(
                        f"--tokens {self.tokens}: {name} group '{g}': {self.tokens} tokens need {n} blocks; the pool "
                        f"holds {side.cap(g)}{_shared(g, plan)}: use at most {max_fit(plan, g)} tokens or a larger "
                        "pool (--pool-mib)"
                    )

    def per_round(self, contiguous: bool) -> int:
        """Requests a round holds: disjoint consumer blocks (contiguous ids: producer blocks too)."""
        n = self.consumer.per_round()
        return max(1, min(n, self.producer.per_round())) if contiguous else n


def _shared(group: str, plan: Plan) -> str:
    """Where ``group`` shares a page pool: which share the count is."""
    from kvlc.demo.content import page_shares

    k = page_shares(plan)[group][0]
    return f" (its share of a page pool that {k} groups share)" if k > 1 else ""


def make_workload(consumer: Plan, producer: Plan, requests: int, tokens: int | None = None, seed: int = 0,
                  ids: str = "random"):
    """Rounds of requests: (id, consumer ids, producer ids, tokens); destinations disjoint within a round.

    ``ids`` (:data:`ID_PATTERNS`): producer block ids drawn at ``"random"`` (a fragmented prefill pool)
    into contiguous runs of the consumer's; ``"scattered"``: random on both sides (a decode pool
    fragmented as well: each round's consumer ids a random permutation's slices); ``"contiguous"``:
    runs on both sides (fresh pools; descriptors coalesce across blocks). Groups whose regions share one
    page pool (declared aliases, a hybrid engine's pool) get their own pages of it on each side
    (:func:`kvlc.demo.content.page_shares`: the pages holding their content).
    """
    _check_workload(requests, tokens, ids)
    rng = np.random.default_rng(seed)
    linked = linked_groups(consumer, producer)  # (pairs every consumer rank: once a workload)
    if tokens is None:
        tokens = default_tokens(consumer, producer, linked=linked)
    pools = _Pools.of(consumer, producer, tokens, linked)
    pools.check_fit(consumer, producer)
    per_round = pools.per_round(ids == "contiguous")
    c, p = pools.consumer, pools.producer
    rounds, i = [], 0
    while i < requests:
        batch = []
        order = c.orders(rng) if ids == "scattered" else None
        for j in range(min(per_round, requests - i)):
            pids = p.runs(j) if ids == "contiguous" else p.drawn(rng)
            cids = c.runs(j) if order is None else c.sliced(order, j)
            batch.append((f"req-{i + j}", cids, pids, pools.tokens))
        rounds.append(batch)
        i += len(batch)
    return rounds


def _check_workload(requests, tokens, ids) -> None:
    if ids not in ID_PATTERNS:
        raise DemoError(f"ids {ids!r}: use one of {', '.join(ID_PATTERNS)}")
    if isinstance(requests, bool) or not isinstance(requests, int) or requests < 1:
        raise DemoError(f"requests {requests!r}: give a whole number of requests, at least 1")
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= MAX_TOKENS):
        raise DemoError(f"tokens {tokens!r}: give a whole number of tokens per request, 1 to {MAX_TOKENS}")


def verify(
    consumer: Plan,
    rank: int,
    producer: Plan,
    before: Mapping[str, np.ndarray],
    after: Mapping[str, np.ndarray],
    batch,
) -> tuple[int, list[str]]:
    """Compare one consumer rank's memory with the content codes of a round's requests."""
    from kvlc.demo.content import expected_bytes, request_tokens

    touched = {k: np.zeros(len(v), bool) for k, v in after.items()}
    checked, problems = 0, []
    for req, cids, pids, tokens in batch:
        expected = expected_bytes(consumer, rank, producer, cids, pids, **request_tokens(tokens))
        for storage, idx, vals in expected:
            bad = np.flatnonzero(after[storage][idx] != vals)
            if bad.size:
                problems.append(
                    f"{req}: rank {rank} storage {storage}: {bad.size} wrong bytes, first at byte "
                    f"{int(idx[bad[0]])}"
                )
            touched[storage][idx] = True
            checked += idx.size
    for name, t in touched.items():
        changed = np.flatnonzero((after[name] != before[name]) & ~t)
        if changed.size:
            problems.append(
                f"rank {rank} storage {name}: {changed.size} bytes outside the requested blocks "
                f"changed, first at byte {int(changed[0])}"
            )
    return checked, problems
