"""Per request, step 2 — descriptors: a program bound to storage addresses, instantiated per request.

:func:`bind` fixes each storage's base address (once per connection);
:meth:`BoundProgram.instantiate` turns a checked request into row-aligned ``(N, 3)``
uint64 descriptors per part, vectorized with numpy (no Python loop per block).
Address of run ``k`` of entry ``e``: ``base + region offset + id * block stride + run offset``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

from kvlc.compiler.frozen import FrozenMap
from kvlc.compiler.request.index import Block
from kvlc.compiler.pairing.program import Memo, Part, PartKey, TransferProgram
from kvlc.compiler.request.check import Request
from kvlc.compiler.request.rows import Geometry, RowPiece, Side, coalesce, write_rows
from kvlc.compiler.pairing.runs import Runs
from kvlc.compiler.request.tokens import TileSpan, tile_spans
from kvlc.errors import TransferError

if TYPE_CHECKING:
    from kvlc.compiler.request.prepared import PreparedLists, PreparedRequest

ADDRESS_LIMIT = 1 << 63  # addresses are computed in int64: base + storage size must stay below


@dataclass(frozen=True, eq=False)
class Bases:
    """One side's storages, in plan order: base address and device of each (int64 arrays)."""

    addr: np.ndarray
    device: np.ndarray


def _address(v, name: str, plan) -> tuple[int, int | None]:
    """``addr`` or ``(addr, device)`` as integers (bool, float, str refused)."""
    if type(v) is int:  # the common cases first: plain ints need no further checks
        return v, None
    if type(v) is tuple and len(v) == 2 and type(v[0]) is int and type(v[1]) is int:
        return v
    addr, dev = (v[0], v[1]) if isinstance(v, (tuple, list)) and len(v) == 2 else (v, None)
    for what, x in (("address", addr), ("device", dev)):
        if x is not None and (isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer))):
            raise TransferError(f"storage '{name}' of plan '{plan.name}': base {what} must be an integer, "
                                f"found {x!r}")
    return int(addr), None if dev is None else int(dev)


def bases_of(bases: Mapping[str, object], plan) -> Bases:
    """Base address (and device) of every storage of ``plan``, from ``name -> addr | (addr, device)``.

    Every storage must lie in ``[0, 2**63)`` from its base: addresses are int64 and must not wrap.
    """
    addrs, devs = [], []
    for s in plan.storages:
        v = bases.get(s.name)
        if v is None:
            raise TransferError(f"no base address for storage '{s.name}' of plan '{plan.name}'")
        a, d = _address(v, s.name, plan)
        if not 0 <= a < ADDRESS_LIMIT:
            _wraps(plan, s, a)
        addrs.append(a)
        devs.append(s.device if d is None else d)
    addr = np.array(addrs, dtype=np.int64)
    dev = np.array(devs, dtype=np.int64)
    room = ADDRESS_LIMIT - np.array([s.size for s in plan.storages], dtype=np.uint64)  # sizes < 2**63 (checked)
    over = np.flatnonzero(addr.view(np.uint64) > room)
    if len(over):
        _wraps(plan, plan.storages[int(over[0])], int(addr[over[0]]))
    return Bases(addr, dev)


def _wraps(plan, s, addr: int) -> None:
    raise TransferError(f"storage '{s.name}' of plan '{plan.name}': base address {addr:#x} + size {s.size:,} "
                        "leaves [0, 2**63); addresses would wrap")


def bind(prog: TransferProgram, local_bases: Mapping[str, object],
         remote_bases: Mapping[int, Mapping[str, object]]) -> "BoundProgram":
    """Fix storage base addresses once (per connection); then instantiate per request.

    Bases map storage name → address or (address, device); remote bases are per peer rank.

    >>> from kvlc import compile_spec, pair
    >>> plan = compile_spec("layouts/llama-3.1-8b.yaml")
    >>> prog = pair(plan, plan, local_rank=0, direction="READ")
    >>> bound = bind(prog, {s.name: 1 << 40 for s in plan.storages}, {0: {s.name: 2 << 40 for s in plan.storages}})
    >>> parts = bound.instantiate({"full": [3, 4]}, {"full": [7, 8]}, 32)   # two consecutive blocks each side
    >>> [(str(k), len(p), p.nbytes) for k, p in parts.items()]
    [('peer0:VRAM->VRAM', 32, 4194304)]
    """
    local = bases_of(local_bases, prog.local)
    remote = {}
    for peer in prog.peer_ranks:
        if peer not in remote_bases:
            raise TransferError(f"no remote bases for peer rank {peer} "
                                f"(the program reads from ranks {list(prog.peer_ranks)})")
        remote[peer] = bases_of(remote_bases[peer], prog.remote)
    return BoundProgram(prog, local, FrozenMap(remote))


@dataclass(frozen=True, eq=False)
class _Job:
    key: PartKey
    entries: int
    pieces: list[RowPiece]
    rows: int


_SMALL = 128  # ids (rows) up to this many: tested in Python, whose per-call cost is below numpy's there


def _segments(kl: np.ndarray, kr: np.ndarray, full: int) -> tuple[np.ndarray, np.ndarray]:
    """Runs of consecutive ids on both sides among the first ``full`` ids: each side's starts (2, K), lengths."""
    if full <= _SMALL:
        return _segments_small(kl, kr, full)
    cont = (kl[1:full] == kl[:full - 1] + 1) & (kr[1:full] == kr[:full - 1] + 1)
    if cont.all():  # the common case, contiguous ids on both sides: one run
        return np.array([[kl[0]], [kr[0]]], dtype=np.int64), np.array([full], dtype=np.int64)
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    lens = np.diff(np.append(starts, full))
    return np.stack((kl[starts], kr[starts])), lens


def _segments_small(kl: np.ndarray, kr: np.ndarray, full: int) -> tuple[np.ndarray, np.ndarray]:
    a, b = kl[:full].tolist(), kr[:full].tolist()
    if a == list(range(a[0], a[0] + full)) and b == list(range(b[0], b[0] + full)):  # one run (the common case)
        return np.array([[a[0]], [b[0]]], dtype=np.int64), np.array([full], dtype=np.int64)
    starts = [0] + [i for i in range(1, full) if a[i] != a[i - 1] + 1 or b[i] != b[i - 1] + 1]
    lens = [j - i for i, j in zip(starts, starts[1:] + [full])]
    return np.array([[a[i] for i in starts], [b[i] for i in starts]], dtype=np.int64), np.array(lens, dtype=np.int64)


def block_tiles(b: Block, req: Request) -> tuple[TileSpan, tuple[int, int]]:
    """The tiles a request moves in block ``b``'s group, and each side's first kernel block number.

    Tile ``t`` run ``k`` reads local id ``ids[t * local_sub + run block - first]`` (same remote).
    State: one whole "tile" per state block, from 0.
    """
    if not b.tile_tokens:
        return TileSpan(0, len(req.local[b.group]), ()), (0, 0)
    gs = req.spans[b.group]
    return tile_spans(gs.span, b.tile_tokens), (gs.local_first, gs.remote_first)


@dataclass(frozen=True, eq=False)
class BoundProgram:
    """A program with storage bases fixed: the per-request hot path."""

    program: TransferProgram
    local: Bases
    remote: FrozenMap[int, Bases]
    memo: Memo = field(default_factory=Memo, init=False, repr=False)

    def instantiate(self, local_block_ids: Mapping[str, Sequence[int]],
                    remote_block_ids: Mapping[str, Sequence[int]],
                    num_tokens: int | Mapping[str, int] | None = None, *, tokens=None,
                    coalesce: str = "order") -> dict[PartKey, Part]:
        """Descriptors of one request, per part.

        ``num_tokens=N`` moves tokens ``[0, N)``, ``tokens=(start, stop)`` moves ``[start, stop)``
        (ids: the blocks the range touches on each side; see :mod:`kvlc.compiler.request.check`).
        ``coalesce="order"`` (the hot path, O(N)): within each region and group the
        descriptors are the coalesced minimum; across regions and groups rows merge
        where they continue in request order. ``coalesce="sort"`` sorts each part by
        address first and reaches the minimum for the whole part, at O(N log N).
        """
        req = self.program.check_request(local_block_ids, remote_block_ids, num_tokens, tokens=tokens)
        return self.emit(req, coalesce=coalesce)

    # ------------------------------------------------------------------ building blocks
    def sides(self, b: Block) -> Geometry:
        """Both sides' operands of a block's entries (stride, base, device), stacked."""
        rb = self.remote[b.key.peer_rank]
        lg, rg = b.local, b.remote
        return Geometry.of(Side(lg.stride, self.local.addr[lg.storage] + lg.offset, self.local.device[lg.storage]),
                           Side(rg.stride, rb.addr[rg.storage] + rg.offset, rb.device[rg.storage]))

    def geometries(self) -> list[Geometry]:
        """:meth:`sides` of every block of the program, in order (fixed per binding: made once)."""
        return self.memo.get("sides", lambda: [self.sides(b) for b in self.program.index.blocks])

    def tiles(self, runs: Runs, first: int, count: int, b: Block, kl, kr, geometry: Geometry,
              shift: tuple[int, int] = (0, 0)) -> RowPiece | None:
        """Rows of ``count`` tiles from tile ``first`` with these runs (None without runs).

        ``shift``: kernel block number of ``kl[0]`` and ``kr[0]`` (:func:`block_tiles`).
        """
        if not len(runs):
            return None
        t = np.arange(first, first + count, dtype=np.int64)[:, None]
        il = kl[t * b.local_sub + runs.local_block[None, :] - shift[0]].ravel()          # (F*M,) kernel ids
        ir = kr[t * b.remote_sub + runs.remote_block[None, :] - shift[1]].ravel()
        offset = np.tile(np.stack((runs.local_offset, runs.remote_offset)), (1, count))
        return RowPiece(geometry, np.stack((il, ir)), offset, np.tile(runs.length, count))

    def _block_pieces(self, b: Block, req: Request, segments: dict, geometry: Geometry) -> list[RowPiece]:
        kl, kr = req.local[b.group], req.remote[b.group]
        ts, shift = block_tiles(b, req)
        partial = [self.tiles(self.program.index.tail_runs(b, p.hi, p.lo), p.tile, 1, b, kl, kr, geometry, shift)
                   for p in ts.partial]
        head = 1 if ts.partial and ts.partial[0].tile < ts.first else 0
        pieces = partial[:head]                       # in token order: head, whole tiles, tail
        if ts.count and b.whole:   # whole, contiguous blocks: tile = kernel block on both sides
            if b.group not in segments:
                ol, orr = ts.first - shift[0], ts.first - shift[1]
                segments[b.group] = _segments(kl[ol:ol + ts.count], kr[orr:orr + ts.count], ts.count)
            ids, lens = segments[b.group]
            pieces.append(RowPiece(geometry, ids, None, lens * int(b.runs.length[0])))
        elif ts.count:
            pieces.append(self.tiles(b.runs, ts.first, ts.count, b, kl, kr, geometry, shift))
        pieces.extend(partial[head:])
        return [p for p in pieces if p is not None and len(p)]

    def emit(self, req: Request, coalesce: str = "order") -> dict[PartKey, Part]:
        """Descriptors of a checked request (:meth:`TransferProgram.check_request`), per part."""
        if coalesce not in ("order", "sort"):
            raise ValueError(f"coalesce must be 'order' or 'sort', got {coalesce!r}")
        # Pass 1: per block, its row pieces (no rows yet) and the rows per part. Pass 2 writes
        # every piece straight into one (N, 3) array per side and part: no intermediate arrays,
        # no concatenation (fresh memory is what costs most here).
        jobs, sizes, segments = [], {}, {}
        for b, geometry in zip(self.program.index.blocks, self.geometries()):
            pieces = self._block_pieces(b, req, segments, geometry)
            if pieces:
                rows = len(b.entries) * sum(len(p) for p in pieces)
                jobs.append(_Job(b.key, len(b.entries), pieces, rows))
                sizes[b.key] = sizes.get(b.key, 0) + rows
        return _finish(_write(jobs, sizes), coalesce)

    # ------------------------------------------------------------------ prepared (strided) lists
    def prepared_rows(self) -> dict[PartKey, "PreparedLists"]:
        """Strided descriptor lists per part (see :func:`kvlc.compiler.request.prepared.prepared_rows`). Cached."""
        from kvlc.compiler.request.prepared import prepared_rows
        return self.memo.get("prepared_rows", lambda: prepared_rows(self))

    def prepared_indices(self, local_block_ids: Mapping[str, Sequence[int]],
                         remote_block_ids: Mapping[str, Sequence[int]],
                         num_tokens: int | Mapping[str, int] | None = None, *, tokens=None) -> "PreparedRequest":
        """One request against :meth:`prepared_rows` (see :func:`kvlc.compiler.request.prepared.prepared_indices`)."""
        from kvlc.compiler.request.prepared import prepared_indices
        req = self.program.check_request(local_block_ids, remote_block_ids, num_tokens, tokens=tokens)
        return prepared_indices(self, req)


def _write(jobs: list[_Job], sizes: dict[PartKey, int]) -> dict[PartKey, tuple[np.ndarray, np.ndarray]]:
    # Every part, both sides, in ONE allocation (parts are views of it): fresh memory is
    # what costs most here, and the allocator reuses one block across requests far more
    # often than several (measured: benchmarks/README.md, "Pairing & instantiation").
    whole = np.empty((2, sum(sizes.values()), 3), dtype=np.int64)
    bufs, at = {}, 0
    for key, n in sizes.items():
        bufs[key] = whole[:, at:at + n]
        at += n
    pos = dict.fromkeys(sizes, 0)
    for job in jobs:
        p0 = pos[job.key]
        pos[job.key] = p0 + job.rows
        both = bufs[job.key][:, p0:p0 + job.rows].reshape(2, job.entries, job.rows // job.entries, 3)  # a view
        k0 = 0
        for piece in job.pieces:
            k = len(piece)
            write_rows(piece, out=both[:, :, k0:k0 + k])
            k0 += k
    return {key: (buf[0], buf[1]) for key, buf in bufs.items()}


def _finish(bufs, how: str) -> dict[PartKey, Part]:
    out = {}
    for key, (local, remote) in bufs.items():
        if how == "sort" and len(local) > 1:
            order = np.lexsort((local[:, 0], local[:, 2]))
            local, remote = local[order], remote[order]
        local, remote = coalesce(local.view(np.uint64), remote.view(np.uint64))
        out[key] = Part(local, remote)
    return out
