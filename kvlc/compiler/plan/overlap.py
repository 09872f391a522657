"""Check, part 2 — exact overlap of two strided block sets (regions of one storage).

A region's bytes are ``offset + i * stride + [0, block_bytes)`` for ``i < num_blocks``. Two
regions with different strides share a byte exactly when some block ``i`` of one meets some
block ``j`` of the other. For a block of ``a`` at ``x``, the blocks of ``b`` it meets are those
with ``x - B < b.offset + j * sb < x + A``: an integer interval of ``j``. Away from the ends
of ``b`` that only depends on ``x mod sb``, which repeats every ``sb / gcd(sa, sb)`` blocks of
``a``; so one period plus the blocks near ``b``'s ends decide it, enumerated with numpy.
"""

from __future__ import annotations

from math import gcd

import numpy as np

MAX_CANDIDATES = 1 << 22  # blocks one exact test may enumerate before it stays conservative


def _meets(x: np.ndarray, a_bytes: int, b) -> np.ndarray:
    """For block starts ``x`` (of ``a_bytes`` bytes each): does some block of region ``b`` meet it?"""
    lo = np.floor_divide(x - b.block_bytes - b.offset, b.block_stride) + 1
    hi = -np.floor_divide(-(x + a_bytes - b.offset), b.block_stride) - 1
    lo, hi = np.maximum(lo, 0), np.minimum(hi, b.num_blocks - 1)
    return lo <= hi


def first_shared_byte(a, b) -> int | None:
    """A byte both block sets hold (the lowest block of ``a`` that meets ``b``), None if disjoint.

    Exact up to :data:`MAX_CANDIDATES` enumerated blocks; beyond that a pair whose byte
    spans overlap is reported as sharing its first common byte (conservative).

    >>> from types import SimpleNamespace as R
    >>> a = R(offset=0, block_stride=96, block_bytes=32, num_blocks=4)    # [0,32) [96,128) ...
    >>> b = R(offset=40, block_stride=48, block_bytes=8, num_blocks=6)    # [40,48) [88,96) [136,144) ...
    >>> first_shared_byte(a, b) is None
    True
    >>> first_shared_byte(a, R(offset=40, block_stride=60, block_bytes=8, num_blocks=4))
    100
    """
    a_end = a.offset + (a.num_blocks - 1) * a.block_stride + a.block_bytes
    b_end = b.offset + (b.num_blocks - 1) * b.block_stride + b.block_bytes
    if a_end <= b.offset or b_end <= a.offset:
        return None
    sa, sb = a.block_stride, b.block_stride
    i0 = max(0, -((b.offset - a.block_bytes + 1 - a.offset) // -sa))
    i1 = min(a.num_blocks - 1, (b_end - 1 - a.offset) // sa)
    if i1 < i0:
        return None
    edge = (sb + a.block_bytes + b.block_bytes) // sa + 2
    period = sb // gcd(sa, sb)
    if i1 - i0 + 1 <= 3 * edge + period:
        cand = np.arange(i0, i1 + 1, dtype=np.int64)
    elif 2 * edge + period > MAX_CANDIDATES:
        return max(a.offset, b.offset)
    else:
        cand = np.unique(np.concatenate([np.arange(i0, i0 + edge + period), np.arange(i1 - edge, i1 + 1)]))
    if len(cand) > MAX_CANDIDATES:
        return max(a.offset, b.offset)
    x = a.offset + cand * sa
    hit = np.flatnonzero(_meets(x, a.block_bytes, b))
    if not hit.size:
        return None
    x0 = int(x[hit[0]])
    j = max(0, (x0 - b.block_bytes - b.offset) // sb + 1)
    return max(x0, b.offset + j * sb)
