"""Per request, a part as block ids over fixed geometry: what a copy kernel needs instead of rows.

Where every tile of a part's entries is one run between one kernel block on each side, row ``k`` of
entry ``e`` is ``local base[e] + local id[k] * local stride[e]`` ↔ ``remote base[e] + remote id[k] *
remote stride[e]``, ``length[e]`` bytes (the run's offsets are in the bases). The geometry is fixed per
binding (:class:`BlockTable`, made once per part); a request adds only its ids (:class:`BlockCopy`), so a
kernel that computes the addresses itself needs a few kilobytes per request where rows take 48 bytes
each. The same rows as :func:`~kvlc.compiler.request.instantiate.emit` writes before it coalesces them
(:meth:`BlockCopy.rows`; tests/test_blocks.py), for whole tiles only: a request with a partial tile in a
part, or a part with a tile of several runs (another TP, another block size), has no block form and
moves as rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvlc.compiler.pairing.program import PartKey
from kvlc.compiler.request.bind import BoundProgram
from kvlc.compiler.request.check import Request, block_tiles
from kvlc.compiler.request.index import Block, program_index

HEADER = 3  # int64s per slot at the head of a request's ids: where its local ids start, its remote ids, how many


@dataclass(frozen=True, eq=False)
class BlockTable:
    """One part's entries, fixed per binding: each (E,) int64; ``slot[e]``: which of a request's id slots
    entry ``e`` reads (one slot per index block of the part, in :attr:`blocks` order)."""

    key: PartKey
    local_base: np.ndarray
    local_stride: np.ndarray
    remote_base: np.ndarray
    remote_stride: np.ndarray
    length: np.ndarray
    slot: np.ndarray
    blocks: tuple[int, ...]  # positions in the program index's blocks

    @property
    def entries(self) -> int:
        return len(self.length)


@dataclass(frozen=True, eq=False)
class BlockCopy:
    """One request's part in block form: the part's :class:`BlockTable` and the request's ids.

    ``ids`` (int64): :data:`HEADER` words per slot (offsets into ``ids`` of the slot's local ids and of its
    remote ids, and their count), then the ids themselves. ``count``: the most ids of any slot.
    """

    table: BlockTable
    ids: np.ndarray
    count: int

    def counts(self) -> np.ndarray:
        """Ids of each slot (int64)."""
        return self.ids[:HEADER * len(self.table.blocks)].reshape(-1, HEADER)[:, 2]

    def remote_span(self) -> tuple[np.ndarray, np.ndarray]:
        """Per entry, the peer's bytes its rows reach in this request: ``[lo, hi)`` (uint64; an entry whose slot
        has no ids spans nothing at its base)."""
        t = self.table
        lo_id, hi_id, n = self._extremes(1)
        lo = t.remote_base + lo_id[t.slot] * t.remote_stride
        hi = t.remote_base + hi_id[t.slot] * t.remote_stride + np.where(n[t.slot] > 0, t.length, 0)
        return lo.astype(np.uint64), hi.astype(np.uint64)

    def _extremes(self, side: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        head = self.ids[:HEADER * len(self.table.blocks)].reshape(-1, HEADER)
        lo, hi = np.zeros(len(head), np.int64), np.zeros(len(head), np.int64)
        for s, (at, n) in enumerate(zip(head[:, side].tolist(), head[:, 2].tolist())):
            if n:
                ids = self.ids[at:at + n]
                lo[s], hi[s] = ids.min(), ids.max()
        return lo, hi, head[:, 2]

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The rows this form stands for, entry by entry, id by id (before any coalescing): local and remote
        ``(N, 2)`` int64 (address, length). The reference the kernels are checked against."""
        t = self.table
        head = self.ids[:HEADER * len(t.blocks)].reshape(-1, HEADER)
        local, remote = [], []
        for e in range(t.entries):
            la, ra, n = head[t.slot[e]].tolist()
            il, ir = self.ids[la:la + n], self.ids[ra:ra + n]
            length = np.full(n, t.length[e], np.int64)
            local.append(np.stack([t.local_base[e] + il * t.local_stride[e], length], axis=1))
            remote.append(np.stack([t.remote_base[e] + ir * t.remote_stride[e], length], axis=1))
        empty = np.zeros((0, 2), np.int64)
        return (np.concatenate(local) if local else empty), (np.concatenate(remote) if remote else empty)


def _one_run(b: Block) -> bool:
    """Whether each tile of ``b`` is one run between one kernel block on each side."""
    r = b.runs
    return (len(r) == 1 and b.local_sub == 1 and b.remote_sub == 1 and not int(r.local_block[0])
            and not int(r.remote_block[0]))


def block_tables(bound: BoundProgram) -> dict[PartKey, BlockTable]:
    """The block table of every part whose blocks all have one run per tile (kept in the binding's memo)."""
    return bound.memo.get("block_tables", lambda: _tables(bound))


def _tables(bound: BoundProgram) -> dict[PartKey, BlockTable]:
    index = program_index(bound.program)
    per: dict[PartKey, list[int]] = {}
    for i, b in enumerate(index.blocks):
        per.setdefault(b.key, []).append(i)
    geometries = bound.geometries()
    out = {}
    for key, which in per.items():
        blocks = [index.blocks[i] for i in which]
        if not all(_one_run(b) for b in blocks):
            continue
        cols: dict[str, list] = {c: [] for c in ("lb", "ls", "rb", "rs", "len", "slot")}
        for s, (i, b) in enumerate(zip(which, blocks)):
            g, r, e = geometries[i], b.runs, len(b.entries)
            cols["lb"].append(g.base[0, :, 0] + int(r.local_offset[0]))
            cols["rb"].append(g.base[1, :, 0] + int(r.remote_offset[0]))
            cols["ls"].append(g.stride[0, :, 0])
            cols["rs"].append(g.stride[1, :, 0])
            cols["len"].append(np.full(e, int(r.length[0]), np.int64))
            cols["slot"].append(np.full(e, s, np.int64))
        arrays = {c: np.ascontiguousarray(np.concatenate(v), dtype=np.int64) for c, v in cols.items()}
        for a in arrays.values():
            a.setflags(write=False)
        out[key] = BlockTable(key, arrays["lb"], arrays["ls"], arrays["rb"], arrays["rs"], arrays["len"],
                              arrays["slot"], tuple(which))
    return out


def block_copies(bound: BoundProgram, req: Request) -> dict[PartKey, BlockCopy]:
    """The block form of each part of a checked request that has one (see the module docstring): parts
    without one, or whose ids move nothing, are left out."""
    index = program_index(bound.program)
    out = {}
    for key, table in block_tables(bound).items():
        got = _copy(table, [index.blocks[i] for i in table.blocks], req)
        if got is not None:
            out[key] = got
    return out


def _copy(table: BlockTable, blocks: list[Block], req: Request) -> BlockCopy | None:
    head: list[int] = []
    chunks: list[np.ndarray] = []
    at, most = HEADER * len(blocks), 0
    for b in blocks:
        ts, shift = block_tiles(b, req)
        if ts.partial:
            return None
        n = ts.count
        ol, orr = ts.first - shift[0], ts.first - shift[1]
        chunks += (req.local[b.group][ol:ol + n], req.remote[b.group][orr:orr + n])
        head += (at, at + n, n)
        at += 2 * n
        most = max(most, n)
    if not most:
        return None
    ids = np.empty(at, dtype=np.int64)
    ids[:len(head)] = head
    pos = len(head)
    for c in chunks:
        ids[pos:pos + len(c)] = c
        pos += len(c)
    return BlockCopy(table, ids, most)
