"""Descriptor rows: ``base + id * stride + offset`` on each side, written in place, then coalesced.

A :class:`Side` names one side's operands (never positional columns); a :class:`RowPiece`
pairs the two sides with the run lengths. :func:`write_rows` fills ``(E, K, 3)`` int64
views; :func:`coalesce` merges rows that continue on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import add, eq

import numpy as np

from kvlc.compiler.algebra import coalesce_rows


@dataclass(frozen=True, eq=False)
class Side:
    """One side of E entries x K runs: address of (e, k) = ``base[e] + ids[k] * stride[e] + offset[k]``.

    ``ids``: kernel block ids (K,); ``stride``, ``base``, ``device``: per entry (E,);
    ``offset``: per run (K,), or None for 0.
    """

    ids: np.ndarray
    stride: np.ndarray
    base: np.ndarray
    offset: np.ndarray | None
    device: np.ndarray


@dataclass(frozen=True, eq=False)
class RowPiece:
    """Rows for E entries x K runs: both sides and the run lengths (K,)."""

    local: Side
    remote: Side
    length: np.ndarray

    def __len__(self) -> int:
        """K, the runs per entry."""
        return len(self.local.ids)

    @property
    def entries(self) -> int:
        return len(self.local.base)


def _write_side(side: Side, length: np.ndarray, rows: np.ndarray) -> None:
    addr = rows[:, :, 0]
    np.multiply(side.ids[None, :], side.stride[:, None], out=addr)
    addr += side.base[:, None]
    if side.offset is not None:
        addr += side.offset[None, :]
    rows[:, :, 1] = length[None, :]
    rows[:, :, 2] = side.device[:, None]


def write_rows(piece: RowPiece, out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Descriptor rows of a piece, into two ``(E, K, 3)`` int64 arrays (``out``: views to fill).

    >>> s = Side(np.array([0, 2]), np.array([64]), np.array([1000]), None, np.array([0]))
    >>> l, r = write_rows(RowPiece(s, s, np.array([64, 64])))
    >>> l[0].tolist()
    [[1000, 64, 0], [1128, 64, 0]]
    """
    E, K = piece.entries, len(piece)
    if out is None:
        out = (np.empty((E, K, 3), dtype=np.int64), np.empty((E, K, 3), dtype=np.int64))
    _write_side(piece.local, piece.length, out[0])
    _write_side(piece.remote, piece.length, out[1])
    return out


_SMALL = 128  # rows up to this many: tested in Python, whose per-call cost is below numpy's there
_CHUNK = 8192  # rows per step of the continuity test: temporaries stay small and in cache


def coalesce(local: np.ndarray, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`~kvlc.compiler.algebra.coalesce_rows`, same result, without large temporaries.

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
    return any(la[i] + n[i] == la[i + 1] and ra[i] + n[i] == ra[i + 1] for i in range(len(la) - 1))
