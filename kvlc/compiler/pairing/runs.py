"""Pairing, step 2 — run templates: one tile of a region pair as minimal contiguous copies.

Within a tile of ``lcm(local block tokens, remote block tokens)`` tokens, each
(field, head slice, token chunk of ``gcd(tokens)``) is a strided copy;
:mod:`kvlc.compiler.algebra.copies` turns it into runs contiguous on both sides, merged
to the minimum. A run says: copy ``length`` bytes from (local sub-block, offset)
to (remote sub-block, offset).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvlc.compiler.algebra.copies import merge_runs, strided_runs
from kvlc.compiler.algebra.sharding import ShardPair, dcp_chunks, dcp_tile
from kvlc.compiler.algebra.layout import ceildiv, tile
from kvlc.compiler.plan.model import PlanField, PlanRegion


def _frozen(a) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.int64)
    a.setflags(write=False)
    return a


@dataclass(frozen=True, eq=False)
class Runs:
    """Run templates of one tile (read-only int64 arrays of equal length).

    ``local_block`` / ``remote_block``: sub-block of the tile on each side; ``local_offset`` /
    ``remote_offset``: byte offset in that block; ``length``: bytes.
    """

    local_block: np.ndarray
    local_offset: np.ndarray
    remote_block: np.ndarray
    remote_offset: np.ndarray
    length: np.ndarray

    def __post_init__(self) -> None:
        for name in ("local_block", "local_offset", "remote_block", "remote_offset", "length"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))

    @classmethod
    def empty(cls) -> "Runs":
        e = np.zeros(0, dtype=np.int64)
        return cls(e, e, e, e, e)

    def __len__(self) -> int:
        return len(self.length)

    def key(self) -> tuple:
        """Hashable value of the runs (for grouping entries whose templates are identical)."""
        return tuple(tuple(a.tolist()) for a in (self.local_block, self.local_offset, self.remote_block,
                                                 self.remote_offset, self.length))

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    def text(self) -> str:
        """``kl+ol>kr+or x n`` per run, space-separated."""
        return " ".join(f"{kl}+{ol}>{kr}+{o}x{n}" for kl, ol, kr, o, n in zip(
            self.local_block.tolist(), self.local_offset.tolist(), self.remote_block.tolist(),
            self.remote_offset.tolist(), self.length.tolist()))


@dataclass(frozen=True)
class Piece:
    """One field's head slice ``[h0, h1)`` and the first head each side's rank holds (0s: replicated)."""

    field: str
    h0: int
    h1: int
    local_head0: int
    remote_head0: int


@dataclass(frozen=True)
class Chunk:
    """A token chunk that stays inside one block on each side: block index and token in it, length."""

    local_block: int
    local_token: int
    remote_block: int
    remote_token: int
    tokens: int


WHOLE = Chunk(0, 0, 0, 0, 0)  # a field without a token dim: once per tile, from token 0


def field_copy_runs(lf: PlanField, rf: PlanField, piece: Piece, chunk: Chunk) -> tuple[np.ndarray, np.ndarray, int]:
    """Runs copying one head slice and one token chunk of a field from the local to the remote layout.

    Returns local offsets, remote offsets and the common run length (bytes).
    """
    rdims = {d.name: d for d in rf.dims}
    dims = []
    off_l, off_r = lf.offset, rf.offset
    for d in lf.dims:
        e = rdims[d.name]
        if d.role == "head":
            size = piece.h1 - piece.h0
            off_l += (piece.h0 - piece.local_head0) * d.stride
            off_r += (piece.h0 - piece.remote_head0) * e.stride
        elif d.role == "token":
            size = chunk.tokens
            off_l += chunk.local_token * d.stride
            off_r += chunk.remote_token * e.stride
        else:
            size = d.size
        dims.append((size, d.stride, e.stride))
    return strided_runs(dims, off_l, off_r, lf.itemsize)


def chunks(lr: PlanRegion, rr: PlanRegion, tokens: int | None = None, start: int = 0,
           shards: ShardPair | None = None) -> list[Chunk]:
    """Token chunks of one tile (``[start, tokens)``: clip a partial tile; state: one whole chunk).

    Chunks count token-dim entries: a compressed cache (``tokens_per_entry`` k, the same on both
    sides) tiles its entries, and tokens ``[start, tokens)`` of a tile are entries
    ``[start // k, ceil(tokens / k))``: every entry holding one of them moves whole.

    ``shards``: decode context parallelism on either side; the tile is then in global tokens
    and the chunks cover the tokens both ranks hold (:func:`kvlc.compiler.algebra.sharding.dcp_chunks`;
    compressed caches under DCP are refused at pairing).

    >>> from kvlc import compile_spec
    >>> a = compile_spec("layouts/gemma-3-27b-tp2-b16.yaml").regions[0]
    >>> b = compile_spec("layouts/gemma-3-27b-tp2-b32.yaml").regions[0]
    >>> [(c.local_block, c.tokens) for c in chunks(a, b)]
    [(0, 16), (1, 16)]
    """
    t = tile(lr.block_entries, rr.block_entries)
    if t.is_state:
        return [WHOLE]
    if shards is not None:
        span = dcp_tile(lr.block_tokens, shards.local, rr.block_tokens, shards.remote).tokens
        return [Chunk(c.a_block, c.a_token, c.b_block, c.b_token, c.tokens) for c in
                dcp_chunks(lr.block_tokens, rr.block_tokens, shards, span if tokens is None else tokens, start)]
    per = lr.tokens_per_entry  # token dims count entries: [start, tokens) covers these entries
    first, limit = start // per, t.tokens if tokens is None else ceildiv(tokens, per)
    bl, br = lr.block_entries, rr.block_entries
    cuts = [first] + list(range(first // t.chunk * t.chunk + t.chunk, limit, t.chunk)) + [limit]
    return [Chunk(a // bl, a % bl, a // br, a % br, b - a) for a, b in zip(cuts, cuts[1:]) if b > a]


def tile_runs(lr: PlanRegion, rr: PlanRegion, pieces: Sequence[Piece], tokens: int | None = None,
              start: int = 0, shards: ShardPair | None = None) -> Runs:
    """Runs of one tile of region ``lr`` (local) ↔ ``rr`` (remote), merged to the minimum.

    ``[start, tokens)`` clips a partial tile (tokens None: to the tile's end); ``shards``: the two
    ranks' token shares under decode context parallelism (None: each rank holds every token).
    Post-condition: the runs map
    every byte of the pieces exactly once, and no two runs continue each other on both sides.

    >>> from kvlc import compile_spec
    >>> r = compile_spec("layouts/llama-3.1-8b.yaml").regions[0]
    >>> runs = tile_runs(r, r, [Piece("k", 0, 8, 0, 0), Piece("v", 0, 8, 0, 0)])
    >>> len(runs), runs.nbytes == r.block_bytes
    (1, True)
    """
    cs = chunks(lr, rr, tokens, start, shards)
    parts = []
    for piece in pieces:
        lf, rf = lr.field(piece.field), rr.field(piece.field)
        use = cs[:1] if lr.is_state else (cs if lf.dim("token") is not None else [WHOLE])
        for c in use:
            lo, ro, run = field_copy_runs(lf, rf, piece, c)
            parts.append((np.full(len(lo), c.local_block), lo, np.full(len(lo), c.remote_block), ro,
                          np.full(len(lo), run)))
    if not parts:
        return Runs.empty()
    cat = [np.concatenate([p[i] for p in parts]).astype(np.int64) for i in range(5)]
    return Runs(*merge_runs(*cat))
