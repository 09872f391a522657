"""Context parallelism: which rank holds which token, and where in its blocks.

vLLM's DCP (``decode_context_parallel_size`` D, ``cp_kv_cache_interleave_size`` I) shards
the token axis of the KV cache; its PCP (``prefill_context_parallel_size`` P) adds ranks that
split prefill compute. The facts this module encodes:

* the world of one pipeline stage is ``P x T`` ranks, TP innermost (``parallel_state.py``,
  ``initialize_model_parallel``: ``all_ranks`` reshaped ``(..., pcp, tp)``): engine rank
  ``r`` has TP rank ``r % T`` and PCP rank ``r // T``; heads are sharded by TP rank, so the
  PCP ranks of one TP rank hold the same heads (for MLA every rank holds the one latent);
* the DCP groups are the ranks ordered ``(tp, pcp)`` (the ``(pcp, tp)`` axes transposed) and
  cut into runs of D: a rank's DCP rank is ``(tp_rank * P + pcp_rank) % D``
  (:func:`dcp_rank`). Without PCP that is ``tp_rank % D`` with ``T % D == 0`` (consecutive TP
  ranks); with PCP, ``ParallelConfig`` allows D in ``{1, P, T * P}`` (DCP off, along the PCP
  axis: ``pcp_rank``, or over all ranks: ``tp_rank * P + pcp_rank``);
* only the DCP group shards tokens (``vllm/v1/attention/backend.py``: ``total_cp_world_size``
  is the DCP world size; the slot mapping of ``vllm/v1/worker/gpu/block_table.py`` takes the
  DCP rank): token ``t`` of a request is stored by DCP rank ``(t // I) % D``, at local position
  ``(t // (D*I)) * I + t % I`` of that rank (a *virtual block* of ``block_size * D`` tokens per
  block id, the same block ids on every rank; the scheduler scales blocks by D, not by P), so
  ``I`` must divide the kernel block size;
* PCP without DCP keeps a whole replica of the KV on every PCP rank: the prefill chunks'
  KV is all-gathered over the PCP group and written by every rank (``vllm/v1/attention/ops/pcp.py``,
  ``_gather_prefill_cache_inputs``; ``ParallelConfig.pcp_shard_decode_requests``).

A rank's tokens are thus a strided subset of the sequence; its *local* token stream is laid
out exactly like a non-DCP engine's (block ``j // kernel block``, slot ``j % kernel block``).
Pairing maps both sides' local streams through global token positions (:func:`dcp_chunks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvlc.compiler.algebra.layout import is_state_kind, lcm


@dataclass(frozen=True)
class Shard:
    """One rank's share of the token axis: DCP ``size``, ``interleave`` and the rank's DCP ``rank``.

    >>> s = Shard(2, 1, 1)
    >>> s.holds(np.arange(6)).tolist(), s.local(np.array([1, 3, 5])).tolist()
    ([False, True, False, True, False, True], [0, 1, 2])
    """

    size: int = 1
    interleave: int = 1
    rank: int = 0

    @property
    def period(self) -> int:
        """Tokens after which the ownership pattern repeats: ``size * interleave``."""
        return self.size * self.interleave

    def holds(self, t: np.ndarray) -> np.ndarray:
        """Which global tokens this rank stores."""
        return (t // self.interleave) % self.size == self.rank

    def local(self, t: np.ndarray) -> np.ndarray:
        """Position of (held) global tokens in this rank's local token stream."""
        return (t // self.period) * self.interleave + t % self.interleave

    def text(self) -> str:
        return f"{self.rank}/{self.size}" + (f"i{self.interleave}" if self.interleave > 1 else "")

    def describe(self) -> str:
        """Which tokens the rank holds, in words.

        >>> Shard(8, 1, 3).describe(), Shard(2, 16, 1).describe(), Shard().describe()
        ('tokens t with t % 8 == 3', 'tokens t with (t // 16) % 2 == 1', 'every token')
        """
        if self.size == 1:
            return "every token"
        t = "t" if self.interleave == 1 else f"(t // {self.interleave})"
        return f"tokens t with {t} % {self.size} == {self.rank}"


@dataclass(frozen=True)
class ShardPair:
    """The two shards one entry copies between: the local rank's and the peer rank's."""

    local: Shard
    remote: Shard

    def text(self) -> str:
        return f"{self.local.text()}>{self.remote.text()}"

    def meets(self) -> bool:
        """Do the two ranks hold any token in common?

        >>> ShardPair(Shard(2, 1, 0), Shard(2, 1, 1)).meets(), ShardPair(Shard(2, 1, 0), Shard(4, 1, 2)).meets()
        (False, True)
        """
        t = np.arange(lcm(self.local.period, self.remote.period))
        return bool(np.any(self.local.holds(t) & self.remote.holds(t)))


@dataclass(frozen=True)
class DcpTile:
    """A tile in global tokens for two DCP sides: ``tokens`` span ``a_blocks`` / ``b_blocks`` kernel blocks per rank."""

    tokens: int
    a_blocks: int
    b_blocks: int


def dcp_tile(a_kernel: int, a: Shard, b_kernel: int, b: Shard) -> DcpTile:
    """The smallest global token span that is a whole number of each side's virtual kernel blocks.

    Post-condition: ``tokens == a_blocks * a_kernel * a.size == b_blocks * b_kernel * b.size``.

    >>> dcp_tile(64, Shard(8, 1, 0), 16, Shard(1, 1, 0))
    DcpTile(tokens=512, a_blocks=1, b_blocks=32)
    """
    t = lcm(a_kernel * a.size, b_kernel * b.size)
    return DcpTile(t, t // (a_kernel * a.size), t // (b_kernel * b.size))


@dataclass(frozen=True)
class TokenRun:
    """Global tokens whose local positions advance together on both sides inside one kernel block each.

    ``a_block`` / ``b_block``: kernel block of the tile on each side; ``a_token`` / ``b_token``:
    slot in it; ``tokens``: length.
    """

    a_block: int
    a_token: int
    b_block: int
    b_token: int
    tokens: int


def dcp_chunks(a_kernel: int, b_kernel: int, pair: ShardPair, tokens: int, start: int = 0) -> list[TokenRun]:
    """Token runs of one tile's global tokens ``[start, tokens)`` that both ranks hold.

    Post-condition: every global token in ``[start, tokens)`` held by both ranks lies in exactly one
    run, and a run is contiguous in both local streams and stays in one kernel block each side.

    >>> [tuple(vars(r).values()) for r in dcp_chunks(4, 4, ShardPair(Shard(1), Shard(2, 1, 1)), 8)]
    [(0, 1, 0, 0, 1), (0, 3, 0, 1, 1), (1, 1, 0, 2, 1), (1, 3, 0, 3, 1)]
    """
    t = np.arange(start, tokens, dtype=np.int64)
    t = t[pair.local.holds(t) & pair.remote.holds(t)]
    if not len(t):
        return []
    ja, jb = pair.local.local(t), pair.remote.local(t)
    ba, bb = ja // a_kernel, jb // b_kernel
    cont = (np.diff(ja) == 1) & (np.diff(jb) == 1) & (np.diff(ba) == 0) & (np.diff(bb) == 0)
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    lens = np.diff(np.append(starts, len(t)))
    return [TokenRun(int(ba[s]), int(ja[s] % a_kernel), int(bb[s]), int(jb[s] % b_kernel), int(n))
            for s, n in zip(starts.tolist(), lens.tolist())]


# ----------------------------------------------------------------------------- ranks of an engine
def engine_ranks(p) -> int:
    """Ranks of one engine (one pipeline stage) of parallelism ``p``: ``tp_size * pcp_size``.

    >>> class P: tp_size, pcp_size, dcp_size = 8, 2, 1
    >>> engine_ranks(P)
    16
    """
    return p.tp_size * p.pcp_size


def tp_rank(p, rank: int) -> int:
    """The TP rank of engine rank ``rank`` (TP is the innermost axis): the heads it holds follow it.

    >>> class P: tp_size, pcp_size, dcp_size = 8, 2, 1
    >>> tp_rank(P, 11)
    3
    """
    return rank % p.tp_size


def dcp_rank(p, rank: int) -> int:
    """The DCP rank of engine rank ``rank``: ``(tp_rank * pcp_size + pcp_rank) % dcp_size``.

    vLLM orders the DCP ranks ``(tp, pcp)`` and cuts them into groups of ``dcp_size``: without
    PCP the TP rank mod D; with D = P the PCP rank; with D = T * P all ranks, PCP fastest.

    >>> class P: tp_size, pcp_size, dcp_size = 2, 2, 4
    >>> [dcp_rank(P, r) for r in range(4)]   # ranks (tp0 pcp0, tp1 pcp0, tp0 pcp1, tp1 pcp1)
    [0, 2, 1, 3]
    >>> class Q: tp_size, pcp_size, dcp_size = 8, 1, 2
    >>> [dcp_rank(Q, r) for r in range(4)]
    [0, 1, 0, 1]
    """
    return (rank % p.tp_size * p.pcp_size + rank // p.tp_size) % p.dcp_size


# ----------------------------------------------------------------------------- spec checks
def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0) if n <= 64 else f"the divisors of {n}"


def check_parallel(p, spec_error) -> None:
    """``dcp_size`` divides ``tp_size`` without PCP (vLLM's DCP groups split the TP group), and is 1,
    ``pcp_size`` or ``tp_size * pcp_size`` with it (``ParallelConfig``); an interleave needs DCP."""
    if p.pcp_size > 1:
        valid = sorted({1, p.pcp_size, p.tp_size * p.pcp_size})
        if p.dcp_size not in valid:
            raise spec_error("with prefill context parallelism dcp_size must be 1 (PCP alone), pcp_size (DCP "
                             "along the PCP ranks) or tp_size * pcp_size (DCP over every rank), as vLLM's "
                             "ParallelConfig requires", expected=f"one of {valid} (tp_size {p.tp_size}, "
                             f"pcp_size {p.pcp_size})", found=str(p.dcp_size), at=("dcp_size",),
                             fix=f"use dcp_size in {', '.join(map(str, valid))}, or pcp_size 1")
    elif p.tp_size % p.dcp_size:
        raise spec_error("dcp_size must divide tp_size (decode context parallelism reuses the TP ranks)",
                         expected=f"a divisor of tp_size {p.tp_size}", found=str(p.dcp_size),
                         at=("dcp_size",), fix=f"use dcp_size in {_divisors(p.tp_size)}")
    if p.dcp_interleave > 1 and p.dcp_size == 1:
        raise spec_error("dcp_interleave needs decode context parallelism", expected="dcp_size > 1",
                         found="dcp_size 1", at=("dcp_interleave",), fix="set dcp_size, or remove dcp_interleave")


def check_interleave(spec, spec_error) -> None:
    """``dcp_interleave`` divides every token group's kernel block size.

    A rank stores runs of ``dcp_interleave`` tokens; vLLM's slot mapping keeps each run in one
    kernel block (``cp_kv_cache_interleave_size`` divides the block size).
    """
    inter = spec.parallel.dcp_interleave
    if inter == 1:
        return
    for g in spec.groups:
        kb = g.kernel_block_size or g.block_size or spec.kernel_block_size or spec.block_size
        if not is_state_kind(g.kind) and kb % inter:
            raise spec_error(f"dcp_interleave {inter} does not divide the kernel block size {kb} of group "
                             f"'{g.name}'", expected=f"a divisor of {kb}", found=str(inter),
                             at=("parallel", "dcp_interleave"),
                             fix="use an interleave that divides every kernel block size")
