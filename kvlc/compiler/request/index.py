"""Derived structures of a transfer program's hot path, built once per program.

:class:`ProgramIndex` groups entries whose run templates are identical into
:class:`Block` s (vectorized together), holds each side's per-entry geometry as named
arrays (:class:`SideGeometry`), the regions of each group (:class:`GroupRegions`), and
a cache of clipped last-tile runs. Nothing here depends on storage addresses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvlc.compiler.frozen import FrozenMap
from kvlc.compiler.pairing.program import PartKey, TransferProgram
from kvlc.compiler.pairing.runs import Runs, tile_runs
from kvlc.compiler.plan.model import Plan, PlanRegion


def _ro(values) -> np.ndarray:
    a = np.array(values, dtype=np.int64).reshape(-1)
    a.setflags(write=False)
    return a


@dataclass(frozen=True, eq=False)
class SideGeometry:
    """One side's geometry per entry: storage index (into the plan's storages), region offset, block stride."""

    storage: np.ndarray
    offset: np.ndarray
    stride: np.ndarray

    @classmethod
    def of(cls, plan: Plan, regions: list[PlanRegion]) -> "SideGeometry":
        at = {s.name: i for i, s in enumerate(plan.storages)}
        return cls(_ro([at[r.storage] for r in regions]), _ro([r.offset for r in regions]),
                   _ro([r.block_stride for r in regions]))

    def take(self, rows) -> "SideGeometry":
        rows = np.asarray(rows, dtype=np.int64)
        return SideGeometry(self.storage[rows], self.offset[rows], self.stride[rows])

    def __len__(self) -> int:
        return len(self.storage)


@dataclass(frozen=True, eq=False)
class Block:
    """Entries of one part and group link whose run templates are identical (vectorized together).

    ``group``: the entries' group link (:attr:`~kvlc.compiler.pairing.program.Entry.link`): the key of a
    request's ids and spans.

    ``whole``: each tile copies one whole, contiguous block on both sides (runs of
    consecutive blocks then merge into one descriptor).
    """

    key: PartKey
    group: str
    entries: tuple[int, ...]          # indices into program.entries
    runs: Runs
    tile_tokens: int
    local_sub: int
    remote_sub: int
    local: SideGeometry
    remote: SideGeometry
    whole: bool


@dataclass(frozen=True)
class GroupRegions:
    """The regions one group link's block ids address, on each side (program order, no repeats): the local
    regions of its local group and the remote regions of its remote group that pair with them.

    ``smallest_local`` / ``smallest_remote``: the region with the fewest blocks on that side;
    it bounds every id of the group.
    """

    local: tuple[PlanRegion, ...]
    remote: tuple[PlanRegion, ...]
    smallest_local: PlanRegion
    smallest_remote: PlanRegion

    @classmethod
    def of(cls, local: tuple[PlanRegion, ...], remote: tuple[PlanRegion, ...]) -> "GroupRegions":
        return cls(local, remote, min(local, key=lambda r: r.capacity), min(remote, key=lambda r: r.capacity))

    @property
    def is_state(self) -> bool:
        return self.local[0].is_state

    def smallest(self, side: str) -> PlanRegion:
        return self.smallest_local if side == "local" else self.smallest_remote


def _is_whole(runs: Runs, local_sub: int, remote_sub: int, local: SideGeometry, remote: SideGeometry) -> bool:
    if not (len(runs) == 1 and local_sub == 1 and remote_sub == 1):
        return False
    if int(runs.local_block[0]) or int(runs.remote_block[0]) or int(runs.local_offset[0]) \
            or int(runs.remote_offset[0]):
        return False
    n = int(runs.length[0])
    return bool(np.all(local.stride == n) and np.all(remote.stride == n))


def _blocks(prog: TransferProgram, local: SideGeometry, remote: SideGeometry) -> tuple[Block, ...]:
    groups: dict[tuple, list[int]] = {}
    for i, e in enumerate(prog.entries):
        # the geometry (fields, pieces) is part of the key: a partial last tile clips each
        # region by its own layout even where whole tiles copy alike
        k = (e.key, e.link, e.tile_tokens, e.local_sub, e.remote_sub, e.runs.key(),
             prog.local.region(e.region).fields, prog.remote.region(e.remote_region).fields, e.pieces, e.shards)
        groups.setdefault(k, []).append(i)
    keys = {k: k for k in prog.part_keys}  # one PartKey object per part: dict lookups per request hit identity
    order = {k: i for i, k in enumerate(keys)}
    out = []
    for idx in groups.values():
        e = prog.entries[idx[0]]
        lg, rg = local.take(idx), remote.take(idx)
        out.append(Block(keys[e.key], e.link, tuple(idx), e.runs, e.tile_tokens, e.local_sub, e.remote_sub, lg, rg,
                         _is_whole(e.runs, e.local_sub, e.remote_sub, lg, rg)))
    out.sort(key=lambda b: (order[b.key], b.entries[0]))
    return tuple(out)


def _group_regions(prog: TransferProgram) -> FrozenMap:
    out: dict[str, tuple[dict, dict]] = {}  # per group: region name -> region, each side in first-seen order
    for e in prog.entries:  # each side on its own: a split region pairs one local region with several
        lregs, rregs = out.setdefault(e.link, ({}, {}))
        if e.region not in lregs:  # (by name: a plan's region names are unique; comparing models cost O(n^2))
            lregs[e.region] = prog.local.region(e.region)
        if e.remote_region not in rregs:
            rregs[e.remote_region] = prog.remote.region(e.remote_region)
    return FrozenMap((g, GroupRegions.of(tuple(a.values()), tuple(b.values()))) for g, (a, b) in out.items())


def program_index(prog: TransferProgram) -> "ProgramIndex":
    """The program's :class:`ProgramIndex`, built on first use and kept in its memo."""
    return prog.memo.get("index", lambda: ProgramIndex(prog))


class ProgramIndex:
    """The hot path's view of one program (see the module docstring); get it with :func:`program_index`."""

    def __init__(self, prog: TransferProgram):
        self.program = prog
        lregs = [prog.local.region(e.region) for e in prog.entries]
        rregs = [prog.remote.region(e.remote_region) for e in prog.entries]
        self.local = SideGeometry.of(prog.local, lregs)
        self.remote = SideGeometry.of(prog.remote, rregs)
        self.blocks = _blocks(prog, self.local, self.remote)
        self.groups = _group_regions(prog)
        self._tails: dict[tuple[int, int, int], Runs] = {}

    def tail_runs(self, block: Block, tokens: int, start: int = 0) -> Runs:
        """Runs of tokens ``[start, tokens)`` of a partial tile (cached per block and token range)."""
        key = (block.entries[0], tokens, start)
        got = self._tails.get(key)
        if got is None:
            e = self.program.entries[block.entries[0]]
            got = self._tails.setdefault(key, tile_runs(self.program.local.region(e.region),
                                                        self.program.remote.region(e.remote_region), e.pieces, tokens,
                                                        start, e.shards))
        return got
