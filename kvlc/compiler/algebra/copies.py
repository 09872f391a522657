"""Layout algebra: strided copies between two byte spaces as minimal runs.

A copy is a set of named dims, each with a size and one byte stride per side
(CuTe-style ``shape:stride`` on both sides at once). :func:`strided_runs`
turns it into runs ``(local offset, remote offset, length)`` that are contiguous
on both sides; :func:`merge_runs` coalesces runs that continue each other.
Post-condition of both: the byte map (local byte -> remote byte) is unchanged.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

# Sub-block index and in-block offset packed into one integer ("virtual address"):
# runs never continue across sub-blocks, whose real addresses are unrelated.
SUB_SHIFT = 40


def coalesce_dims(dims: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Drop size-1 dims, sort by local stride, merge neighbours contiguous on both sides.

    >>> coalesce_dims([(1, 999, 999), (4, 2, 2), (8, 8, 8), (3, 64, 100)])
    [(32, 2, 2), (3, 64, 100)]
    """
    ds = sorted((d for d in dims if d[0] > 1), key=lambda d: (d[1], d[2]))
    out: list[tuple[int, int, int]] = []
    for size, sl, sr in ds:
        if out:
            psize, psl, psr = out[-1]
            if sl == psize * psl and sr == psize * psr:
                out[-1] = (psize * size, psl, psr)
                continue
        out.append((size, sl, sr))
    return out


def strided_runs(dims: Sequence[tuple[int, int, int]], off_l: int, off_r: int,
                 itemsize: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Runs of a strided copy: arrays of local and remote offsets, and the common run length.

    ``dims`` are ``(size, local stride, remote stride)`` in bytes; elements are
    ``itemsize`` bytes. The run is the largest innermost part contiguous on both sides.

    >>> l, r, n = strided_runs([(2, 256, 128), (128, 2, 2)], 0, 0, 2)
    >>> l.tolist(), r.tolist(), n
    ([0, 256], [0, 128], 256)
    """
    merged = coalesce_dims(dims)
    run = itemsize
    i = 0
    while i < len(merged) and merged[i][1] == run and merged[i][2] == run:
        run *= merged[i][0]
        i += 1
    lo = np.array([off_l], dtype=np.int64)
    ro = np.array([off_r], dtype=np.int64)
    for size, sl, sr in merged[i:]:
        idx = np.arange(size, dtype=np.int64)
        lo = (lo[:, None] + idx[None, :] * sl).ravel()
        ro = (ro[:, None] + idx[None, :] * sr).ravel()
    return lo, ro, run


def merge_runs(kl: np.ndarray, ol: np.ndarray, kr: np.ndarray, orr: np.ndarray,
               n: np.ndarray) -> tuple[np.ndarray, ...]:
    """Sort runs by local position and merge those that continue on both sides.

    Runs are ``(local sub-block, local offset, remote sub-block, remote offset, length)``;
    two runs merge only inside the same sub-blocks. Returns the same five arrays.

    >>> out = merge_runs(*(np.array(v) for v in ([0, 0], [0, 8], [0, 0], [100, 108], [8, 8])))
    >>> [a.tolist() for a in out]
    [[0], [0], [0], [100], [16]]
    """
    if len(n) == 0:
        return kl, ol, kr, orr, n
    vl = (kl.astype(np.int64) << SUB_SHIFT) + ol
    vr = (kr.astype(np.int64) << SUB_SHIFT) + orr
    order = np.lexsort((vr, vl))
    vl, vr, n = vl[order], vr[order], n[order]
    if np.any(vl[1:] < vl[:-1] + n[:-1]):
        raise ValueError("runs overlap on the local side")
    cont = (vl[1:] == vl[:-1] + n[:-1]) & (vr[1:] == vr[:-1] + n[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    lengths = np.add.reduceat(n, starts)
    vl, vr = vl[starts], vr[starts]
    mask = (1 << SUB_SHIFT) - 1
    return vl >> SUB_SHIFT, vl & mask, vr >> SUB_SHIFT, vr & mask, lengths


def coalesce_rows(local: np.ndarray, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge consecutive descriptor rows ``(addr, len, dev)`` that continue on both sides.

    Rows are merged in the order given (no sorting), so the cost is O(N).

    >>> a = np.array([[0, 4, 0], [4, 4, 0], [16, 4, 0]], dtype=np.uint64)
    >>> b = np.array([[100, 4, 0], [104, 4, 0], [108, 4, 0]], dtype=np.uint64)
    >>> l, r = coalesce_rows(a, b)
    >>> l.tolist(), r[:, 0].tolist()
    ([[0, 8, 0], [16, 4, 0]], [100, 108])
    """
    if len(local) < 2:
        return local, remote
    la, n, ld = local[:, 0], local[:, 1], local[:, 2]
    ra, rd = remote[:, 0], remote[:, 2]
    cont = ((la[1:] == la[:-1] + n[:-1]) & (ra[1:] == ra[:-1] + n[:-1])
            & (ld[1:] == ld[:-1]) & (rd[1:] == rd[:-1]))
    if not cont.any():
        return local, remote
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    lengths = np.add.reduceat(n, starts)
    lo = local[starts]
    ro = remote[starts]
    lo[:, 1] = lengths
    ro[:, 1] = lengths
    return lo, ro
