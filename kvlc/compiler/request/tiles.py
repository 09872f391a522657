"""Rows of tiles: ``count`` tiles of a block from its runs (:func:`tile_rows`), and the rows of the partial
tiles a request's token range cuts at its ends (:func:`partial_rows`), which the whole-tile forms of
:mod:`~kvlc.compiler.request.prepared` and :mod:`~kvlc.compiler.request.blocks` leave to rows."""

from __future__ import annotations

import numpy as np

from kvlc.compiler.pairing.runs import Runs
from kvlc.compiler.request.check import Request, block_tiles
from kvlc.compiler.request.index import Block, ProgramIndex
from kvlc.compiler.request.rows import Geometry, RowPiece, write_rows


def tile_rows(runs: Runs, first: int, count: int, b: Block, kl, kr, geometry: Geometry,
              shift: tuple[int, int] = (0, 0)) -> RowPiece | None:
    """Rows of ``count`` tiles of block ``b`` from tile ``first`` with these runs (None without runs).

    ``shift``: kernel block number of ``kl[0]`` and ``kr[0]`` (:func:`~kvlc.compiler.request.check.block_tiles`).
    """
    if not len(runs):
        return None
    t = np.arange(first, first + count, dtype=np.int64)[:, None]
    il = kl[t * b.local_sub + runs.local_block[None, :] - shift[0]].ravel()          # (F*M,) kernel ids
    ir = kr[t * b.remote_sub + runs.remote_block[None, :] - shift[1]].ravel()
    offset = np.tile(np.stack((runs.local_offset, runs.remote_offset)), (1, count))
    return RowPiece(geometry, np.stack((il, ir)), offset, np.tile(runs.length, count))


def partial_rows(index: ProgramIndex, b: Block, req: Request, geometry: Geometry
                 ) -> list[tuple[np.ndarray, np.ndarray]]:
    """The rows of the partial tiles of block ``b`` that ``req`` moves (its first and last, in token order): per
    tile, each side's ``(E * K, 3)`` int64 rows (not coalesced)."""
    ts, shift = block_tiles(b, req)
    kl, kr = req.local[b.group], req.remote[b.group]
    out = []
    for p in ts.partial:
        piece = tile_rows(index.tail_runs(b, p.hi, p.lo), p.tile, 1, b, kl, kr, geometry, shift)
        if piece is not None and len(piece):
            lrows, rrows = write_rows(piece)
            out.append((lrows.reshape(-1, 3), rrows.reshape(-1, 3)))
    return out
