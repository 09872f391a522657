"""Layout algebra: a ``shape:stride`` value type and the integer rules every stage shares.

A :class:`Layout` maps a coordinate to a byte offset (CuTe / pycute style): modes
are listed outermost first, ``offset(c) = sum(c[i] * stride[i])``. The free
functions below are the one definition of each rule the compiler repeats:
the TP shard rule (:func:`shard`, :func:`head_range`, :func:`holders`), the
tile of two block sizes (:func:`tile`, :func:`lcm`), ceiling division, kernel
block ids (:func:`kernel_ids`) and what "per-request state" means
(:func:`is_state_kind`). Each states its post-condition; ``tests/test_layout.py``
checks them with hypothesis.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd, prod
from typing import Iterable, Sequence

import numpy as np

STATE_KINDS = frozenset({"mamba", "linear_attention"})


# ----------------------------------------------------------------------------- integer rules
def ceildiv(a: int, b: int) -> int:
    """Smallest ``q`` with ``q * b >= a`` (``b > 0``).

    >>> ceildiv(33, 16), ceildiv(32, 16), ceildiv(0, 16)
    (3, 2, 0)
    """
    return -(-a // b)


def lcm(a: int, b: int) -> int:
    """Least common multiple of two positive integers: ``lcm % a == lcm % b == 0``.

    >>> lcm(16, 24)
    48
    """
    return a // gcd(a, b) * b


def is_state_kind(kind: str) -> bool:
    """Does a group of this kind hold per-request state (no token axis)?

    >>> is_state_kind("mamba"), is_state_kind("full")
    (True, False)
    """
    return str(kind) in STATE_KINDS


@dataclass(frozen=True)
class Tile:
    """The smallest token span both block sizes divide: ``tokens = lcm(a, b)``.

    ``a_blocks * a == b_blocks * b == tokens``; ``chunk = gcd(a, b)`` is the largest token
    run that never crosses a block boundary on either side. ``tokens == 0``: per-request state.
    """

    tokens: int
    a_blocks: int
    b_blocks: int
    chunk: int

    @property
    def is_state(self) -> bool:
        return self.tokens == 0


def tile(a: int, b: int) -> Tile:
    """The tile of block sizes ``a`` and ``b`` tokens (0 and 0: a state tile of one block each).

    >>> tile(16, 24)
    Tile(tokens=48, a_blocks=3, b_blocks=2, chunk=8)
    >>> tile(0, 0)
    Tile(tokens=0, a_blocks=1, b_blocks=1, chunk=0)
    """
    if not a or not b:
        return Tile(0, 1, 1, 0)
    t = lcm(a, b)
    return Tile(t, t // a, t // b, gcd(a, b))


# ----------------------------------------------------------------------------- tensor parallelism
def shard(global_size: int, tp: int) -> int | None:
    """Heads per rank: ``global/tp``, or 1 when tp is a multiple (replicas); None if neither.

    Post-condition: ``shard * tp == global_size`` (sharded) or ``tp % global_size == 0``
    and every rank holds one head (replicated ``tp // global_size`` times).

    >>> shard(8, 2), shard(8, 16), shard(6, 4)
    (4, 1, None)
    """
    if global_size % tp == 0:
        return global_size // tp
    if tp % global_size == 0:
        return 1
    return None


def valid_tp_sizes(global_size: int, limit: int = 0) -> list[int]:
    """TP sizes that :func:`shard` accepts for ``global_size`` heads, up to ``limit`` (default 2x heads).

    >>> valid_tp_sizes(8)
    [1, 2, 4, 8, 16]
    """
    top = limit or 2 * global_size
    return [t for t in range(1, top + 1) if shard(global_size, t) is not None]


def head_range(rank: int, heads: int, tp: int) -> tuple[int, int]:
    """Global head range ``[start, stop)`` a rank holds (one head per replica when tp > heads).

    Post-condition: over ranks ``0..tp-1`` the ranges cover ``[0, heads)``; sharded, they are disjoint.

    >>> head_range(3, 8, 4), head_range(5, 8, 16)
    ((6, 8), (2, 3))
    """
    if heads % tp == 0:
        n = heads // tp
        return rank * n, (rank + 1) * n
    per = tp // heads
    return rank // per, rank // per + 1


def holders(head: int, heads: int, tp: int) -> range:
    """Ranks of an engine of TP ``tp`` that hold global ``head``: ``head in head_range(r)`` for each.

    >>> list(holders(3, 8, 4)), list(holders(3, 8, 16))
    ([1], [6, 7])
    """
    if heads % tp == 0:
        r = head // (heads // tp)
        return range(r, r + 1)
    per = tp // heads
    return range(head * per, (head + 1) * per)


# ----------------------------------------------------------------------------- block ids
def kernel_ids(ids: np.ndarray, per_block: int) -> np.ndarray:
    """Logical block ids → kernel block ids: block ``b`` is kernel blocks ``b*m .. b*m + m-1``.

    Post-condition: ``len(out) == len(ids) * m`` and ``out // m`` repeats each id ``m`` times.

    >>> kernel_ids(np.array([2, 0]), 2).tolist()
    [4, 5, 0, 1]
    """
    if per_block == 1:
        return ids
    return (ids[:, None] * per_block + np.arange(per_block)[None, :]).ravel()


# ----------------------------------------------------------------------------- the value type
def _tuple(v) -> tuple[int, ...]:
    return tuple(int(x) for x in v) if isinstance(v, (tuple, list)) else (int(v),)


@dataclass(frozen=True)
class Layout:
    """Coordinates → offsets: ``shape:stride``, modes outermost first (row-major order of modes).

    >>> L = Layout((2, 8), (8, 1))
    >>> str(L), L(1, 3), L.size, L.cosize
    ('(2,8):(8,1)', 11, 16, 16)
    >>> Layout.parse("(4,2):(1,4)") == Layout((4, 2), (1, 4))
    True
    """

    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.stride):
            raise ValueError(f"layout shape {self.shape} and stride {self.stride} differ in rank")
        if any(s < 1 for s in self.shape):
            raise ValueError(f"layout shape {self.shape} has a mode smaller than 1")

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """Read the text form: ``8:1`` or ``(2,8):(8,1)``."""
        shape, _, stride = text.replace(" ", "").partition(":")
        parts = [tuple(int(x) for x in p.strip("()").split(",") if x) for p in (shape, stride)]
        return cls(*parts)

    def __str__(self) -> str:
        if len(self.shape) == 1:
            return f"{self.shape[0]}:{self.stride[0]}"
        return f"({','.join(map(str, self.shape))}):({','.join(map(str, self.stride))})"

    def __len__(self) -> int:
        return len(self.shape)

    def __getitem__(self, i: int) -> "Layout":
        """One mode as a rank-1 layout."""
        return Layout((self.shape[i],), (self.stride[i],))

    @property
    def size(self) -> int:
        """Number of coordinates."""
        return prod(self.shape)

    @property
    def cosize(self) -> int:
        """One past the largest offset: the span the layout touches."""
        return sum((n - 1) * s for n, s in zip(self.shape, self.stride)) + 1

    def __call__(self, *coord: int) -> int:
        """Offset of a coordinate (one index per mode), or of a flat row-major index."""
        if len(coord) == 1 and len(self.shape) > 1:
            coord = tuple(np.unravel_index(int(coord[0]), self.shape))
        if len(coord) != len(self.shape):
            raise ValueError(f"coordinate {coord} has {len(coord)} indices; layout {self} has {len(self)} modes")
        return sum(int(c) * s for c, s in zip(coord, self.stride))

    def offsets(self) -> np.ndarray:
        """Every offset, in row-major coordinate order (last mode fastest)."""
        out = np.zeros(1, dtype=np.int64)
        for n, s in zip(self.shape, self.stride):
            out = (out[:, None] + np.arange(n, dtype=np.int64)[None, :] * s).ravel()
        return out


def row_major(shape: Sequence[int], itemsize: int = 1) -> Layout:
    """Compact layout, last mode innermost: offsets are ``0, itemsize, 2*itemsize, ...`` in row-major order.

    Post-condition: ``offsets() == arange(size) * itemsize``.

    >>> str(row_major((2, 4, 8), 2))
    '(2,4,8):(64,16,2)'
    """
    strides = []
    acc = itemsize
    for n in reversed(tuple(shape)):
        strides.append(acc)
        acc *= int(n)
    return Layout(tuple(int(n) for n in shape), tuple(reversed(strides)))


def slice_mode(layout: Layout, mode: int, start: int, stop: int) -> tuple[Layout, int]:
    """Restrict ``mode`` to ``[start, stop)``: the smaller layout and the offset it starts at.

    Post-condition: ``base + sub(c) == layout(c')`` where ``c'`` is ``c`` with ``start`` added to ``mode``.

    >>> sub, base = slice_mode(row_major((8, 16), 2), 0, 2, 4)
    >>> str(sub), base
    ('(2,16):(32,2)', 64)
    """
    if not 0 <= start < stop <= layout.shape[mode]:
        raise ValueError(f"slice [{start}, {stop}) outside mode {mode} of size {layout.shape[mode]}")
    shape = list(layout.shape)
    shape[mode] = stop - start
    return Layout(tuple(shape), layout.stride), start * layout.stride[mode]


def split_mode(layout: Layout, mode: int, sizes: Iterable[int]) -> list[tuple[Layout, int]]:
    """Cut ``mode`` into consecutive pieces of the given sizes: ``[(piece, base offset), ...]``.

    Post-condition: the pieces' offsets, shifted by their bases, are exactly ``layout``'s.

    >>> [(str(p), b) for p, b in split_mode(row_major((6, 4)), 0, (2, 4))]
    [('(2,4):(4,1)', 0), ('(4,4):(4,1)', 8)]
    """
    out, at = [], 0
    for n in sizes:
        out.append(slice_mode(layout, mode, at, at + n))
        at += n
    if at != layout.shape[mode]:
        raise ValueError(f"pieces sum to {at}, mode {mode} has {layout.shape[mode]}")
    return out
