"""Per request, step 3 in C — the rows of :func:`~kvlc.compiler.request.instantiate.emit` in one native call.

At bind time each block's geometry (base, stride, device of both sides) and run template are
packed into one int64 table (:class:`NativeTable`, kept in the binding's memo); per request the
Python side only decides, per block, which tiles move with which runs (O(blocks), no loop over
ids) and writes one small int64 record per piece; ``rows.c`` then fills every row of every part
and coalesces each part in place. Same rows, same order, same coalescing as the reference
(:func:`~kvlc.compiler.request.instantiate.emit` with the library off; tests/test_native.py).
"""

from __future__ import annotations

import threading

from dataclasses import dataclass, field

import numpy as np

from kvlc.compiler.pairing.program import Part, PartKey
from kvlc.compiler.pairing.runs import Runs
from kvlc.compiler.request import native
from kvlc.compiler.request.bind import BoundProgram
from kvlc.compiler.request.check import Request, block_tiles
from kvlc.compiler.request.index import Block, ProgramIndex, program_index


def _runs_words(runs: Runs) -> list[int]:
    return [len(runs), *runs.local_block.tolist(), *runs.remote_block.tolist(), *runs.local_offset.tolist(),
            *runs.remote_offset.tolist(), *runs.length.tolist()]


@dataclass(frozen=True)
class Slot:
    """Where one block's operands lie in the packed table: its geometry, and its whole-tile runs."""

    geometry: int
    runs: int


@dataclass(eq=False)
class NativeTable:
    """The packed geometry and runs of a binding's blocks (rows.c's table), grown by clipped tiles' runs."""

    index: ProgramIndex
    words: list[int]
    slots: tuple[Slot, ...]                     # aligned with index.blocks
    tails: dict = field(default_factory=dict)   # (block, hi, lo) -> offset of its clipped runs
    shapes: dict = field(default_factory=dict)  # request shape -> its Layout (see _layout)
    array: np.ndarray | None = None
    _address: int = 0
    # held from a request's first tail lookup to the end of its native call: another thread's request
    # may add tails (packing the table again, freeing the array the first one's call would read)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def of(cls, bound: BoundProgram) -> "NativeTable":
        index = program_index(bound.program)
        words: list[int] = []
        slots = []
        for b, g in zip(index.blocks, bound.geometries()):
            geometry = len(words)
            words.append(len(b.entries))
            for arr in (g.base, g.stride, g.device):
                words.extend(arr.reshape(-1).tolist())      # (2, E, 1): local E values, then remote E
            slots.append(Slot(geometry, len(words)))
            words.extend(_runs_words(b.runs))
        return cls(index, words, tuple(slots))

    def tail(self, i: int, b: Block, hi: int, lo: int) -> tuple[int, int]:
        """Offset and run count of block ``i``'s runs for tokens [lo, hi) of a tile (packed on first use)."""
        key = (i, hi, lo)
        got = self.tails.get(key)
        if got is None:
            runs = self.index.tail_runs(b, hi, lo)
            got = self.tails[key] = (len(self.words), len(runs))
            self.words.extend(_runs_words(runs))
            self.array = None
        return got

    def address(self) -> int:
        """The packed table's address (packed again after clipped runs were added)."""
        if self.array is None:
            self.array = np.array(self.words, dtype=np.int64)
            self._address = native.address(self.array)
        return self._address


def native_table(bound: BoundProgram) -> NativeTable:
    return bound.memo.get("native_table", lambda: NativeTable.of(bound))


def _id_slots(req: Request) -> tuple[int, dict[str, tuple[int, int, int, int]]]:
    """Where each group's kernel ids go in a request's id area: (local at, n, remote at, n), and the total."""
    where, at = {}, 0
    for g, kl in req.local.items():
        n, m = len(kl), len(req.remote[g])
        where[g] = (at, n, at + n, m)
        at += n + m
    return at, where


def emit_native(bound: BoundProgram, req: Request, forms: dict | None = None) -> dict[PartKey, Part]:
    """:func:`~kvlc.compiler.request.instantiate.emit` with ``coalesce="order"``, computed by rows.c.

    One int64 buffer per request holds, in order, room for the rows of every part (both sides,
    before coalescing), the piece records, the parts' (start, rows) pairs and the ids; the parts
    returned are views of it. ``forms``: block forms of parts (:mod:`~kvlc.compiler.request.blocks`) they carry.
    """
    table = native_table(bound)
    with table.lock:
        return _emit(table, req, forms or {})


@dataclass(frozen=True, eq=False)
class Layout:
    """Everything of one request's native call that does not depend on its id values: the piece records,
    the parts (number, rows before coalescing), where each group's ids go. Requests of one shape (the
    same token spans and id counts: an engine's repeated lengths) share it (:attr:`NativeTable.shapes`)."""

    records: np.ndarray                 # int64, the piece records
    number: dict                        # part key -> its number
    keys: tuple                         # the parts that get rows, in order
    rows: int                           # rows of every part before coalescing
    starts: np.ndarray                  # int64 (start, 0) per part
    where: dict                         # group -> (local at, n, remote at, n) in the id area
    nids: int
    nbytes: dict = field(default_factory=dict)  # part key -> its bytes (the same for every request of a shape)


SHAPES = 256  # request shapes a table remembers (the oldest goes first)


def _shape(req: Request) -> tuple:
    """What a request's :class:`Layout` depends on: its token spans and the number of ids per group."""
    return (tuple(req.spans.items()),
            tuple((g, len(kl), len(req.remote[g])) for g, kl in req.local.items()))


def _layout(table: NativeTable, req: Request) -> Layout:
    key = _shape(req)
    got = table.shapes.get(key)
    if got is None:
        got = _plan_layout(table, req)
        if len(table.shapes) >= SHAPES:
            del table.shapes[next(iter(table.shapes))]
        table.shapes[key] = got
    return got


def _plan_layout(table: NativeTable, req: Request) -> Layout:
    nids, where = _id_slots(req)
    records: list[int] = []
    rows: dict[PartKey, int] = {}   # part -> rows before coalescing (room to leave for it)
    number = {}
    for i, b in enumerate(table.index.blocks):
        part = number.setdefault(b.key, len(number))
        width = _pieces(records, table, i, b, req, where[b.group], part)
        if width:
            rows[b.key] = rows.get(b.key, 0) + width * len(b.entries)
    starts, at = [], 0
    for k in number:
        starts += (at, 0)
        at += rows.get(k, 0)
    return Layout(np.array(records, dtype=np.int64), number, tuple(k for k in number if rows.get(k)),
                  sum(rows.values()), np.array(starts, dtype=np.int64), where, nids)


def _emit(table: NativeTable, req: Request, forms: dict) -> dict[PartKey, Part]:
    lay = _layout(table, req)
    n = lay.rows
    o = 6 * n
    p0 = o + len(lay.records)
    i0 = p0 + 2 * len(lay.number)
    buf = np.empty(i0 + lay.nids, dtype=np.int64)
    buf[o:p0] = lay.records
    buf[p0:i0] = lay.starts
    for g, (la, ln, ra, rn) in lay.where.items():
        buf[i0 + la:i0 + la + ln] = req.local[g]
        buf[i0 + ra:i0 + ra + rn] = req.remote[g]
    base = native.address(buf)
    native.emit(table.address(), base, n, base + 8 * o, len(lay.records) // native.PIECE, base + 8 * i0,
                base + 8 * p0, len(lay.number))
    left = buf[p0:i0].tolist()
    view = buf[:o].view(np.uint64).reshape(2, n, 3)
    out = {}
    for k in lay.keys:
        j = 2 * lay.number[k]
        s, m = left[j], left[j + 1]
        part = out[k] = Part(view[0, s:s + m], view[1, s:s + m], forms.get(k))
        known = lay.nbytes.get(k)
        if known is None:
            lay.nbytes[k] = part.nbytes
        else:  # a shape's bytes do not depend on its ids: Part.nbytes (a cached property) given, not summed
            part.__dict__["nbytes"] = known
    return out


def _pieces(records: list[int], table: NativeTable, i: int, b: Block, req: Request,
            at: tuple[int, int, int, int], part: int) -> int:
    """Append block ``i``'s piece records in token order (partial head, whole tiles, partial tail); its
    rows per entry."""
    ts, shift = block_tiles(b, req)
    common = (b.local_sub, b.remote_sub, shift[0], shift[1], *at, part, i)
    head = 1 if ts.partial and ts.partial[0].tile < ts.first else 0
    spans = [(table.tail(i, b, p.hi, p.lo), p.tile, 1) for p in ts.partial]
    if ts.count:
        spans.insert(head, ((table.slots[i].runs, len(b.runs)), ts.first, ts.count))
    width = 0
    for (runs_at, m), first, count in spans:
        if m and count:
            records += (table.slots[i].geometry, runs_at, first, count, *common)
            width += m * count
    return width
