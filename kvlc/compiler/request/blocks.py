"""Per request, a part as block ids over fixed geometry: what a copy kernel needs instead of rows.

Where every tile of a part's entries is one run between one kernel block on each side, row ``k`` of
entry ``e`` is ``local base[e] + local id[k] * local stride[e]`` ↔ ``remote base[e] + remote id[k] *
remote stride[e]``, ``length[e]`` bytes (the run's offsets are in the bases). The geometry is fixed per
binding (:class:`BlockTable`, made once per part); a request adds only its ids (:class:`BlockCopy`), so a
kernel that computes the addresses itself needs a few kilobytes per request where rows take 48 bytes
each. The same rows as :func:`~kvlc.compiler.request.instantiate.emit` writes before it coalesces them
(:meth:`BlockCopy.rows`; tests/test_blocks.py). The partial tiles a token range cuts at its ends (a
prompt's last block, a range that starts inside a block) come as a few rows of their own
(:attr:`BlockCopy.edge`: per part and end at most one tile's runs per entry); a part with a tile of several
runs (another TP, another block size) has no block form and moves as rows. Where every part of a request has
one, :class:`BlockPart` gives each part with its rows built only if something asks for them (NIXL, staging,
a refusal's words).

Every row of an entry lies in its regions' extents (:attr:`BlockTable.remote_lo` / ``remote_hi`` on the
peer's side), for any ids :func:`~kvlc.compiler.request.check.check_request` lets through (each below its
region's block count): a copier checks the extents once, not the rows of each request (the edge rows,
few, it checks as rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import numpy as np

from kvlc.compiler.pairing.program import Part, PartKey
from kvlc.compiler.request.bind import BoundProgram
from kvlc.compiler.request.check import Request, block_tiles
from kvlc.compiler.request.index import Block, ProgramIndex, program_index
from kvlc.compiler.request.rows import write_rows
from kvlc.compiler.request.tiles import tile_rows

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
    remote_lo: np.ndarray    # the peer's bytes each entry's rows can reach: its region's [first, end)
    remote_hi: np.ndarray
    slot_bytes: tuple[int, ...]    # bytes one id moves in each slot (its entries' lengths summed)
    slot_merging: tuple[int, ...]  # entries of each slot whose rows of consecutive ids continue (stride = length)
    slot_apart: tuple[int, ...]    # ... and the others

    @property
    def entries(self) -> int:
        return len(self.length)


@dataclass(frozen=True, eq=False)
class BlockCopy:
    """One request's part in block form: the part's :class:`BlockTable` and the request's ids.

    ``ids`` (int64): :data:`HEADER` words per slot (offsets into ``ids`` of the slot's local ids and of its
    remote ids, and their count), then the ids themselves: the request's whole tiles. ``count``: the most ids
    of any slot. ``edge``: the rows of the partial tiles at the token range's ends, each side ``(N, 3)``
    uint64 as ``emit`` writes rows (address, length, device; not coalesced), or None.
    """

    table: BlockTable
    ids: np.ndarray
    count: int
    edge: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def head(self) -> np.ndarray:
        """The slots' words: (slots, :data:`HEADER`) int64 (local ids at, remote ids at, count)."""
        return self.ids[:HEADER * len(self.table.blocks)].reshape(-1, HEADER)

    def counts(self) -> np.ndarray:
        """Ids of each slot (int64)."""
        return self.head[:, 2]

    @cached_property
    def nbytes(self) -> int:
        """Bytes moved."""
        tiles = sum(b * int(n) for b, n in zip(self.table.slot_bytes, self.counts().tolist()))
        return tiles + (int(self.edge[0][:, 1].sum()) if self.edge is not None else 0)

    @cached_property
    def runs(self) -> int:
        """Rows once consecutive ids (on both sides) merge within each entry, and the edge rows: what ``emit``
        gives for the part unless rows of different entries continue one another (separate regions do not) or
        an edge row continues a tile's."""
        out = len(self.edge[0]) if self.edge is not None else 0
        for (la, ra, n), merging, apart in zip(self.head.tolist(), self.table.slot_merging, self.table.slot_apart):
            out += apart * n
            if n and merging:  # (a slot's remote ids follow its local ones: one diff for both sides)
                step = np.diff(self.ids[la:la + 2 * n].reshape(2, n), axis=1) != 1
                out += merging * (1 + int(np.count_nonzero(step[0] | step[1])))
        return out

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The rows this form stands for, entry by entry, id by id, then the edge rows (before any coalescing):
        local and remote ``(N, 2)`` int64 (address, length). The reference the kernels are checked against."""
        t, head = self.table, self.head
        local, remote = [], []
        for e in range(t.entries):
            la, ra, n = head[t.slot[e]].tolist()
            il, ir = self.ids[la:la + n], self.ids[ra:ra + n]
            length = np.full(n, t.length[e], np.int64)
            local.append(np.stack([t.local_base[e] + il * t.local_stride[e], length], axis=1))
            remote.append(np.stack([t.remote_base[e] + ir * t.remote_stride[e], length], axis=1))
        if self.edge is not None:
            local.append(self.edge[0][:, :2].view(np.int64))
            remote.append(self.edge[1][:, :2].view(np.int64))
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
    prog = bound.program
    index = program_index(prog)
    per: dict[PartKey, list[int]] = {}
    for i, b in enumerate(index.blocks):
        per.setdefault(b.key, []).append(i)
    geometries = bound.geometries()
    out = {}
    for key, which in per.items():
        blocks = [index.blocks[i] for i in which]
        if not all(_one_run(b) for b in blocks):
            continue
        cols: dict[str, list] = {c: [] for c in ("lb", "ls", "rb", "rs", "len", "slot", "lo", "hi")}
        for s, (i, b) in enumerate(zip(which, blocks)):
            g, r, e = geometries[i], b.runs, len(b.entries)
            regions = [prog.remote.region(prog.entries[j].remote_region) for j in b.entries]
            cols["lb"].append(g.base[0, :, 0] + int(r.local_offset[0]))
            cols["rb"].append(g.base[1, :, 0] + int(r.remote_offset[0]))
            cols["ls"].append(g.stride[0, :, 0])
            cols["rs"].append(g.stride[1, :, 0])
            cols["len"].append(np.full(e, int(r.length[0]), np.int64))
            cols["slot"].append(np.full(e, s, np.int64))
            cols["lo"].append(g.base[1, :, 0])  # (the base holds the region's offset in its storage)
            cols["hi"].append(g.base[1, :, 0] + np.array([x.end - x.offset for x in regions], dtype=np.int64))
        arrays = {c: np.ascontiguousarray(np.concatenate(v), dtype=np.int64) for c, v in cols.items()}
        for a in arrays.values():
            a.setflags(write=False)
        n = len(which)
        per = np.bincount(arrays["slot"], weights=arrays["len"], minlength=n).astype(np.int64).tolist()
        merging = (arrays["ls"] == arrays["len"]) & (arrays["rs"] == arrays["len"])
        count = lambda m: tuple(np.bincount(arrays["slot"][m], minlength=n).tolist())  # noqa: E731
        out[key] = BlockTable(key, arrays["lb"], arrays["ls"], arrays["rb"], arrays["rs"], arrays["len"],
                              arrays["slot"], tuple(which), arrays["lo"], arrays["hi"], tuple(per),
                              count(merging), count(~merging))
    return out


def block_copies(bound: BoundProgram, req: Request) -> dict[PartKey, BlockCopy]:
    """The block form of each part of a checked request that has one (see the module docstring): parts
    without one, or whose ids move nothing, are left out."""
    index = program_index(bound.program)
    out = {}
    for key, table in block_tables(bound).items():
        got = _copy(table, bound, index, req)
        if got is not None:
            out[key] = got
    return out


@dataclass(frozen=True, eq=False)
class _Edge:
    """The rows of tokens ``[lo, hi)`` of one tile of an index block, for kernel id 0 on both sides (fixed per
    binding): for ids ``(il, ir)`` each side's addresses move by its id times :attr:`stride`."""

    rows: np.ndarray    # (2, N, 3) int64: each side's rows (address, length, device) for id 0
    stride: np.ndarray  # (2, N) int64: each row's block stride on its side


def _edge(bound: BoundProgram, index: ProgramIndex, i: int, lo: int, hi: int) -> _Edge:
    """Index block ``i``'s partial tile ``[lo, hi)`` as rows for id 0 (kept in the binding's memo: a request
    then moves them by its ids, a few numpy calls instead of building rows)."""
    def make() -> _Edge:
        b, g = index.blocks[i], bound.geometries()[i]
        zero = np.zeros(1, dtype=np.int64)
        runs = index.tail_runs(b, hi, lo)
        piece = tile_rows(runs, 0, 1, b, zero, zero, g)  # (one-run tiles: every run in the tile's one block)
        if piece is None:
            return _Edge(np.zeros((2, 0, 3), np.int64), np.zeros((2, 0), np.int64))
        lrows, rrows = write_rows(piece)
        k = len(piece)
        stride = np.repeat(g.stride[:, :, 0], k, axis=1)  # (2, E * K): entry e's stride for each of its runs
        return _Edge(np.stack((lrows.reshape(-1, 3), rrows.reshape(-1, 3))), stride)
    return bound.memo.get(("block_edge", i, lo, hi), make)


def _copy(table: BlockTable, bound: BoundProgram, index: ProgramIndex, req: Request) -> BlockCopy | None:
    head: list[int] = []
    chunks: list[np.ndarray] = []
    edges: list[np.ndarray] = []
    at, most = HEADER * len(table.blocks), 0
    for i in table.blocks:
        b = index.blocks[i]
        ts, shift = block_tiles(b, req)
        for p in ts.partial:  # (a one-run tile is one kernel block: its ids are those of the tile)
            e = _edge(bound, index, i, p.lo, p.hi)
            got = e.rows.copy()
            ids = np.array([[req.local[b.group][p.tile - shift[0]]], [req.remote[b.group][p.tile - shift[1]]]])
            got[:, :, 0] += ids * e.stride
            edges.append(got)
        n = ts.count
        ol, orr = ts.first - shift[0], ts.first - shift[1]
        chunks += (req.local[b.group][ol:ol + n], req.remote[b.group][orr:orr + n])
        head += (at, at + n, n)
        at += 2 * n
        most = max(most, n)
    if not most and not edges:
        return None
    ids = np.empty(at, dtype=np.int64)
    ids[:len(head)] = head
    pos = len(head)
    for c in chunks:
        ids[pos:pos + len(c)] = c
        pos += len(c)
    edge = None
    if edges:
        both = (edges[0] if len(edges) == 1 else np.concatenate(edges, axis=1)).view(np.uint64)
        edge = (both[0], both[1])
    return BlockCopy(table, ids, most, edge)


class BlockPart:
    """A part given by its block form (:attr:`blocks`); its rows (:attr:`local`, :attr:`remote`) are built when
    first asked for, by ``build`` (every part of the request at once: see :func:`block_parts`). Its length is
    :attr:`BlockCopy.runs` (what its rows would be), its bytes the form's: neither builds rows."""

    def __init__(self, key: PartKey, blocks: BlockCopy, build: Callable[[], dict]):
        self._key, self.blocks, self._build = key, blocks, build

    @property
    def local(self) -> np.ndarray:
        return self._part().local

    @property
    def remote(self) -> np.ndarray:
        return self._part().remote

    @property
    def built(self) -> bool:
        """Whether its rows were asked for."""
        return self._build is None

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    def __len__(self) -> int:
        return self.blocks.runs

    def _part(self) -> Part:
        got = self.__dict__.get("_rows")
        if got is None:
            got = self._rows = self._build()[self._key]
            self._build = None
        return got


def block_parts(bound: BoundProgram, req: Request, forms: dict[PartKey, BlockCopy], rows: Callable[[], dict]
                ) -> dict[PartKey, BlockPart] | None:
    """Every part of a request as a :class:`BlockPart`, or None unless each part it moves has a block form
    (``forms``); ``rows()``: the request's parts as rows (called once, when a part's rows are first asked for)."""
    if not forms or len(forms) != bound.memo.get("part_count", lambda: len(bound.program.part_keys)):
        return None
    made: dict = {}

    def build() -> dict:
        if not made:
            made.update(rows())
        return made
    return {key: BlockPart(key, form, build) for key, form in forms.items()}
