"""Content-coded memory: bytes that say what they are, to prove transfers byte by byte.

Every byte of a block gets a value derived from its *content coordinate*:
(region name, field name, global head, source kernel block id, token in block,
the other dims' indices in a canonical (name-sorted) order, byte in element), where the region
is the one the field is part of (``part_of``: K and V of one layer code alike in one joint
tensor and in two split ones).
The coordinate does not depend on dim order or TP, so a head replicated on two
ranks holds the same bytes, and a receiver can compute, independently of any
transfer program, which value each of its bytes must hold after a request.

Used by the pairing proof tests, the runtime tests and ``kvlc demo``: a test oracle, not part of
the compiler. Pure numpy.
"""

from __future__ import annotations

import zlib
from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from kvlc.compiler.algebra.layout import ceildiv, kernel_ids
from kvlc.compiler.algebra.layout import head_range as heads_of
from kvlc.compiler.plan.model import Plan, PlanField, PlanRegion

_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xBF58476D1CE4E5B9)
_M3 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer, vectorized (uint64 → uint64)."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * _M2
        x = x ^ (x >> np.uint64(27))
        x = x * _M3
        return x ^ (x >> np.uint64(31))


def _name_id(text: str) -> np.uint64:
    return np.uint64(zlib.crc32(text.encode()))


@dataclass(frozen=True)
class FieldElements:
    """Every element of one field in one block: byte offset in the block and coordinates."""

    offset: np.ndarray     # int64, byte offset of the element in the block
    head: np.ndarray       # int64 global head (0 for replicated fields)
    token: np.ndarray      # int64 token in block (0 without a token dim)
    other: np.ndarray      # int64 canonical flat index of the other dims
    itemsize: int


def field_elements(f: PlanField, head_start: int) -> FieldElements:
    """Enumerate a field's elements (vectorized) with their coordinates."""
    sizes = [d.size for d in f.dims]
    grids = np.indices(sizes, dtype=np.int64).reshape(len(sizes), -1) if sizes else np.zeros((0, 1), np.int64)
    offset = np.full(grids.shape[1], f.offset, dtype=np.int64)
    head = np.zeros_like(offset)
    token = np.zeros_like(offset)
    other = np.zeros_like(offset)
    plain = sorted((d.name, i) for i, d in enumerate(f.dims) if d.role == "")
    for i, d in enumerate(f.dims):
        offset += grids[i] * d.stride
        if d.role == "head":
            head = grids[i] + head_start
        elif d.role == "token":
            token = grids[i]
    for name, i in plain:
        other = other * f.dims[i].size + grids[i]
    return FieldElements(offset, head, token, other, f.itemsize)


def code(region: str, field: str, head, block, token, other, itemsize: int) -> np.ndarray:
    """The bytes (uint8, ``itemsize`` per element) that encode the given coordinates."""
    with np.errstate(over="ignore"):
        key = _mix(_name_id(region) * _M1 + _name_id(field))
        x = key ^ _mix(np.asarray(head, np.uint64) * np.uint64(1_000_003) + np.asarray(block, np.uint64))
        x = _mix(x ^ (np.asarray(token, np.uint64) << np.uint64(32)) ^ np.asarray(other, np.uint64)).ravel()
        out = np.empty((x.size, itemsize), dtype=np.uint8)
        for b in range(itemsize):
            out[:, b] = (_mix(x + np.uint64(b)) & np.uint64(0xFF)).astype(np.uint8)
    return out


def _head_start(plan: Plan, rank: int, f: PlanField) -> int:
    hd = f.dim("head")   # heads follow the TP rank, the innermost axis of vLLM's (pcp, tp) world
    tp = plan.parallel.tp_size
    return heads_of(rank % tp, hd.global_size, tp)[0] if hd is not None else 0


DCP_KEY = 1 << 20  # above every token-in-block: a DCP rank's slots hold other tokens than its peers'


def _dcp_of(p, rank: int) -> int:
    """vLLM's DCP rank of an engine rank: the world is (pcp, tp) with TP innermost, the DCP groups cut the
    ranks ordered (tp, pcp) into runs of ``dcp_size`` (``parallel_state.initialize_model_parallel``)."""
    tp, pcp = p.tp_size, p.pcp_size
    return ((rank % tp) * pcp + rank // tp) % p.dcp_size


def _dcp_key(p, rank: int) -> int:
    """Part of the token coordinate that names the DCP rank (0 without DCP: codes as before); ``p``: the
    region's parallelism (``Plan.region_parallel``: no DCP where its group is replicated)."""
    return _dcp_of(p, rank) * DCP_KEY


def _global_tokens(p, rank: int, local: np.ndarray) -> np.ndarray:
    """Sequence positions of a rank's local token positions (vLLM's DCP slot mapping, inverted)."""
    return (local // p.dcp_interleave) * p.dcp_interleave * p.dcp_size \
        + _dcp_of(p, rank) * p.dcp_interleave + local % p.dcp_interleave


def _source_slot(p, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where the source engine (region parallelism ``p``) stores sequence position ``t``: local position
    and DCP key."""
    period = p.dcp_interleave * p.dcp_size
    return (t // period) * p.dcp_interleave + t % p.dcp_interleave, ((t // p.dcp_interleave) % p.dcp_size) * DCP_KEY


def page_shares(plan: Plan) -> dict[str, tuple[int, int]]:
    """Group → ``(k, i)``: where the regions of ``k`` groups share one page pool (declared aliases, a hybrid
    engine's pool of pages; joined where they share any), the ``i``-th of them (in plan order) holds its
    content on the pages ``p`` with ``p % k == i`` (:func:`fill`), so a request gives it those pages only
    (:func:`kvlc.demo.workload.make_workload`): a page holds one group's blocks at a time, as in an engine.
    ``(1, 0)`` for a group that shares none."""
    names = [g.name for g in plan.groups]
    of = _shared_pools(plan)
    sets: list[list[str]] = []
    for g in names:
        meet = [s for s in sets if any(of[g] & of[h] for h in s)]
        sets = [s for s in sets if s not in meet] + [[h for s in meet for h in s] + [g]]
    return {g: (len(s), sorted(s, key=names.index).index(g)) for s in sets for g in s}


def _shared_pools(plan: Plan) -> dict[str, set[str]]:
    """Group → the page pools of several regions (declared aliases) that its regions are in. (A region in two
    groups codes alike for both: only other regions on its pages are in the way.)"""
    from kvlc.compiler.plan.aliases import pools

    pool = pools(plan.regions)
    joined = {p for p, n in Counter(pool.values()).items() if n > 1}
    return {g.name: {pool[r.name] for r in plan.regions if g.name in r.groups and pool[r.name] in joined}
            for g in plan.groups}


def own_pages(plan: Plan, group: str, shares: Mapping[str, tuple[int, int]] | None = None) -> np.ndarray:
    """The block ids a request may give ``group`` (:func:`page_shares`, or ``shares`` where the caller has them): all
    of its pool's, or its share."""
    k, i = (page_shares(plan) if shares is None else shares)[group]
    return np.arange(i, plan.group_capacity(group), k, dtype=np.int64)


def fill(plan: Plan, rank: int, buffers: Mapping[str, np.ndarray]) -> None:
    """Write content codes into every block of every region (buffers: storage → uint8 array); a region of a
    shared page pool into its group's pages only (:func:`page_shares`)."""
    shares = page_shares(plan)
    for r in plan.regions:
        buf = buffers[r.storage]
        shared = [g for g in r.groups if shares[g][0] > 1]
        blocks = (_kernel_ids(plan, shared[0], own_pages(plan, shared[0], shares)) if shared
                  else np.arange(r.num_blocks, dtype=np.int64))
        for f in r.fields:
            el = field_elements(f, _head_start(plan, rank, f))
            # every DCP rank holds the whole state (and a replicated group's every token)
            key = 0 if r.is_state else _dcp_key(plan.region_parallel(r), rank)
            vals = code(r.content, f.name, el.head[None, :], blocks[:, None], el.token[None, :] + key,
                        el.other[None, :], el.itemsize)
            addr = (r.offset + blocks[:, None] * r.block_stride + el.offset[None, :]).ravel()
            idx = (addr[:, None] + np.arange(el.itemsize)[None, :]).ravel()
            buf[idx] = vals.ravel()


def _kernel_ids(plan: Plan, group: str, ids: Sequence[int]) -> np.ndarray:
    g = plan.group(group)
    return kernel_ids(np.asarray(ids, dtype=np.int64), 1 if g.is_state else g.kernel_blocks_per_block)


def request_tokens(t) -> dict:
    """A request's tokens as keywords: an int is ``num_tokens``, a (start, stop) pair or range ``tokens``.

    >>> request_tokens(40), request_tokens((16, 40))
    ({'num_tokens': 40}, {'tokens': (16, 40)})
    """
    if isinstance(t, (tuple, list, range)):
        return {"tokens": t if isinstance(t, range) else tuple(t)}
    return {"num_tokens": t}


def _range(num_tokens, tokens, group: str) -> tuple[int, int]:
    if tokens is not None:
        t = tokens[group] if isinstance(tokens, Mapping) else tokens
        return (t.start, t.stop) if isinstance(t, range) else (int(t[0]), int(t[1]))
    return 0, int(num_tokens[group] if isinstance(num_tokens, Mapping) else num_tokens)


def _needed(dst: Plan, group: str, start: int, stop: int) -> int:
    """First token the receiver must get: a sliding window keeps whole blocks with a token >= stop - window + 1."""
    g = dst.group(group)
    if g.kind != "sliding_window":
        return start
    per = g.block_size * dst.group_dcp(group)  # tokens per block id
    first_kept_block = max(0, stop - g.window + 1) // per
    return max(start, first_kept_block * per)


def expected_bytes(dst: Plan, dst_rank: int, src: Plan, dst_ids: Mapping[str, Sequence[int]],
                   src_ids: Mapping[str, Sequence[int]], num_tokens: int | Mapping[str, int] | None = None,
                   regions: Sequence[str] | None = None, tokens=None):
    """Yield ``(storage, byte addresses, expected bytes)`` for one request at the receiver.

    Covers every byte the receiver rank holds in the requested blocks for tokens in
    ``[start, stop)`` (``num_tokens=N``: ``[0, N)``; ``tokens``: ``(start, stop)``, a range,
    or one per group), less what a sliding window no longer needs (whole receiver blocks
    before the one holding token ``stop - window + 1``); all bytes for state regions and
    per-block fields of the blocks moved. Ids list each side's blocks the range touches.
    """
    holders = {(r.content, f.name): r for r in src.regions for f in r.fields}  # who holds a field's content
    for r in dst.regions:
        if regions is not None and r.name not in regions:
            continue
        for group in r.groups:
            dk = _kernel_ids(dst, group, dst_ids[group])
            for f in r.fields:
                sr = holders.get((r.content, f.name))
                if sr is None:
                    continue
                # the sender's ids of the region's group there (a region may be in another group on each side)
                sg = group if group in sr.groups else sr.groups[0]
                sk = _kernel_ids(src, sg, src_ids[sg])
                el = field_elements(f, _head_start(dst, dst_rank, f))
                if r.is_state:
                    keep = np.ones((len(dk), el.offset.size), bool)
                    c = _Cells(dk[:, None], sk[:, None], el.token[None, :], keep)
                else:
                    start, stop = _range(num_tokens, tokens, group)
                    c = _token_cells(_Pair(dst, dst_rank, src, r, sr, group, sg), f, el, dk, sk, start, stop)
                yield r.storage, *_cell_bytes(r, f, el, c)


@dataclass(frozen=True)
class _Pair:
    """One region of one kernel block group, at receiver rank ``dst_rank`` and at the sender (``src_group``: the
    sender's group of ``sr``, another name where the engines put the region in other groups)."""

    dst: Plan
    dst_rank: int
    src: Plan
    r: PlanRegion
    sr: PlanRegion
    group: str
    src_group: str


@dataclass(frozen=True)
class _Cells:
    """Per element of a field in the receiver's blocks (broadcast together): the receiver's kernel
    block, the sender's kernel block and token key it came from, and whether it is expected."""

    blk_d: np.ndarray
    blk_s: np.ndarray
    tok: np.ndarray
    keep: np.ndarray


def _token_cells(p: _Pair, f: PlanField, el: FieldElements, dk: np.ndarray, sk: np.ndarray,
                 start: int, stop: int) -> _Cells:
    """The cells of a field of a token region for tokens ``[start, stop)``."""
    dst, src, r = p.dst, p.src, p.r
    need = _needed(dst, p.group, start, stop)
    dd, ds = dst.region_parallel(r).dcp_size, src.region_parallel(p.sr).dcp_size  # a block id covers bs * dcp
    d0 = start // (dst.group(p.group).block_size * dd) * (dst.group(p.group).block_size // r.block_tokens)
    s0 = start // (src.group(p.src_group).block_size * ds) * (src.group(p.src_group).block_size // p.sr.block_tokens)
    span = r.block_tokens * dd                              # tokens of one kernel block id
    j = np.arange(need // span, ceildiv(stop, span), dtype=np.int64)[:, None]
    blk_d = dk[j - d0]
    if f.dim("token") is None:  # per-block field: same block sizes and sharding (checked at pairing)
        return _Cells(blk_d, sk[j - s0], el.token[None, :] + _dcp_key(dst.region_parallel(r), p.dst_rank),
                      np.ones((len(j), el.offset.size), bool))
    if r.tokens_per_entry > 1:  # entries of tokens_per_entry tokens (DCP refused at pairing)
        return _entry_cells(p, el, blk_d, sk, j, need, stop, s0)
    return _sequence_cells(p, el, blk_d, sk, j, need, stop, s0)


def _entry_cells(p: _Pair, el: FieldElements, blk_d: np.ndarray, sk: np.ndarray, j: np.ndarray,
                 need: int, stop: int, s0: int) -> _Cells:
    """Entries of ``tokens_per_entry`` tokens: every entry holding a needed token moves whole."""
    r, sr = p.r, p.sr
    per = r.tokens_per_entry
    e0, e1 = need // per, ceildiv(stop, per)
    t = j * r.block_entries + el.token[None, :]         # entry position in the sequence
    keep = (t >= e0) & (t < e1)
    t = np.clip(t, e0, e1 - 1)
    return _Cells(blk_d, sk[t // sr.block_entries - s0], t % sr.block_entries, keep)


def _sequence_cells(p: _Pair, el: FieldElements, blk_d: np.ndarray, sk: np.ndarray, j: np.ndarray,
                    need: int, stop: int, s0: int) -> _Cells:
    """One token per entry: each receiver token at its sequence position, from the sender's slot of it."""
    r, sr = p.r, p.sr
    t = _global_tokens(p.dst.region_parallel(r), p.dst_rank, j * r.block_tokens + el.token[None, :])
    keep = (t >= need) & (t < stop)
    t = np.clip(t, need, stop - 1)
    js, key = _source_slot(p.src.region_parallel(sr), t)
    return _Cells(blk_d, sk[js // sr.block_tokens - s0], js % sr.block_tokens + key, keep)


def _cell_bytes(r: PlanRegion, f: PlanField, el: FieldElements, c: _Cells) -> tuple[np.ndarray, np.ndarray]:
    """The receiver's byte addresses of the kept cells and the bytes each must hold."""
    keep = c.keep
    vals = code(r.content, f.name, np.broadcast_to(el.head, keep.shape)[keep],
                np.broadcast_to(c.blk_s, keep.shape)[keep], np.broadcast_to(c.tok, keep.shape)[keep],
                np.broadcast_to(el.other, keep.shape)[keep], el.itemsize)
    addr = (r.offset + np.broadcast_to(c.blk_d, keep.shape) * r.block_stride + el.offset[None, :])[keep]
    idx = (addr[:, None] + np.arange(el.itemsize)[None, :]).ravel()
    return idx, vals.ravel()

