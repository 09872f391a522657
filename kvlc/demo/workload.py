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
    return {g.name: plan.group_capacity(g.name) for g in plan.groups
            if any(g.name in r.groups for r in plan.regions)}


def default_tokens(consumer: Plan, producer: Plan, limit: int = 128) -> int:
    """Tokens per request so that at least two requests fit each consumer pool (at most ``limit``)."""
    cap_c, cap_p = _capacities(consumer), _capacities(producer)
    best = limit
    for g in consumer.groups:
        if g.is_state or g.name not in cap_p:
            continue
        best = min(
            best, max(1, cap_c[g.name] // 2) * g.block_size, cap_p[g.name] * producer.group(g.name).block_size
        )
    return max(1, best)


def max_fit(consumer: Plan, producer: Plan, group: str) -> int:
    """The most tokens one request of ``group`` can carry in both pools."""
    cap_c, cap_p = _capacities(consumer), _capacities(producer)
    return min(cap_c[group] * consumer.group(group).block_size, cap_p[group] * producer.group(group).block_size)


def check_pair(consumer: Plan, producer: Plan) -> None:
    """Pair every consumer rank with the producer before any engine starts (``CompatError`` with the report)."""
    from kvlc.compiler.pairing.pair import pair

    for r in range(consumer.parallel.ranks):
        pair(consumer, producer, local_rank=r, direction="READ")


@dataclass(frozen=True)
class _Pools:
    """What one request of ``tokens`` tokens needs of each shared group's pools, and what they hold."""

    groups: list[str]
    tokens: int
    cap_c: dict[str, int]
    cap_p: dict[str, int]
    need_c: dict[str, int]
    need_p: dict[str, int]

    @classmethod
    def of(cls, consumer: Plan, producer: Plan, tokens: int) -> _Pools:
        groups = [g.name for g in consumer.groups if g.name in {x.name for x in producer.groups}]
        return cls(groups, tokens, _capacities(consumer), _capacities(producer),
                   {g: consumer.blocks_for(g, tokens) for g in groups},
                   {g: producer.blocks_for(g, tokens) for g in groups})

    def check_fit(self, consumer: Plan, producer: Plan) -> None:
        for g in self.groups:
            if self.need_c[g] > self.cap_c[g] or self.need_p[g] > self.cap_p[g]:
                raise DemoError(
                    f"--tokens {self.tokens}: group '{g}': {self.tokens} tokens need {self.need_c[g]} consumer / "
                    f"{self.need_p[g]} producer blocks; the pools hold {self.cap_c[g]} / {self.cap_p[g]}: use at "
                    f"most {max_fit(consumer, producer, g)} tokens or a larger pool (--pool-mib)"
                )

    def per_round(self, contiguous: bool) -> int:
        """Requests a round holds: disjoint consumer blocks (contiguous ids: producer blocks too)."""
        n = max(1, min(self.cap_c[g] // self.need_c[g] for g in self.groups))
        return max(1, min(n, *(self.cap_p[g] // self.need_p[g] for g in self.groups))) if contiguous else n


def make_workload(consumer: Plan, producer: Plan, requests: int, tokens: int | None = None, seed: int = 0,
                  ids: str = "random"):
    """Rounds of requests: (id, consumer ids, producer ids, tokens); destinations disjoint within a round.

    ``ids`` (:data:`ID_PATTERNS`): producer block ids drawn at ``"random"`` (a fragmented prefill pool)
    into contiguous runs of the consumer's; ``"scattered"``: random on both sides (a decode pool
    fragmented as well: each round's consumer ids a random permutation's slices); ``"contiguous"``:
    runs on both sides (fresh pools; descriptors coalesce across blocks).
    """
    _check_workload(requests, tokens, ids)
    rng = np.random.default_rng(seed)
    pools = _Pools.of(consumer, producer, default_tokens(consumer, producer) if tokens is None else tokens)
    pools.check_fit(consumer, producer)
    per_round = pools.per_round(ids == "contiguous")
    rounds, i = [], 0
    while i < requests:
        batch = []
        order = {g: rng.permutation(pools.cap_c[g]) for g in pools.groups} if ids == "scattered" else None
        for j in range(min(per_round, requests - i)):
            pids = _run_of(pools.need_p, j) if ids == "contiguous" else {
                g: rng.choice(pools.cap_p[g], pools.need_p[g], replace=False).tolist() for g in pools.groups}
            cids = _run_of(pools.need_c, j) if order is None else {
                g: order[g][j * n:(j + 1) * n].tolist() for g, n in pools.need_c.items()}
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


def _run_of(need: dict[str, int], j: int) -> dict[str, list[int]]:
    """Request ``j``'s block ids of each group: the ``j``-th run of ``need[group]`` blocks."""
    return {g: list(range(j * n, (j + 1) * n)) for g, n in need.items()}


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
