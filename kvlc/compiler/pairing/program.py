"""Pairing, step 3 — the transfer program: a checked pairing from one local rank's view.

A :class:`TransferProgram` is a frozen value: the two plans, the local rank, the
direction, one :class:`Entry` (region × group × peer rank, with the run templates of
one tile) per copy, and the consumer counts that notifications need. It has no per-request
methods: the free functions of :mod:`kvlc.compiler.request` check requests against it, bind it
to storage addresses and instantiate descriptors (:mod:`kvlc.compiler.request.instantiate`) or
prepared lists (:mod:`kvlc.compiler.request.prepared`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import Mapping, Sequence

import numpy as np

from kvlc.compiler.algebra.sharding import ShardPair
from kvlc.compiler.frozen import FrozenMap, Memo
from kvlc.compiler.pairing.findings import CompatReport
from kvlc.compiler.pairing.match import link_name
from kvlc.compiler.pairing.pp import overlap
from kvlc.compiler.pairing.runs import Piece, Runs
from kvlc.compiler.plan.model import Plan


@dataclass(frozen=True)
class PartKey:
    """One NIXL request of a transfer: the peer rank and both memory types."""

    peer_rank: int
    local_mem: str
    remote_mem: str

    def __str__(self) -> str:
        return f"peer{self.peer_rank}:{self.local_mem}->{self.remote_mem}"


@dataclass(frozen=True, eq=False)
class Part:
    """Row-aligned descriptors of one part: ``local[i]`` ↔ ``remote[i]``, (addr, len, dev) uint64.

    ``blocks``: the same part as block ids over fixed geometry, where it has that form and it was asked
    for (:class:`kvlc.compiler.request.blocks.BlockCopy`: what a same-host copy kernel reads instead of rows).
    """

    local: np.ndarray
    remote: np.ndarray
    blocks: object = field(default=None, repr=False)

    @cached_property
    def nbytes(self) -> int:
        """Bytes moved (summed once: the runtime asks per part more than once per request)."""
        return int(self.local[:, 1].sum()) if len(self.local) else 0

    def __len__(self) -> int:
        return len(self.local)


def join_parts(requests: Sequence[Mapping[PartKey, Part]]) -> dict[PartKey, Part]:
    """Several requests' parts as one part per key: their rows one after another, in request order.

    Rows are not merged across requests (each request's rows are coalesced already). Keys come in
    the order they first appear; a key with no rows in any request is left out.

    >>> a = Part(np.array([[0, 8, 0]], dtype=np.uint64), np.array([[64, 8, 0]], dtype=np.uint64))
    >>> k = PartKey(0, "VRAM", "VRAM")
    >>> j = join_parts([{k: a}, {k: a}])
    >>> j[k].local[:, 0].tolist(), j[k].nbytes
    ([0, 0], 16)
    """
    rows: dict[PartKey, list[Part]] = {}
    for parts in requests:
        for key, part in parts.items():
            if len(part):
                rows.setdefault(key, []).append(part)
    return {key: ps[0] if len(ps) == 1 else Part(np.concatenate([p.local for p in ps]),
                                                 np.concatenate([p.remote for p in ps]))
            for key, ps in rows.items()}


@dataclass(frozen=True)
class Entry:
    """One region (in one group) copied with one peer rank: the runs of one tile.

    ``region`` is the local region, ``remote_region`` the remote one: the same name, or, where a region's
    fields lie in several regions on one engine (``part_of``), the one holding the fields of ``pieces``.
    ``group`` is the local group whose ids address it, ``remote_group`` the remote one: the same name, or
    another where the two engines put the region in other groups (:func:`~kvlc.compiler.pairing.match.group_links`).
    """

    region: str
    group: str
    peer: int
    local_mem: str
    remote_mem: str
    tile_tokens: int          # 0 for per-request state
    local_sub: int            # local kernel blocks per tile
    remote_sub: int
    pieces: tuple[Piece, ...]
    runs: Runs = field(compare=False, repr=False)
    shards: ShardPair | None = None  # decode context parallelism: the tokens each rank holds
    remote_region: str = ""   # the remote region ("": named like ``region``); another where fields are split
    remote_group: str = ""    # the remote group ("": named like ``group``); another where groups differ

    def __post_init__(self) -> None:
        if not self.remote_region:
            object.__setattr__(self, "remote_region", self.region)
        if not self.remote_group:
            object.__setattr__(self, "remote_group", self.group)

    @property
    def link(self) -> str:
        """The group link whose ids address this entry: ``group``, or ``local>remote`` where the names differ
        (a request's ids of the local group and of the remote group)."""
        return link_name(self.group, self.remote_group)

    @property
    def regions_text(self) -> str:
        """``region``, or ``local>remote`` where the two sides hold the fields in regions of other names."""
        return self.region if self.remote_region == self.region else f"{self.region}>{self.remote_region}"

    @property
    def key(self) -> PartKey:
        return PartKey(self.peer, self.local_mem, self.remote_mem)

    @property
    def bytes_per_tile(self) -> int:
        return self.runs.nbytes

    def text(self) -> str:
        kind = "state" if not self.tile_tokens else f"tile={self.tile_tokens} sub={self.local_sub}:{self.remote_sub}"
        if self.shards is not None:
            kind += f" dcp={self.shards.text()}"
        return (f"{self.regions_text} [{self.link}] peer={self.peer} {self.local_mem}->{self.remote_mem} {kind} "
                f"runs={len(self.runs)} bytes={self.bytes_per_tile} | {self.runs.text()}")


@dataclass(frozen=True)
class PartStats:
    """Entries, descriptors per tile and bytes per tile of one part."""

    entries: int = 0
    runs_per_tile: int = 0
    bytes_per_tile: int = 0


@dataclass(frozen=True)
class TransferProgram:
    """A checked pairing from one local rank's view (pure data; per request see :mod:`kvlc.compiler.request`).

    >>> from kvlc import compile_spec
    >>> from kvlc.compiler.pairing.pair import pair
    >>> p = compile_spec("layouts/llama-3.1-8b.yaml")
    >>> prog = pair(p, p, local_rank=0, direction="READ")
    >>> prog.peer_ranks, len(prog.entries)
    ((0,), 32)
    """

    local: Plan = field(repr=False)
    remote: Plan = field(repr=False)
    local_rank: int
    direction: str
    entries: tuple[Entry, ...]
    consumer_counts: FrozenMap[int, int]
    report: CompatReport = field(repr=False)
    memo: Memo = field(default_factory=Memo, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.consumer_counts, FrozenMap):
            object.__setattr__(self, "consumer_counts", FrozenMap(self.consumer_counts))

    # ------------------------------------------------------------------ summary
    @property
    def peer_ranks(self) -> tuple[int, ...]:
        return tuple(sorted({e.peer for e in self.entries}))

    @property
    def part_keys(self) -> tuple[PartKey, ...]:
        return tuple(dict.fromkeys(e.key for e in self.entries))

    def part_stats(self) -> dict[PartKey, PartStats]:
        """Per part: entries, descriptors per tile and bytes per tile."""
        out: dict[PartKey, PartStats] = {}
        for e in self.entries:
            s = out.get(e.key, PartStats())
            out[e.key] = PartStats(s.entries + 1, s.runs_per_tile + len(e.runs),
                                   s.bytes_per_tile + e.bytes_per_tile)
        return out

    def stats(self) -> dict[PartKey, dict[str, int]]:
        """Descriptors and bytes per tile for each (peer, local mem, remote mem), as plain dicts."""
        return {k: {"entries": s.entries, "runs_per_tile": s.runs_per_tile, "bytes_per_tile": s.bytes_per_tile}
                for k, s in self.part_stats().items()}

    def text(self) -> str:
        """Canonical text: a header, one line per part, one line per entry."""
        lines = [f"program {self.direction} local={self.local.name}@{self.local.digest[:12]} rank={self.local_rank} "
                 f"remote={self.remote.name}@{self.remote.digest[:12]} peers={','.join(map(str, self.peer_ranks))}",
                 "consumer_counts " + " ".join(f"{k}:{v}" for k, v in sorted(self.consumer_counts.items()))]
        for key, s in self.part_stats().items():
            lines.append(f"part {key} entries={s.entries} runs/tile={s.runs_per_tile} "
                         f"bytes/tile={s.bytes_per_tile}")
        lines.extend("entry " + e.text() for e in self.entries)
        return "\n".join(lines) + "\n"

    @property
    def digest(self) -> str:
        """sha256 of :meth:`text`, hex."""
        return self.memo.get("digest", lambda: hashlib.sha256(self.text().encode()).hexdigest())

    @property
    def layers(self) -> tuple[int, int]:
        """The layers this program moves: those both engines hold (pipeline stages pair their overlap)."""
        both = overlap(self.local, self.remote)
        return both if both is not None else (0, 0)

    def dcp_text(self) -> str:
        """Which tokens this rank and each peer hold under decode context parallelism ("" without it)."""
        shards = {e.peer: e.shards for e in self.entries if e.shards is not None}
        if not shards:
            return ""
        mine = next(iter(shards.values())).local
        peers = "; ".join(f"peer {p}: {s.remote.describe()}" for p, s in sorted(shards.items()))
        lp, rp = self.local.parallel, self.remote.parallel
        lpcp = f", PCP {lp.pcp_size}: TP rank {lp.tp_rank(self.local_rank)}" if lp.pcp_size > 1 else ""
        rpcp = f" (TP {rp.tp_size} x PCP {rp.pcp_size}: peer p is TP rank p % {rp.tp_size})" if rp.pcp_size > 1 else ""
        return (f"decode context parallelism: local rank {self.local_rank} (DCP {mine.size}{lpcp}) holds "
                f"{mine.describe()}; remote DCP {rp.dcp_size}{rpcp}: {peers}")
