"""Per request, sliding windows — the most blocks and tokens one request moves per sliding-window group.

Only the blocks the window still needs move (:func:`kvlc.compiler.request.tokens.window_start`);
:func:`window_stats` gives the bound over every request of a program, for ``kvlc pair`` and the
engine's scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

from kvlc.compiler.algebra.layout import ceildiv
from kvlc.compiler.pairing.program import TransferProgram
from kvlc.compiler.request.tokens import TokenRange, block_span, window_start


@dataclass(frozen=True)
class WindowStats:
    """What a sliding-window group moves per request, at most: blocks on each side, tokens.

    ``group``: the group link (the receiver's group where both name it alike, else ``local>remote``).
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


def group_window_stats(group: str, window: int, receiver: str, recv_bs: int, send_bs: int) -> WindowStats:
    """The most a window group moves per request, over every ``stop`` (exact: one period of both block sizes).

    >>> w = group_window_stats("local", 1024, "local", 16, 32)
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


def window_stats(prog: TransferProgram) -> tuple[WindowStats, ...]:
    """Per sliding-window group of a program: the most blocks and tokens one request moves.

    >>> from kvlc import compile_spec, pair
    >>> p = compile_spec("layouts/llama-3.1-8b.yaml")
    >>> window_stats(pair(p, p, local_rank=0))      # no sliding window
    ()
    """
    recv, send = (prog.local, prog.remote) if prog.direction == "READ" else (prog.remote, prog.local)
    side = "local" if prog.direction == "READ" else "remote"
    # (receiver's group, sender's group) -> the link's name
    links = {(e.group, e.remote_group) if side == "local" else (e.remote_group, e.group): e.link
             for e in prog.entries}

    def per_id(plan, name: str) -> int:  # tokens per block id (DCP: block_size on each of dcp_size ranks)
        return plan.group(name).block_size * plan.group_dcp(name)

    return tuple(group_window_stats(links[(g.name, s)], g.window, side, per_id(recv, g.name), per_id(send, s))
                 for g in recv.groups if g.kind == "sliding_window"
                 for (r, s) in links if r == g.name)
