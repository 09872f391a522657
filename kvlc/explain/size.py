"""``kvlc size``: what one request of N tokens costs — blocks, bytes and NIXL descriptors.

Nothing here is estimated: each rank's program is paired through :func:`kvlc.pair` and
instantiated for one request, and the descriptors it returns are counted, twice:

* **scattered** block ids (every id apart from its neighbours: no two blocks merge), the worst
  case and what a long-running engine's free list tends to give;
* **contiguous** block ids (``0, 1, 2, ...`` on both sides), the best case: consecutive blocks
  of a region merge into one descriptor where the layout allows.

Bytes are per rank (each rank's share of heads); the engine sums its ``tp_size`` ranks.
Without a peer the request moves between two engines of the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlc.compiler.pairing.pair import pair
from kvlc.compiler.plan.model import Plan
from kvlc.compiler.request.bind import bind
from kvlc.compiler.request.instantiate import instantiate
from kvlc.errors import KvlcError

_BASE = 1 << 40   # storage i of a side is placed at (i + 1) * _BASE: storages never touch


@dataclass(frozen=True)
class GroupSize:
    """One group's share of a request on one rank: ``blocks`` logical blocks holding ``bytes``."""

    group: str
    kind: str
    tokens: int          # tokens the request has in this group (0: per-request state)
    blocks: int          # logical blocks per rank
    bytes: int           # bytes those blocks hold on one rank, over every region of the group
    regions: int


@dataclass(frozen=True)
class PartSize:
    """One NIXL request of one rank: bytes and descriptors towards one peer rank and memory pair."""

    peer_rank: int
    local_mem: str
    remote_mem: str
    bytes: int
    scattered: int       # descriptors with scattered block ids
    contiguous: int      # descriptors with contiguous block ids


@dataclass(frozen=True)
class RankSize:
    """What one local rank moves for the request."""

    rank: int
    parts: tuple[PartSize, ...]

    @property
    def bytes(self) -> int:
        return sum(p.bytes for p in self.parts)

    @property
    def scattered(self) -> int:
        return sum(p.scattered for p in self.parts)

    @property
    def contiguous(self) -> int:
        return sum(p.contiguous for p in self.parts)

    @property
    def peers(self) -> tuple[int, ...]:
        return tuple(sorted({p.peer_rank for p in self.parts}))


@dataclass(frozen=True)
class RequestSize:
    """A request of ``tokens`` tokens between ``local`` (this engine) and ``remote``.

    >>> from kvlc import compile_spec
    >>> p = compile_spec("layouts/llama-3.1-8b.yaml")
    >>> s = request_size(p, 1000)
    >>> [(g.blocks, g.bytes) for g in s.groups], s.ranks[0].bytes, s.ranks[0].scattered, s.ranks[0].contiguous
    ([(63, 132120576)], 131072000, 2048, 64)
    """

    local: str
    remote: str
    direction: str       # READ: this engine consumes (pull); WRITE: it produces (push)
    tokens: int
    tp_size: int
    groups: tuple[GroupSize, ...]
    ranks: tuple[RankSize, ...]

    @property
    def rank_bytes(self) -> int:
        """Bytes the request's blocks hold on one rank (whole blocks, every group)."""
        return sum(g.bytes for g in self.groups)

    @property
    def engine_bytes(self) -> int:
        return self.rank_bytes * self.tp_size

    @property
    def moved(self) -> int:
        """Bytes moved by every rank of this engine together."""
        return sum(r.bytes for r in self.ranks)

    @property
    def scattered(self) -> int:
        return sum(r.scattered for r in self.ranks)

    @property
    def contiguous(self) -> int:
        return sum(r.contiguous for r in self.ranks)


def _groups(plan: Plan, tokens: int) -> tuple[GroupSize, ...]:
    out = []
    for g in plan.groups:
        regs = [r for r in plan.regions if g.name in r.groups]
        if not regs:
            continue
        n = plan.blocks_for(g.name, tokens)
        cap = plan.group_capacity(g.name)
        if n > cap:
            raise KvlcError(
                f"{tokens:,} tokens need {n:,} blocks of group '{g.name}' in plan '{plan.name}', which holds "
                f"{cap:,} ({cap * g.block_size:,} tokens); ask for at most {cap * g.block_size:,} tokens")
        out.append(GroupSize(g.name, g.kind, 0 if g.is_state else tokens, n,
                             sum(n * r.block_bytes * r.kernel_blocks_per_block for r in regs), len(regs)))
    return tuple(out)


def _ids(plan: Plan, tokens: int, groups, scattered: bool) -> dict[str, list[int]]:
    """Block ids per group: ``0..n-1`` ascending, or descending (no two consecutive).

    Where groups share one page pool (declared aliases) each group gets its own pages, one range
    after the other, as an engine's allocator would hand them out.
    """
    shared = any(r.aliases for r in plan.regions)
    out, start = {}, 0
    for g in groups:
        n = plan.blocks_for(g, tokens)
        ids = list(range(start, start + n))
        out[g] = ids[::-1] if scattered else ids
        start += n if shared else 0
    return out


def _bases(plan: Plan) -> dict[str, tuple[int, int]]:
    return {s.name: ((i + 1) * _BASE, s.device) for i, s in enumerate(plan.storages)}


def _rank(local: Plan, remote: Plan, rank: int, direction: str, tokens: int) -> RankSize:
    prog = pair(local, remote, local_rank=rank, direction=direction)
    groups = sorted({e.group for e in prog.entries})
    remote_groups = sorted({e.remote_group for e in prog.entries})  # other names where a region's groups differ
    bound = bind(prog, _bases(local), {p: _bases(remote) for p in prog.peer_ranks})
    counts = {}
    for scattered in (True, False):
        parts = instantiate(bound, _ids(local, tokens, groups, scattered),
                            _ids(remote, tokens, remote_groups, scattered), tokens)
        counts[scattered] = parts
    parts = tuple(PartSize(k.peer_rank, k.local_mem, k.remote_mem, part.nbytes, len(part),
                           len(counts[False][k])) for k, part in counts[True].items())
    return RankSize(rank, parts)


def request_size(plan: Plan, tokens: int, peer: Plan | None = None, direction: str = "READ",
                 ranks: tuple[int, ...] | None = None) -> RequestSize:
    """Blocks, bytes and descriptors of one request of ``tokens`` tokens (see the module text).

    ``plan`` is this engine; ``peer`` the other one (default: the same plan); ``direction``
    READ (this engine pulls from the peer) or WRITE (it pushes); ``ranks``: this engine's ranks
    to pair (default all). Raises :class:`~kvlc.errors.KvlcError` for a request that does not
    fit either plan and :class:`~kvlc.errors.CompatError` for plans that do not pair.
    """
    if tokens <= 0:
        raise KvlcError(f"--tokens must be a positive number of tokens, got {tokens}")
    peer = plan if peer is None else peer
    groups = _groups(plan, tokens)
    if peer is not plan:
        _groups(peer, tokens)
    tp = plan.parallel.tp_size
    for r in ranks or ():
        if not 0 <= r < tp:
            raise KvlcError(f"rank {r} outside plan '{plan.name}' (tp_size {tp}); use 0..{tp - 1}")
    chosen = tuple(range(tp)) if ranks is None else tuple(ranks)
    return RequestSize(plan.name, peer.name, direction, tokens, tp, groups,
                       tuple(_rank(plan, peer, r, direction, tokens) for r in chosen))
