"""Per request, token arithmetic — which tokens ``[start, stop)`` a request moves, in which blocks and tiles.

A request names the tokens ``[start, stop)`` it moves (``num_tokens=N`` is ``[0, N)``).
Each side's block ids list the blocks of that side that the range touches, in order:
logical blocks ``start // bs .. ceil(stop / bs) - 1`` of that side's block size ``bs``
(:func:`block_span`). Bytes of tokens outside the range are never written, also in a
block the range covers only partly (a prefix-cache hit that ends mid-block).

A sliding-window group moves only what its window still needs (:func:`window_start`).
Pure integer rules; :mod:`kvlc.compiler.request.check` applies them, :mod:`kvlc.compiler.request.instantiate`
and :mod:`kvlc.compiler.request.prepared` walk the tiles of :func:`tile_spans`.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

from kvlc.compiler.algebra.layout import ceildiv


@dataclass(frozen=True)
class TokenRange:
    """Tokens ``[start, stop)`` of one group (``start < stop``, or equal: nothing to move)."""

    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


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


@dataclass(frozen=True)
class WindowStats:
    """What a sliding-window group moves per request, at most: blocks on each side, tokens.

    ``receiver`` / ``sender``: ``"local"`` or ``"remote"``; block sizes are each side's
    logical block size. ``vllm_blocks``: vLLM's own clip, ``cdiv(window, block) + 1`` receiver blocks.
    """

    group: str
    window: int
    receiver: str
    receiver_block_size: int
    sender_block_size: int
    max_receiver_blocks: int
    max_sender_blocks: int
    max_tokens: int

    @property
    def vllm_blocks(self) -> int:
        return ceildiv(self.window, self.receiver_block_size) + 1

    def text(self) -> str:
        return (f"sliding-window group '{self.group}' (window {self.window}): a request moves at most "
                f"{self.max_receiver_blocks} blocks of {self.receiver_block_size} tokens on the receiving "
                f"({self.receiver}) side, {self.max_sender_blocks} of {self.sender_block_size} on the sending "
                f"side, {self.max_tokens} tokens (vLLM keeps {self.vllm_blocks} blocks)")


def window_stats(group: str, window: int, receiver: str, recv_bs: int, send_bs: int) -> WindowStats:
    """The most a window group moves per request, over every ``stop`` (exact: one period of both block sizes).

    >>> w = window_stats("local", 1024, "local", 16, 32)
    >>> w.max_receiver_blocks, w.max_sender_blocks, w.max_tokens, w.vllm_blocks
    (65, 33, 1038, 65)
    """
    best = (0, 0, 0)
    period = recv_bs // gcd(recv_bs, send_bs) * send_bs
    for stop in range(max(1, window - 1), window - 1 + period + 1):
        moved = TokenRange(window_start(TokenRange(0, stop), window, recv_bs), stop)
        here = (block_span(moved, recv_bs)[1], block_span(moved, send_bs)[1], len(moved))
        best = tuple(max(x, y) for x, y in zip(best, here))
    return WindowStats(group, window, receiver, recv_bs, send_bs, *best)


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
