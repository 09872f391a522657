"""Per request, step 3 — descriptors: a bound program and a request's block ids → (N, 3) rows per part.

:func:`instantiate` checks a request (:func:`kvlc.compiler.request.check.check_request`) and
:func:`emit` turns the checked request into row-aligned ``(N, 3)`` uint64 descriptors per part,
vectorized with numpy (no Python loop per block). Address of run ``k`` of entry ``e``:
``base + region offset + id * block stride + run offset``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from kvlc.compiler.pairing.program import Part, PartKey
from kvlc.compiler.request import native
from kvlc.compiler.request.bind import BoundProgram
from kvlc.compiler.request.blocks import block_copies, block_parts, block_tables
from kvlc.compiler.request.check import Request, block_tiles, check_request
from kvlc.compiler.request.index import Block, ProgramIndex, program_index
from kvlc.compiler.request.native_rows import emit_native, native_table
from kvlc.compiler.request.rows import Geometry, RowPiece, coalesce, write_rows
from kvlc.compiler.request.tiles import tile_rows


def instantiate(bound: BoundProgram, local_block_ids: Mapping[str, Sequence[int]],
                remote_block_ids: Mapping[str, Sequence[int]],
                num_tokens: int | Mapping[str, int] | None = None, *, tokens=None,
                coalesce: str = "order", blocks: bool | Callable[[PartKey], bool] = False) -> dict[PartKey, Part]:
    """Descriptors of one request, per part: :func:`check_request` then :func:`emit` (``blocks``: as there).

    Block ids are logical, per group name; ``num_tokens=N`` (a count) moves tokens ``[0, N)``,
    ``tokens=(start, stop)`` moves ``[start, stop)`` (ids: the blocks the range touches on each
    side; see :mod:`kvlc.compiler.request.check`). Every id is checked against every region's
    capacity before any descriptor is built. ``coalesce="order"`` (the hot path, O(N)): within
    each region and group the descriptors are the coalesced minimum; across regions and groups
    rows merge where they continue in request order. ``coalesce="sort"`` sorts each part by
    address first and reaches the minimum for the whole part, at O(N log N).

    >>> from kvlc import bind, compile_spec, pair
    >>> plan = compile_spec("layouts/llama-3.1-8b.yaml")
    >>> prog = pair(plan, plan, local_rank=0, direction="READ")
    >>> bound = bind(prog, {s.name: 1 << 40 for s in plan.storages}, {0: {s.name: 2 << 40 for s in plan.storages}})
    >>> parts = instantiate(bound, {"full": [3, 4]}, {"full": [7, 8]}, 32)   # two consecutive blocks a side
    >>> [(str(k), len(p), p.nbytes) for k, p in parts.items()]
    [('peer0:VRAM->VRAM', 32, 4194304)]
    """
    req = check_request(bound.program, local_block_ids, remote_block_ids, num_tokens, tokens=tokens)
    return emit(bound, req, coalesce=coalesce, blocks=blocks)


def prepare_bound(bound: BoundProgram, blocks: bool = False) -> BoundProgram:
    """Build now (a runtime calls it when a connection binds) what every request of ``bound`` uses, not in its first
    request: the rows' C library loaded and the packed table its rows are written from (the ids' reader is loaded
    when the program is paired: :func:`~kvlc.compiler.request.rules.prepare`), and with
    ``blocks`` the block table of every part (where a same-host GPU copies parts by their block ids). On this
    project's VM the first request of DeepSeek-V3.2 with its latent in host memory did ~3.0 ms of host work before
    its copy without this, 0.37 ms with it (later requests: 0.36). Returns ``bound``.

    >>> from kvlc import bind, compile_spec, pair
    >>> plan = compile_spec("layouts/llama-3.1-8b.yaml")
    >>> bound = bind(pair(plan, plan, local_rank=0), {s.name: 1 << 40 for s in plan.storages},
    ...              {0: {s.name: 2 << 40 for s in plan.storages}})
    >>> prepare_bound(bound).memo.get("native_table", lambda: None) is not None or native.library() is None
    True
    """
    if native.library() is not None:
        native_table(bound).address()  # (packs it)
    if blocks:
        block_tables(bound)
    return bound


def emit(bound: BoundProgram, req: Request, coalesce: str = "order", *,
         blocks: bool | Callable[[PartKey], bool] = False) -> dict[PartKey, Part]:
    """Descriptors of a checked request (:func:`check_request`), per part (see :func:`instantiate`).

    ``blocks``: each part that has a block form (:mod:`kvlc.compiler.request.blocks`) carries it as well
    (:attr:`Part.blocks`), for a same-host copy kernel; where every part has one, the parts are
    :class:`~kvlc.compiler.request.blocks.BlockPart` s, whose rows are built only when first asked for. A
    callable: only the parts it says yes to (by key) get a form."""
    if coalesce not in ("order", "sort"):
        raise ValueError(f"coalesce must be 'order' or 'sort', got {coalesce!r}")
    forms = block_copies(bound, req, None if blocks is True else blocks) if blocks else {}
    lazy = block_parts(bound, req, forms, lambda: emit(bound, req, coalesce)) if forms else None
    if lazy is not None:
        return lazy  # type: ignore[return-value]  (parts whose rows come when asked for)
    if coalesce == "order" and native.library() is not None:
        return emit_native(bound, req, forms)
    # Pass 1: per block, its row pieces (no rows yet) and the rows per part. Pass 2 writes
    # every piece straight into one (N, 3) array per side and part: no intermediate arrays,
    # no concatenation (fresh memory is what costs most here).
    jobs, sizes, segments = [], {}, {}
    index = program_index(bound.program)
    for b, geometry in zip(index.blocks, bound.geometries()):
        pieces = _block_pieces(index, b, req, segments, geometry)
        if pieces:
            rows = len(b.entries) * sum(len(p) for p in pieces)
            jobs.append(_Job(b.key, len(b.entries), pieces, rows))
            sizes[b.key] = sizes.get(b.key, 0) + rows
    return _finish(_write(jobs, sizes), coalesce, forms)


def _block_pieces(index: ProgramIndex, b: Block, req: Request, segments: dict, geometry: Geometry
                  ) -> list[RowPiece]:
    """Row pieces of one block of a request in token order: partial first tile, whole tiles, partial last."""
    kl, kr = req.local[b.group], req.remote[b.group]
    ts, shift = block_tiles(b, req)
    partial = [tile_rows(index.tail_runs(b, p.hi, p.lo), p.tile, 1, b, kl, kr, geometry, shift)
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
        pieces.append(tile_rows(b.runs, ts.first, ts.count, b, kl, kr, geometry, shift))
    pieces.extend(partial[head:])
    return [p for p in pieces if p is not None and len(p)]


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


def _finish(bufs, how: str, forms: dict) -> dict[PartKey, Part]:
    out = {}
    for key, (local, remote) in bufs.items():
        if how == "sort" and len(local) > 1:
            order = np.lexsort((local[:, 0], local[:, 2]))
            local, remote = local[order], remote[order]
        local, remote = coalesce(local.view(np.uint64), remote.view(np.uint64))
        out[key] = Part(local, remote, forms.get(key))
    return out
