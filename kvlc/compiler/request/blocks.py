"""Per request, a part as block ids over fixed geometry: what a copy kernel needs instead of rows.

A table entry is one run of a tile of one program entry: for tile ``k`` its row is ``local base[e] +
local id * local stride[e]`` ↔ ``remote base[e] + remote id * remote stride[e]``, ``length[e]`` bytes (the
run's offsets are in the bases; the ids: those of the run's kernel block in tile ``k`` on each side). A
tile of several runs (another TP: a slice of each block's heads; another block size: a tile of several
kernel blocks on one side) is one entry per run. The geometry is fixed per binding (:class:`BlockTable`,
made once per part); a request adds only its ids (:class:`BlockCopy`), so a kernel that computes the
addresses itself needs a few kilobytes per request where rows take 48 bytes each. The same rows as
:func:`~kvlc.compiler.request.instantiate.emit` writes before it coalesces them (:meth:`BlockCopy.rows`;
tests/test_blocks.py). The partial tiles a token range cuts at its ends (a prompt's last block, a range
that starts inside a block) are entries too, each reading a slot of one tile: a part's table with the entries
of the partial tiles a request has after its own is made once per binding, part and tiles' token spans (an
engine's requests end at a few offsets), so a request adds only ids there as well. Where every part of a
request has a form (every part that moves something), :class:`BlockPart` gives each part with its rows built
only if something asks for them (NIXL, staging, a refusal's words).

Every row of an entry lies in its regions' extents (:attr:`BlockTable.remote_lo` / ``remote_hi`` on the
peer's side), for any ids :func:`~kvlc.compiler.request.check.check_request` lets through (each below its
region's block count): a copier checks the extents once per table, not the rows of each request.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import numpy as np

from kvlc.compiler.pairing.program import Part, PartKey
from kvlc.compiler.request.bind import BoundProgram
from kvlc.compiler.request.check import Request, block_tiles
from kvlc.compiler.request import native
from kvlc.compiler.request.index import ProgramIndex, program_index
from kvlc.compiler.request.rows import write_rows
from kvlc.compiler.request.tiles import tile_rows

HEADER = 3  # int64s per slot at the head of a request's ids: where its local ids start, its remote ids, how many


@dataclass(frozen=True, eq=False)
class BlockTable:
    """One part's entries, fixed per binding: each (E,) int64, one entry per run of a tile of each program
    entry; ``slot[e]``: which of a request's id slots entry ``e`` reads (one slot per index block of the part,
    in :attr:`blocks` order; in a table made for a request's partial tiles, then one per tile). Tile ``k`` of a
    slot reads local id ``ids[k * local_sub[e] + local_block[e]]`` of the slot's local ids (a tile spans
    ``local_sub`` kernel blocks: another block size), remote alike."""

    key: PartKey
    local_base: np.ndarray
    local_stride: np.ndarray
    remote_base: np.ndarray
    remote_stride: np.ndarray
    length: np.ndarray
    slot: np.ndarray
    local_sub: np.ndarray    # kernel blocks per tile on each side, and the run's block in its tile
    local_block: np.ndarray
    remote_sub: np.ndarray
    remote_block: np.ndarray
    blocks: tuple[int, ...]  # positions in the program index's blocks
    remote_lo: np.ndarray    # the peer's bytes each entry's rows can reach: its region's [first, end)
    remote_hi: np.ndarray
    slot_bytes: tuple[int, ...]    # bytes one id moves in each slot (its entries' lengths summed)
    slot_merging: tuple[int, ...]  # entries of each slot whose rows of consecutive ids continue (a whole block each)
    slot_apart: tuple[int, ...]    # ... and the others

    @property
    def entries(self) -> int:
        return len(self.length)

    @property
    def slots(self) -> int:
        """Id slots: one per index block (:attr:`blocks`), then one per partial tile of a request's (if any)."""
        return len(self.slot_bytes)


@dataclass(frozen=True, eq=False)
class EdgePiece:
    """One partial tile of a request (a token range's end inside a tile): its slot among the index blocks' (where
    the whole tiles beside it are), and whether it is the range's last tile (else its first). ``mask``: the
    entries whose whole-block rows this tile's rows continue (tail: its first row at the block's start) or are
    continued by (head: its last row at the block's end) where its kernel ids ``(il, ir)`` neighbour those of
    the tile beside it on both sides (None: no entry's)."""

    slot: int
    tail: bool
    mask: np.ndarray | None = None
    il: int = 0
    ir: int = 0


@dataclass(frozen=True, eq=False)
class BlockCopy:
    """One request's part in block form: the part's :class:`BlockTable` and the request's ids.

    ``ids`` (int64): :data:`HEADER` words per slot (offsets into ``ids`` of the slot's local ids and of its
    remote ids, and how many tiles), then the ids themselves (per tile ``local_sub`` local and ``remote_sub``
    remote ones). ``count``: the most tiles of any slot. A partial tile at the token range's ends is a slot of
    one tile after the index blocks' slots, read by entries of its own (:attr:`BlockTable.blocks` says how many
    slots are index blocks'); ``edge_pieces``: those tiles, in slot order.
    """

    table: BlockTable
    ids: np.ndarray
    count: int
    edge_pieces: tuple[EdgePiece, ...] = ()

    @property
    def head(self) -> np.ndarray:
        """The slots' words: (slots, :data:`HEADER`) int64 (local ids at, remote ids at, count)."""
        return self.ids[:HEADER * self.table.slots].reshape(-1, HEADER)

    def counts(self) -> np.ndarray:
        """Tiles of each slot (int64)."""
        return self.head[:, 2]

    @cached_property
    def nbytes(self) -> int:
        """Bytes moved."""
        return sum(b * int(n) for b, n in zip(self.table.slot_bytes, self.counts().tolist()))

    @cached_property
    def runs(self) -> int:
        """Rows once consecutive ids (on both sides) merge within each entry: what ``emit`` gives for the part
        unless rows of different entries continue one another (separate regions do not) or a partial tile's
        row continues a whole tile's."""
        head = self.head.tolist()
        out = 0
        fast = native.library() is not None and self.ids.flags.c_contiguous and self.ids.dtype == np.int64
        for (la, ra, n), merging, apart in zip(head, self.table.slot_merging, self.table.slot_apart):
            out += apart * n
            if n > 1 and merging:  # (merging entries: one kernel block per tile, so the remote ids follow the local)
                out += merging * (1 + (native.breaks(self.ids, la, n) if fast else _breaks(self.ids, la, n)))
            elif n and merging:
                out += merging
        return out - self._edge_merges(head)

    def _edge_merges(self, head: list) -> int:
        """Partial tiles' rows that continue their entry's whole-block row (or the head's last rows the tail's
        first, with no whole tile between): each one row with it in ``emit``'s rows."""
        out = 0
        first: dict[int, EdgePiece] = {}
        for p in self.edge_pieces:
            la, ra, n = head[p.slot]
            if p.mask is None:
                continue
            if n:
                k = n - 1 if p.tail else 0  # the whole tile beside it: the last (the tail follows it) or the first
                step = 1 if p.tail else -1
                if p.il == int(self.ids[la + k]) + step and p.ir == int(self.ids[ra + k]) + step:
                    out += int(np.count_nonzero(p.mask))
            elif not p.tail:
                first[p.slot] = p
            elif p.slot in first:  # no whole tile between: the head's last rows, the tail's first
                h = first[p.slot]
                if p.il == h.il + 1 and p.ir == h.ir + 1:
                    out += int(np.count_nonzero(h.mask & p.mask))
        return out

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The rows this form stands for, entry by entry (the partial tiles' entries last), id by id (before any
        coalescing): local and remote ``(N, 2)`` int64 (address, length). The reference the kernels are checked
        against."""
        t, head = self.table, self.head
        local, remote = [], []
        for e in range(t.entries):
            la, ra, n = head[t.slot[e]].tolist()
            k = np.arange(n, dtype=np.int64)
            il = self.ids[la + k * t.local_sub[e] + t.local_block[e]]
            ir = self.ids[ra + k * t.remote_sub[e] + t.remote_block[e]]
            length = np.full(n, t.length[e], np.int64)
            local.append(np.stack([t.local_base[e] + il * t.local_stride[e], length], axis=1))
            remote.append(np.stack([t.remote_base[e] + ir * t.remote_stride[e], length], axis=1))
        empty = np.zeros((0, 2), np.int64)
        return (np.concatenate(local) if local else empty), (np.concatenate(remote) if remote else empty)


def _breaks(ids: np.ndarray, at: int, n: int) -> int:
    """:func:`kvlc.compiler.request.native.breaks` in numpy (the reference): of ``n`` tiles (local ids at ``at``, the
    remote ones after them), those after the first whose local or remote id does not follow the tile before."""
    both = ids[at:at + 2 * n].reshape(2, n)
    return int(np.count_nonzero((both[:, 1:] != both[:, :-1] + 1).any(axis=0)))


def block_tables(bound: BoundProgram) -> dict[PartKey, BlockTable]:
    """The block table of every part (kept in the binding's memo)."""
    return bound.memo.get("block_tables", lambda: _tables(bound))


# a BlockTable's per-entry columns (its fields of that name)
_FIELDS = ("local_base", "local_stride", "remote_base", "remote_stride", "length", "slot", "local_sub",
           "local_block", "remote_sub", "remote_block", "remote_lo", "remote_hi")


def _extents(prog, b) -> np.ndarray:
    """The bytes of each program entry of block ``b``'s region on the peer's side (its rows' reach past the base)."""
    regions = [prog.remote.region(prog.entries[j].remote_region) for j in b.entries]
    return np.array([x.end - x.offset for x in regions], dtype=np.int64)


def _table(key: PartKey, cols: dict, blocks: tuple[int, ...], slots: int) -> BlockTable:
    """A :class:`BlockTable` of the columns ``cols`` (field -> list of int64 arrays, :data:`_FIELDS`), ``slots`` id
    slots (those past the index blocks' are partial tiles': their entries never count as merging across ids)."""
    a = {c: np.ascontiguousarray(np.concatenate(v), dtype=np.int64) for c, v in cols.items()}
    for v in a.values():
        v.setflags(write=False)
    per = np.bincount(a["slot"], weights=a["length"], minlength=slots).astype(np.int64).tolist()
    merging = ((a["local_stride"] == a["length"]) & (a["remote_stride"] == a["length"]) & (a["local_sub"] == 1)
               & (a["remote_sub"] == 1) & (a["local_block"] == 0) & (a["remote_block"] == 0)
               & (a["slot"] < len(blocks)))
    count = lambda m: tuple(np.bincount(a["slot"][m], minlength=slots).tolist())  # noqa: E731
    return BlockTable(key=key, blocks=blocks, slot_bytes=tuple(per), slot_merging=count(merging),
                      slot_apart=count(~merging), **a)


def _tables(bound: BoundProgram) -> dict[PartKey, BlockTable]:
    prog = bound.program
    index = program_index(prog)
    per: dict[PartKey, list[int]] = {}
    for i, b in enumerate(index.blocks):
        per.setdefault(b.key, []).append(i)
    geometries = bound.geometries()
    out = {}
    for key, which in per.items():
        cols: dict[str, list] = {c: [] for c in _FIELDS}
        for s, i in enumerate(which):  # entry-major: each program entry's runs of a tile in order
            b, g = index.blocks[i], geometries[i]
            r, m = b.runs, len(b.runs)
            each = lambda a: np.repeat(np.asarray(a, dtype=np.int64), m)  # noqa: E731  (per entry, every run)
            runs = lambda a: np.tile(a, len(b.entries))  # noqa: E731  (per run, every entry)
            cols["local_base"].append(each(g.base[0, :, 0]) + runs(r.local_offset))
            cols["remote_base"].append(each(g.base[1, :, 0]) + runs(r.remote_offset))
            cols["local_stride"].append(each(g.stride[0, :, 0]))
            cols["remote_stride"].append(each(g.stride[1, :, 0]))
            cols["length"].append(runs(r.length))
            cols["slot"].append(np.full(m * len(b.entries), s, np.int64))
            cols["local_sub"].append(np.full(m * len(b.entries), b.local_sub, np.int64))
            cols["remote_sub"].append(np.full(m * len(b.entries), b.remote_sub, np.int64))
            cols["local_block"].append(runs(r.local_block))
            cols["remote_block"].append(runs(r.remote_block))
            cols["remote_lo"].append(each(g.base[1, :, 0]))  # (the base holds the region's offset in its storage)
            cols["remote_hi"].append(each(g.base[1, :, 0] + _extents(prog, b)))
        out[key] = _table(key, cols, tuple(which), len(which))
    return out


def block_copies(bound: BoundProgram, req: Request, wants: Callable[[PartKey], bool] | None = None
                 ) -> dict[PartKey, BlockCopy]:
    """The block form of each part of a checked request that has one (see the module docstring): parts
    without one, or whose ids move nothing, are left out; so are those ``wants`` says no to."""
    index = program_index(bound.program)
    out = {}
    for key, table in block_tables(bound).items():
        got = _copy(table, bound, index, req) if wants is None or wants(key) else None
        if got is not None:
            out[key] = got
    return out


@dataclass(frozen=True, eq=False)
class _Edge:
    """Tokens ``[lo, hi)`` of one tile of an index block as a table's entries (fixed per binding): one per row of
    the tile for kernel ids 0, each reading its run's kernel block of the tile on each side (:attr:`cols`, slot
    0: a table puts it where its slot is; blocks counted from :attr:`first`). ``first`` / ``need``: the tile's
    kernel blocks whose ids a request gives each side, from the first any entry reads to the last."""

    cols: dict             # _FIELDS -> (N,) int64
    first: tuple[int, int]
    need: tuple[int, int]
    joins: tuple = (None, None)  # whole-block entries whose first row starts / last row ends at the block's edge
    #                               (bool per entry; None: no entry's)


def _edge(bound: BoundProgram, index: ProgramIndex, i: int, lo: int, hi: int) -> _Edge | None:
    """Index block ``i``'s partial tile ``[lo, hi)`` as entries (kept in the binding's memo), None if it moves
    nothing."""
    def make() -> _Edge | None:
        b, g = index.blocks[i], bound.geometries()[i]
        runs = index.tail_runs(b, hi, lo)
        zl, zr = np.zeros(b.local_sub, dtype=np.int64), np.zeros(b.remote_sub, dtype=np.int64)
        piece = tile_rows(runs, 0, 1, b, zl, zr, g)
        if piece is None or not len(piece):
            return None
        lrows, rrows = write_rows(piece)
        k = len(piece)
        n = k * len(b.entries)
        block = np.tile(np.stack((runs.local_block, runs.remote_block)), (1, len(b.entries)))
        first = block.min(axis=1)
        block = block - first[:, None]
        base = g.base[1, :, 0]
        cols = {"local_base": lrows.reshape(-1, 3)[:, 0], "local_stride": np.repeat(g.stride[0, :, 0], k),
                "remote_base": rrows.reshape(-1, 3)[:, 0], "remote_stride": np.repeat(g.stride[1, :, 0], k),
                "length": lrows.reshape(-1, 3)[:, 1], "slot": np.zeros(n, np.int64),
                "local_sub": np.full(n, b.local_sub, np.int64), "local_block": block[0],
                "remote_sub": np.full(n, b.remote_sub, np.int64), "remote_block": block[1],
                "remote_lo": np.repeat(base, k), "remote_hi": np.repeat(base + _extents(bound.program, b), k)}
        cols = {c: np.asarray(v, dtype=np.int64) for c, v in cols.items()}
        return _Edge(cols, (int(first[0]), int(first[1])), (int(block[0].max()) + 1, int(block[1].max()) + 1),
                     _joins(b, g, lrows, rrows))
    return bound.memo.get(("block_edge", i, lo, hi), make)


def _joins(b, g, lrows: np.ndarray, rrows: np.ndarray) -> tuple:
    """Of a block's entries whose tile is one whole block on both sides (what ``emit`` merges across
    consecutive ids), those whose partial tile's first row is at the block's start on both sides (it then
    continues the row of the block before it: a tail) and those whose last row is at the block's end (a
    head); each None where there are none. ``lrows`` / ``rrows``: (E, K, 3) rows for ids 0."""
    r = b.runs
    if not (len(r) == 1 and b.local_sub == b.remote_sub == 1 and not r.local_offset[0] and not r.remote_offset[0]):
        return None, None
    whole = (g.stride[0, :, 0] == r.length[0]) & (g.stride[1, :, 0] == r.length[0])
    base = g.base[:, :, 0]
    first = (lrows[:, 0, 0] == base[0]) & (rrows[:, 0, 0] == base[1])
    last = ((lrows[:, -1, 0] + lrows[:, -1, 1] == base[0] + g.stride[0, :, 0])
            & (rrows[:, -1, 0] + rrows[:, -1, 1] == base[1] + g.stride[1, :, 0]))
    return tuple(m if m.any() else None for m in (whole & first, whole & last))


EDGE_TABLES = 64  # tables with partial tiles a binding keeps (per part and tiles' spans; the oldest goes first)


def _with_edges(bound: BoundProgram, table: BlockTable, edges: tuple) -> BlockTable:
    """``table`` with the entries of partial tiles ``edges`` ((index block, lo, hi) each, in slot order) after
    its own, each in a slot of its own (kept in the binding's memo: an engine's requests end at a few offsets)."""
    lock = bound.memo.get("block_edge_lock", threading.Lock)
    kept: dict = bound.memo.get("block_edge_tables", dict)
    key = (table.key, edges)
    with lock:
        got = kept.get(key)
    if got is not None:
        return got
    index = program_index(bound.program)
    cols = {c: [getattr(table, c)] for c in _FIELDS}
    for n, (i, lo, hi) in enumerate(edges):
        e = _edge(bound, index, i, lo, hi)
        for c in _FIELDS:
            cols[c].append(np.full(len(e.cols["slot"]), table.slots + n, np.int64) if c == "slot" else e.cols[c])
    got = _table(table.key, cols, table.blocks, table.slots + len(edges))
    with lock:
        if len(kept) >= EDGE_TABLES:
            del kept[next(iter(kept))]
        return kept.setdefault(key, got)


def _copy(table: BlockTable, bound: BoundProgram, index: ProgramIndex, req: Request) -> BlockCopy | None:
    """The request's form of one part: the whole tiles' ids per index block's slot, then one slot per partial
    tile (its table: ``table`` with their entries)."""
    slots, edges = [], []
    for slot, i in enumerate(table.blocks):
        b = index.blocks[i]
        ts, shift = block_tiles(b, req)
        slots.append((b, ts, shift))
        for p in ts.partial:
            e = _edge(bound, index, i, p.lo, p.hi)
            if e is not None:
                edges.append((slot, i, p, e, p.tile >= ts.first + ts.count))
    at = HEADER * (len(slots) + len(edges))
    head: list[int] = []
    chunks: list[np.ndarray] = []
    for b, ts, shift in slots:
        at = _whole_tiles(head, chunks, b, ts, shift, req, at)
    pieces = []
    for slot, i, p, e, tail in edges:
        b, _, shift = slots[slot]
        got, at = _partial_tile(head, chunks, b, p.tile, shift, e, req, at)
        mask = e.joins[0 if tail else 1]  # (only where the tile is one block on both sides: its ids are il, ir)
        pieces.append(EdgePiece(slot, tail) if mask is None else EdgePiece(slot, tail, mask, *got))
    most = max(head[2::HEADER], default=0)
    if not most:
        return None
    ids = np.empty(at, dtype=np.int64)
    ids[:len(head)] = head
    pos = len(head)
    for c in chunks:
        ids[pos:pos + len(c)] = c
        pos += len(c)
    if edges:
        table = _with_edges(bound, table, tuple((i, p.lo, p.hi) for _, i, p, _, _ in edges))
    return BlockCopy(table, ids, most, tuple(pieces))


def _whole_tiles(head: list, chunks: list, b, ts, shift: tuple[int, int], req: Request, at: int) -> int:
    """Block ``b``'s slot: its header words into ``head``, the ids of its whole tiles on each side into ``chunks``
    (from the first tile's first kernel block to the last's last run), placed from word ``at``; the next word."""
    n = ts.count if len(b.runs) else 0
    nl = nr = 0
    if n:
        ol, orr = ts.first * b.local_sub - shift[0], ts.first * b.remote_sub - shift[1]
        nl = (n - 1) * b.local_sub + int(b.runs.local_block.max()) + 1
        nr = (n - 1) * b.remote_sub + int(b.runs.remote_block.max()) + 1
        chunks += (req.local[b.group][ol:ol + nl], req.remote[b.group][orr:orr + nr])
    head += (at, at + nl, n)
    return at + nl + nr


def _partial_tile(head: list, chunks: list, b, tile: int, shift: tuple[int, int], e: _Edge, req: Request, at: int
                  ) -> tuple[tuple[int, int], int]:
    """A partial tile's slot (one tile, the ids its entries read from word ``at``): its first ids on each side
    and the next word."""
    kl, kr = req.local[b.group], req.remote[b.group]
    l0, r0 = tile * b.local_sub - shift[0] + e.first[0], tile * b.remote_sub - shift[1] + e.first[1]
    nl, nr = e.need
    cl, cr = kl[l0:l0 + nl], kr[r0:r0 + nr]
    if len(cl) != nl or len(cr) != nr:
        raise IndexError(f"a partial tile reads ids past the request's ({nl}, {nr} from {l0}, {r0})")
    chunks += (cl, cr)
    head += (at, at + nl, 1)
    return (int(cl[0]), int(cr[0])), at + nl + nr


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
