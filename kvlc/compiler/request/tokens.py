"""Per request, token arithmetic — which tokens ``[start, stop)`` a request moves, in which blocks and tiles.

A request names the tokens ``[start, stop)`` it moves (``num_tokens=N`` is ``[0, N)``).
Each side's block ids list the blocks of that side that the range touches, in order:
logical blocks ``start // bs .. ceil(stop / bs) - 1`` of that side's block size ``bs``
(:func:`block_span`). Bytes of tokens outside the range are never written, also in a
block the range covers only partly (a prefix-cache hit that ends mid-block).

A sliding-window group moves only what its window still needs (:func:`window_start`;
the most that is per request: :mod:`kvlc.compiler.request.windows`). Pure integer rules;
:mod:`kvlc.compiler.request.check` applies them, :mod:`kvlc.compiler.request.instantiate`
and :mod:`kvlc.compiler.request.prepared` walk the tiles of :func:`tile_spans`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvlc.compiler.algebra.layout import ceildiv
from kvlc.errors import TransferError, type_name


@dataclass(frozen=True)
class TokenRange:
    """Tokens ``[start, stop)`` of one group (``start < stop``, or equal: nothing to move).

    The one token-range type of kvlc: a request's ``num_tokens=N`` (always a count) is
    ``TokenRange(0, N)``; see :meth:`of`.
    """

    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start

    @classmethod
    def of(cls, num_tokens=None, tokens=None, *, group: str, groups: Sequence[str] = ()) -> "TokenRange":
        """The range a request gives for ``group``: ``num_tokens=N`` (a count: ``[0, N)``) or
        ``tokens=TokenRange(start, stop)`` / ``(start, stop)`` / ``range(start, stop)``, either one value
        or a mapping group -> value
        (``groups``: the token groups, named when a mapping lacks one). Refusals are :class:`TransferError`.

        >>> TokenRange.of(32, group="full"), TokenRange.of(tokens=range(16, 40), group="full")
        (TokenRange(start=0, stop=32), TokenRange(start=16, stop=40))
        >>> TokenRange.of(tokens=TokenRange(16, 40), group="full")
        TokenRange(start=16, stop=40)
        >>> TokenRange.of(0, group="full")
        Traceback (most recent call last):
        kvlc.errors.TransferError: group 'full': num_tokens must be positive, got 0
        """
        if tokens is None and type(num_tokens) is int and num_tokens > 0:  # the common case: N tokens from 0
            return cls(0, num_tokens)
        if tokens is not None:
            if num_tokens is not None:
                raise TransferError("give the tokens to move as num_tokens=N (tokens [0, N)) or "
                                    "tokens=(start, stop), not both")
            return _bounds(_per_group(tokens, group, groups, "tokens"), group)
        return cls(0, token_count(_per_group(num_tokens, group, groups, "num_tokens"), group))


def _is_int(x) -> bool:
    return not isinstance(x, (bool, np.bool_)) and isinstance(x, (int, np.integer))


def token_count(value, group: str) -> int:
    """A positive integer token count (bool, float, str, NaN refused).

    >>> token_count(7, "full")
    7
    """
    if not _is_int(value):
        raise TransferError(f"group '{group}': num_tokens must be a positive integer; found {value!r} "
                            f"({type_name(type(value))})")
    tok = int(value)
    if tok <= 0:
        raise TransferError(f"group '{group}': num_tokens must be positive, got {tok}")
    return tok


def _per_group(value, group: str, groups: Sequence[str], what: str):
    if isinstance(value, Mapping):
        if group not in value:
            raise TransferError(f"{what} has no entry for group '{group}' "
                                f"(give one per token group: {sorted(groups)})")
        return value[group]
    return value


def _bounds(value, group: str) -> TokenRange:
    """A :class:`TokenRange`, ``(start, stop)`` or ``range(start, stop)`` as a checked :class:`TokenRange`
    (``0 <= start < stop``)."""
    where = f"group '{group}': tokens"
    if isinstance(value, TokenRange):
        pair = (value.start, value.stop)
    elif isinstance(value, range):
        if value.step != 1:
            raise TransferError(f"{where} {value!r} must have step 1 (a token range moves every token in it)")
        pair = (value.start, value.stop)
    elif isinstance(value, (tuple, list)) and len(value) == 2:
        pair = tuple(value)
    else:
        raise TransferError(f"{where} must be (start, stop) or range(start, stop); found {value!r} "
                            f"({type_name(type(value))})")
    for x in pair:
        if not _is_int(x):
            raise TransferError(f"{where} (start, stop) must be integers; found {x!r} ({type_name(type(x))})")
    start, stop = int(pair[0]), int(pair[1])
    if not 0 <= start < stop:
        raise TransferError(f"{where} ({start}, {stop}) must have 0 <= start < stop")
    return TokenRange(start, stop)


def block_span(span: TokenRange, block_size: int) -> tuple[int, int]:
    """First logical block and number of blocks of size ``block_size`` that ``span`` touches.

    >>> block_span(TokenRange(20, 40), 16)    # blocks 1 and 2: tokens 16..47
    (1, 2)
    >>> block_span(TokenRange(0, 33), 16)
    (0, 3)
    """
    first = span.start // block_size
    return first, ceildiv(span.stop, block_size) - first


def window_start(span: TokenRange, window: int, block_size: int) -> int:
    """First token a sliding-window group of ``window`` tokens still needs after ``span``, at the receiver.

    vLLM computes token ``stop`` next; it attends to ``[stop - window + 1, stop]``
    (``SlidingWindowManager.get_num_skipped_tokens`` in
    vllm/v1/core/single_type_kv_cache_manager.py: ``max(0, num_computed_tokens -
    sliding_window + 1)`` tokens are skipped), and ``remove_skipped_blocks`` frees
    (replaces by the null block) only blocks whose tokens are all skipped. The receiving
    side's blocks that stay must hold every one of their tokens (they may be cached and hit
    by a later, shorter prefix), so the range starts at the first kept block of the receiver
    (logical blocks of ``block_size`` tokens), never before the request's own ``start``.

    >>> window_start(TokenRange(0, 100), 32, 16)    # skipped: 69 tokens -> blocks 0..3 go; block 4 (64..79) stays
    64
    >>> window_start(TokenRange(90, 100), 32, 16), window_start(TokenRange(0, 20), 32, 16)
    (90, 0)
    """
    skipped = max(0, span.stop - window + 1)
    return max(span.start, skipped // block_size * block_size)


def chunk_start(span: TokenRange, chunk: int, block_size: int) -> int:
    """First token a chunked-local group of ``chunk`` tokens still needs after ``span``, at the receiver.

    vLLM computes token ``stop`` next; it attends only inside its own chunk, from ``stop // chunk * chunk``
    (``ChunkedLocalAttentionManager.get_num_skipped_tokens`` in
    vllm/v1/core/single_type_kv_cache_manager.py), and frees (replaces by the null block) only blocks
    whose tokens are all skipped; so the range starts at the receiver's block holding the chunk's first
    token, never before the request's own ``start``. It equals ``stop`` (nothing moves) when ``stop``
    starts a chunk on a block boundary.

    >>> chunk_start(TokenRange(0, 149), 32, 32), chunk_start(TokenRange(0, 149), 48, 32)   # chunk 4; chunk 3 from 144
    (128, 128)
    >>> chunk_start(TokenRange(0, 128), 32, 32), chunk_start(TokenRange(130, 149), 32, 32)
    (128, 130)
    """
    skipped = span.stop // chunk * chunk
    return min(span.stop, max(span.start, skipped // block_size * block_size))


@dataclass(frozen=True)
class PartialTile:
    """Tokens ``[lo, hi)`` (offsets in the tile) of tile ``tile``: a tile the range covers only partly."""

    tile: int
    lo: int
    hi: int


@dataclass(frozen=True)
class TileSpan:
    """The tiles of a span: ``count`` whole tiles from tile ``first``, and up to two partial ones."""

    first: int
    count: int
    partial: tuple[PartialTile, ...]


def tile_spans(span: TokenRange, tile_tokens: int) -> TileSpan:
    """Whole and partial tiles of ``tile_tokens`` tokens that ``span`` covers (tile ``j``: tokens ``j*T ..``).

    >>> tile_spans(TokenRange(0, 40), 16)
    TileSpan(first=0, count=2, partial=(PartialTile(tile=2, lo=0, hi=8),))
    >>> tile_spans(TokenRange(20, 40), 16)
    TileSpan(first=2, count=0, partial=(PartialTile(tile=1, lo=4, hi=16), PartialTile(tile=2, lo=0, hi=8)))
    >>> tile_spans(TokenRange(18, 30), 16)
    TileSpan(first=1, count=0, partial=(PartialTile(tile=1, lo=2, hi=14),))
    """
    T = tile_tokens
    if span.stop <= span.start:
        return TileSpan(0, 0, ())
    head, last = span.start // T, span.stop // T
    if head == last:                      # inside one tile (then stop % T > 0)
        return TileSpan(head, 0, (PartialTile(head, span.start - head * T, span.stop - head * T),))
    first = ceildiv(span.start, T)
    partial = []
    if span.start % T:
        partial.append(PartialTile(head, span.start % T, T))
    if span.stop % T:
        partial.append(PartialTile(last, 0, span.stop % T))
    return TileSpan(first, last - first, tuple(partial))
