"""Descriptor rows: ``base + id * stride + offset`` on each side, written in place, then coalesced.

A :class:`Side` names one side's per-entry operands (never positional columns); a
:class:`Geometry` holds both, stacked once per binding so that one numpy call writes both
sides; a :class:`RowPiece` adds a request's block ids, run offsets and lengths.
:func:`write_rows` fills ``(E, K, 3)`` int64 views of both sides; :func:`coalesce` merges
rows that continue on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import add, and_, eq

import numpy as np

from kvlc.compiler.algebra.copies import coalesce_rows


@dataclass(frozen=True, eq=False)
class Side:
    """One side of E entries: block stride, base address (region offset included) and device, each (E,)."""

    stride: np.ndarray
    base: np.ndarray
    device: np.ndarray


@dataclass(frozen=True, eq=False)
class Geometry:
    """Both sides' :class:`Side` operands, stacked: ``stride``, ``base``, ``device`` are (2, E, 1).

    Axis 0 is the side (0 local, 1 remote), so one numpy call computes both sides' addresses.
    """

    stride: np.ndarray
    base: np.ndarray
    device: np.ndarray

    @classmethod
    def of(cls, local: Side, remote: Side) -> "Geometry":
        def both(a, b):
            return np.stack((np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)))[:, :, None]
        return cls(both(local.stride, remote.stride), both(local.base, remote.base),
                   both(local.device, remote.device))

    @property
    def entries(self) -> int:
        return self.stride.shape[1]


@dataclass(frozen=True, eq=False)
class RowPiece:
    """Rows for E entries x K runs: side ``s`` of (e, k) at ``base[s, e] + ids[s, k] * stride[s, e] + offset[s, k]``.

    ``ids``: kernel block ids of each side (2, K); ``offset``: run offsets of each side (2, K),
    or None for 0; ``length``: run lengths (K,), the same on both sides.
    """

    geometry: Geometry
    ids: np.ndarray
    offset: np.ndarray | None
    length: np.ndarray

    def __len__(self) -> int:
        """K, the runs per entry."""
        return self.ids.shape[1]

    @property
    def entries(self) -> int:
        return self.geometry.entries


def write_rows(piece: RowPiece, out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Descriptor rows of a piece, as two ``(E, K, 3)`` int64 arrays (``out``: a (2, E, K, 3) view to fill).

    >>> s = Side(np.array([64]), np.array([1000]), np.array([0]))
    >>> l, r = write_rows(RowPiece(Geometry.of(s, s), np.array([[0, 2], [0, 2]]), None, np.array([64, 64])))
    >>> l[0].tolist()
    [[1000, 64, 0], [1128, 64, 0]]
    """
    if out is None:
        out = np.empty((2, piece.entries, len(piece), 3), dtype=np.int64)
    g = piece.geometry
    addr = out[..., 0]
    np.multiply(piece.ids[:, None, :], g.stride, out=addr)
    addr += g.base
    if piece.offset is not None:
        addr += piece.offset[:, None, :]
    out[..., 1] = piece.length
    out[..., 2] = g.device
    return out[0], out[1]


_SMALL = 128  # rows up to this many: tested in Python, whose per-call cost is below numpy's there
_CHUNK = 8192  # rows per step of the continuity test: temporaries stay small and in cache


def coalesce(local: np.ndarray, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`~kvlc.compiler.algebra.copies.coalesce_rows`, same result, without large temporaries.

    Tests whether any row continues the previous one on both sides (a few rows in Python ints,
    more chunk by chunk in two small reused buffers); only then (something may merge) it calls
    ``coalesce_rows``. Rows that
    continue in address but not in device do not merge there either.
    """
    if len(local) < 2:
        return local, remote
    if len(local) <= _SMALL:
        return coalesce_rows(local, remote) if _continues_small(local, remote) else (local, remote)
    la, n = local[:, 0], local[:, 1]
    ra = remote[:, 0]
    m = len(local) - 1
    step = min(m, _CHUNK)
    end = np.empty(step, dtype=np.uint64)
    same = np.empty(step, dtype=bool)
    for i in range(0, m, step):
        j = min(m, i + step)
        e, s = end[:j - i], same[:j - i]
        np.add(la[i:j], n[i:j], out=e)
        np.equal(la[i + 1:j + 1], e, out=s)
        if not s.any():
            continue
        np.add(ra[i:j], n[i:j], out=e)
        if np.any(s & np.equal(ra[i + 1:j + 1], e)):
            return coalesce_rows(local, remote)
    return local, remote


def _continues_small(local: np.ndarray, remote: np.ndarray) -> bool:
    """Whether some row continues the previous one on both sides (few rows: Python ints)."""
    la, n = local[:, 0].tolist(), local[:, 1].tolist()
    if not any(map(eq, map(add, la, n), la[1:])):  # no row continues on the local side: nothing merges
        return False
    ra = remote[:, 0].tolist()
    return any(map(and_, map(eq, map(add, la, n), la[1:]), map(eq, map(add, ra, n), ra[1:])))
