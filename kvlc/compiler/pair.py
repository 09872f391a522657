"""Pairing: two plans and a rank → a frozen transfer program of coalesced run templates.

One general computation covers heterogeneous TP (both ways, GQA replicas,
replicated fields), block-size ratios (also non-divisible ones, through tiles
of lcm(tokens) tokens), kernel blocks, Mamba sections and state, and dim orders:

* the **consumer** is the engine that receives bytes, the **producer** the one
  that sends them. READ: the local engine consumes (pull); WRITE: it produces (push).
* for every consumer rank and field, each head it holds is assigned one
  producer rank that holds it (replicas: spread by consumer rank; replicated
  fields: producer ``consumer_rank % producer_tp``);
* within a tile, each (field, head slice, token chunk of gcd(tokens)) is a
  strided copy; :mod:`kvlc.compiler.algebra` turns it into runs contiguous on
  both sides, merged to the minimum.

Request instantiation (:meth:`TransferProgram.instantiate`) is vectorized numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from math import gcd
from typing import Mapping, NamedTuple, Sequence

import numpy as np

from kvlc.compiler.algebra import coalesce_rows, merge_runs, strided_runs
from kvlc.compiler.compat import CompatReport, Finding, check_plans, head_major_order
from kvlc.compiler.plan import Plan, PlanField, PlanRegion
from kvlc.errors import CompatError, TransferError


# ----------------------------------------------------------------------------- TP mapping
def heads_of(rank: int, heads: int, tp: int) -> tuple[int, int]:
    """Global head range ``[start, stop)`` a rank holds (one head per replica when tp > heads).

    >>> heads_of(3, 8, 4), heads_of(5, 8, 16)
    ((6, 8), (2, 3))
    """
    if heads % tp == 0:
        n = heads // tp
        return rank * n, (rank + 1) * n
    per = tp // heads
    return rank // per, rank // per + 1


def holders(head: int, heads: int, tp: int) -> range:
    """Ranks of an engine of TP ``tp`` that hold global ``head``."""
    if heads % tp == 0:
        r = head // (heads // tp)
        return range(r, r + 1)
    per = tp // heads
    return range(head * per, (head + 1) * per)


@lru_cache(maxsize=4096)
def assign(consumer_rank: int, heads: int, consumer_tp: int, producer_tp: int) -> tuple[tuple[int, int, int], ...]:
    """Producer rank per head slice of one consumer rank: ``((producer, h0, h1), ...)``.

    Each head is read once (replicas deduplicated); among replicas the consumer
    rank picks ``replicas[consumer_rank % len(replicas)]`` so readers spread.

    >>> assign(0, 8, 2, 4)   # TP4 -> TP2: consumer 0 reads heads 0-1 from 0, 2-3 from 1
    ((0, 0, 2), (1, 2, 4))
    >>> assign(1, 8, 16, 2)  # consumer holds one replicated head
    ((0, 0, 1),)
    """
    h0, h1 = heads_of(consumer_rank, heads, consumer_tp)
    if heads % producer_tp == 0:  # no replicas on the producer: intersect contiguous ranges
        per = heads // producer_tp
        return tuple((p, max(h0, p * per), min(h1, (p + 1) * per))
                     for p in range(h0 // per, -(-h1 // per)))
    out: list[list[int]] = []
    for h in range(h0, h1):
        cands = holders(h, heads, producer_tp)
        p = cands[consumer_rank % len(cands)]
        if out and out[-1][0] == p and out[-1][2] == h:
            out[-1][2] = h + 1
        else:
            out.append([p, h, h + 1])
    return tuple(tuple(x) for x in out)


def sources(consumer_rank: int, f: PlanField, consumer_tp: int, producer_tp: int) -> tuple[tuple[int, int, int], ...]:
    """Producer rank per head slice of field ``f`` for one consumer rank (replicated: one rank)."""
    hd = f.dim("head")
    if hd is None:
        return ((consumer_rank % producer_tp, 0, 0),)
    return assign(consumer_rank, hd.global_size, consumer_tp, producer_tp)


# ----------------------------------------------------------------------------- run templates
class Runs(NamedTuple):
    """Run templates of one tile: sub-block and byte offset on each side, and length."""

    kl: np.ndarray
    ol: np.ndarray
    kr: np.ndarray
    orr: np.ndarray
    n: np.ndarray

    def __len__(self) -> int:  # type: ignore[override]
        return len(self.n)

    def key(self) -> tuple:
        return tuple(tuple(a.tolist()) for a in self)


def _field_copy_runs(lf: PlanField, rf: PlanField, head_slice, head0_l: int, head0_r: int,
                     tok) -> tuple[np.ndarray, np.ndarray, int]:
    """Runs copying one head slice and one token chunk of a field from local to remote layout."""
    rdims = {d.name: d for d in rf.dims}
    dims = []
    off_l, off_r = lf.offset, rf.offset
    for d in lf.dims:
        e = rdims[d.name]
        if d.role == "head":
            h0, h1 = head_slice
            size = h1 - h0
            off_l += (h0 - head0_l) * d.stride
            off_r += (h0 - head0_r) * e.stride
        elif d.role == "token":
            t_l, t_r, size = tok
            off_l += t_l * d.stride
            off_r += t_r * e.stride
        else:
            size = d.size
        dims.append((size, d.stride, e.stride))
    return strided_runs(dims, off_l, off_r, lf.itemsize)


@dataclass(frozen=True)
class _Side:
    plan: Plan
    rank: int

    @property
    def tp(self) -> int:
        return self.plan.parallel.tp_size


def tile_runs(lr: PlanRegion, rr: PlanRegion, pieces: Sequence[tuple[str, tuple[int, int], int, int]],
              tokens: int | None = None) -> Runs:
    """Runs of one tile of region ``lr`` (local) ↔ ``rr`` (remote), merged to the minimum.

    ``pieces`` are ``(field, (h0, h1), local head start, remote head start)``;
    ``tokens`` clips a partial last tile (None: a whole tile).
    """
    parts = []
    if lr.is_state:
        chunks = [(0, 0, 0, 0, 0)]
    else:
        bl, br = lr.block_tokens, rr.block_tokens
        g = gcd(bl, br)
        tile = bl * br // g
        limit = tile if tokens is None else tokens
        chunks = []
        for t0 in range(0, limit, g):
            chunks.append((t0 // bl, t0 % bl, t0 // br, t0 % br, min(g, limit - t0)))
    for name, hs, h0l, h0r in pieces:
        lf, rf = lr.field(name), rr.field(name)
        if lf.dim("token") is None:  # per-block field or state: once per tile
            use = chunks[:1] if lr.is_state else [(0, 0, 0, 0, 0)]
        else:
            use = chunks
        for kl, tl, kr, tr, cnt in use:
            lo, ro, run = _field_copy_runs(lf, rf, hs, h0l, h0r, (tl, tr, cnt))
            parts.append((np.full(len(lo), kl), lo, np.full(len(lo), kr), ro, np.full(len(lo), run)))
    if not parts:
        e = np.zeros(0, dtype=np.int64)
        return Runs(e, e, e, e, e)
    cat = [np.concatenate([p[i] for p in parts]).astype(np.int64) for i in range(5)]
    return Runs(*merge_runs(*cat))


# ----------------------------------------------------------------------------- program
@dataclass(frozen=True)
class PartKey:
    """One NIXL request of a transfer: the peer rank and both memory types."""

    peer_rank: int
    local_mem: str
    remote_mem: str

    def __str__(self) -> str:
        return f"peer{self.peer_rank}:{self.local_mem}->{self.remote_mem}"


@dataclass(frozen=True)
class Part:
    """Row-aligned descriptors of one part: ``local[i]`` ↔ ``remote[i]``, (addr, len, dev) uint64."""

    local: np.ndarray
    remote: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.local[:, 1].sum()) if len(self.local) else 0

    def __len__(self) -> int:
        return len(self.local)


@dataclass(frozen=True)
class Entry:
    """One region (in one group) copied with one peer rank: the runs of one tile."""

    region: str
    group: str
    peer: int
    local_mem: str
    remote_mem: str
    tile_tokens: int          # 0 for per-request state
    local_sub: int            # local kernel blocks per tile
    remote_sub: int
    pieces: tuple             # (field, (h0, h1), local head start, remote head start)
    runs: Runs = field(compare=False, repr=False)

    @property
    def key(self) -> PartKey:
        return PartKey(self.peer, self.local_mem, self.remote_mem)

    @property
    def bytes_per_tile(self) -> int:
        return int(self.runs.n.sum())

    def text(self) -> str:
        kind = "state" if not self.tile_tokens else f"tile={self.tile_tokens} sub={self.local_sub}:{self.remote_sub}"
        runs = " ".join(f"{kl}+{ol}>{kr}+{orr}x{n}" for kl, ol, kr, orr, n in zip(*(a.tolist() for a in self.runs)))
        return (f"{self.region} [{self.group}] peer={self.peer} {self.local_mem}->{self.remote_mem} {kind} "
                f"runs={len(self.runs)} bytes={self.bytes_per_tile} | {runs}")


@dataclass(frozen=True)
class _Block:
    """Entries of one part and group whose run templates are identical (vectorized together)."""

    key: PartKey
    group: str
    entries: tuple[int, ...]          # indices into program.entries
    runs: Runs
    tile_tokens: int
    local_sub: int
    remote_sub: int


@dataclass(frozen=True)
class TransferProgram:
    """A checked pairing from one local rank's view; instantiate it per request.

    >>> from kvlc import compile_spec
    >>> from kvlc.compiler.pair import pair
    >>> p = compile_spec("layouts/llama-3.1-8b.yaml")
    >>> prog = pair(p, p, local_rank=0, direction="READ")
    >>> prog.peer_ranks, len(prog.entries)
    ((0,), 32)
    """

    local: Plan = field(repr=False)
    remote: Plan = field(repr=False)
    local_rank: int
    direction: str
    entries: tuple[Entry, ...]
    consumer_counts: Mapping[int, int]
    report: CompatReport = field(repr=False)

    # ------------------------------------------------------------------ summary
    @property
    def peer_ranks(self) -> tuple[int, ...]:
        return tuple(sorted({e.peer for e in self.entries}))

    @property
    def part_keys(self) -> tuple[PartKey, ...]:
        return tuple(dict.fromkeys(e.key for e in self.entries))

    def stats(self) -> dict[PartKey, dict[str, int]]:
        """Descriptors and bytes per tile for each (peer, local mem, remote mem)."""
        out: dict[PartKey, dict[str, int]] = {}
        for e in self.entries:
            s = out.setdefault(e.key, {"entries": 0, "runs_per_tile": 0, "bytes_per_tile": 0})
            s["entries"] += 1
            s["runs_per_tile"] += len(e.runs)
            s["bytes_per_tile"] += e.bytes_per_tile
        return out

    def text(self) -> str:
        """Canonical text: a header, one line per part, one line per entry."""
        lines = [f"program {self.direction} local={self.local.name}@{self.local.digest[:12]} rank={self.local_rank} "
                 f"remote={self.remote.name}@{self.remote.digest[:12]} peers={','.join(map(str, self.peer_ranks))}",
                 "consumer_counts " + " ".join(f"{k}:{v}" for k, v in sorted(self.consumer_counts.items()))]
        for key, s in self.stats().items():
            lines.append(f"part {key} entries={s['entries']} runs/tile={s['runs_per_tile']} "
                         f"bytes/tile={s['bytes_per_tile']}")
        lines.extend("entry " + e.text() for e in self.entries)
        return "\n".join(lines) + "\n"

    @cached_property
    def digest(self) -> str:
        import hashlib
        return hashlib.sha256(self.text().encode()).hexdigest()

    # ------------------------------------------------------------------ hot path
    @cached_property
    def _blocks(self) -> tuple[_Block, ...]:
        groups: dict[tuple, list[int]] = {}
        for i, e in enumerate(self.entries):
            # the geometry (fields, pieces) is part of the key: a partial last tile clips each
            # region by its own layout even where whole tiles copy alike
            k = (e.key, e.group, e.tile_tokens, e.local_sub, e.remote_sub, e.runs.key(),
                 self.local.region(e.region).fields, self.remote.region(e.region).fields, e.pieces)
            groups.setdefault(k, []).append(i)
        out = []
        for (key, group, tt, ls, rs, *_), idx in groups.items():
            e = self.entries[idx[0]]
            out.append(_Block(key, group, tuple(idx), e.runs, tt, ls, rs))
        order = {k: i for i, k in enumerate(self.part_keys)}
        out.sort(key=lambda b: (order[b.key], b.entries[0]))
        return tuple(out)

    @cached_property
    def _geometry(self):
        """Per entry: local/remote storage, region offset, block stride (numpy, for the hot path)."""
        lst = [s.name for s in self.local.storages]
        rst = [s.name for s in self.remote.storages]
        li = {n: i for i, n in enumerate(lst)}
        ri = {n: i for i, n in enumerate(rst)}
        cols = []
        for e in self.entries:
            a, b = self.local.region(e.region), self.remote.region(e.region)
            cols.append((li[a.storage], a.offset, a.block_stride, ri[b.storage], b.offset, b.block_stride))
        return lst, rst, np.array(cols, dtype=np.int64).reshape(-1, 6)

    @cached_property
    def _group_regions(self) -> dict[str, tuple[list[PlanRegion], list[PlanRegion]]]:
        out: dict[str, tuple[list, list]] = {}
        for e in self.entries:
            l, r = out.setdefault(e.group, ([], []))
            lr, rr = self.local.region(e.region), self.remote.region(e.region)
            if lr not in l:
                l.append(lr)
                r.append(rr)
        return out

    @cached_property
    def _smallest(self) -> dict[tuple[str, str], PlanRegion]:
        """Per (side, group): the region with the fewest blocks (bounds every id of the group)."""
        out = {}
        for group, (lregs, rregs) in self._group_regions.items():
            out[("local", group)] = min(lregs, key=lambda r: r.capacity)
            out[("remote", group)] = min(rregs, key=lambda r: r.capacity)
        return out

    def _tail_runs(self, block: _Block, tokens: int) -> Runs:
        cache = self.__dict__.setdefault("_tail_cache", {})
        key = (block.entries[0], tokens)
        if key not in cache:
            e = self.entries[block.entries[0]]
            cache[key] = tile_runs(self.local.region(e.region), self.remote.region(e.region), e.pieces, tokens)
        return cache[key]

    def _check_ids(self, side: str, plan: Plan, group: str, regions: list[PlanRegion], ids,
                   tokens: int | None) -> np.ndarray:
        arr = np.asarray(ids, dtype=np.int64).ravel()
        g = plan.group(group)
        if tokens is not None:
            need = -(-tokens // g.block_size)
            if len(arr) != need:
                raise TransferError(f"group '{group}': {len(arr)} {side} block ids for {tokens} tokens; "
                                    f"expected {need} (block size {g.block_size})")
        if len(arr):
            lo, hi = int(arr.min()), int(arr.max())
            r = self._smallest[(side, group)]
            if lo < 0 or hi >= r.capacity:
                bad = lo if lo < 0 else hi
                raise TransferError(f"{side} block id {bad} out of range for region '{r.name}' "
                                    f"(group '{group}', capacity {r.capacity} blocks)")
        m = 1 if g.is_state else g.kernel_blocks_per_block
        if m > 1:
            arr = (arr[:, None] * m + np.arange(m)[None, :]).ravel()
        return arr

    def bind(self, local_bases: Mapping[str, object],
             remote_bases: Mapping[int, Mapping[str, object]]) -> "BoundProgram":
        """Fix storage base addresses once (per connection); then instantiate per request.

        Bases map storage name → address or (address, device); remote bases are per peer rank.
        """
        lst, rst, _ = self._geometry
        lbase, ldev = _bases(local_bases, lst, self.local)
        rb = {}
        for peer in self.peer_ranks:
            if peer not in remote_bases:
                raise TransferError(f"no remote bases for peer rank {peer} "
                                    f"(the program reads from ranks {list(self.peer_ranks)})")
            rb[peer] = _bases(remote_bases[peer], rst, self.remote)
        return BoundProgram(self, lbase, ldev, rb)

    def instantiate(self, local_bases: Mapping[str, object], remote_bases: Mapping[int, Mapping[str, object]],
                    local_block_ids: Mapping[str, Sequence[int]], remote_block_ids: Mapping[str, Sequence[int]],
                    num_tokens: int | Mapping[str, int], *, coalesce: str = "order") -> dict[PartKey, Part]:
        """Descriptors of one request, per part: ``bind(...)`` then ``instantiate(...)``.

        Block ids are logical, per group name. Every id is checked against every
        region's capacity before any descriptor is built. See
        :meth:`BoundProgram.instantiate` for ``coalesce``.
        """
        ids = self.check_request(local_block_ids, remote_block_ids, num_tokens)
        return self.bind(local_bases, remote_bases)._emit(*ids, coalesce=coalesce)

    def check_request(self, local_block_ids, remote_block_ids, num_tokens):
        """Validate a request's ids (counts, bounds) and expand them to kernel block ids."""
        kids_l: dict[str, np.ndarray] = {}
        kids_r: dict[str, np.ndarray] = {}
        tokens_of: dict[str, int] = {}
        for group, (lregs, rregs) in self._group_regions.items():
            if group not in local_block_ids or group not in remote_block_ids:
                raise TransferError(f"no block ids for group '{group}' "
                                    f"(give local and remote ids for groups {sorted(self._group_regions)})")
            state = lregs[0].is_state
            tok = None
            if not state:
                tok = int(num_tokens[group] if isinstance(num_tokens, Mapping) else num_tokens)
                if tok <= 0:
                    raise TransferError(f"group '{group}': num_tokens must be positive, got {tok}")
                tokens_of[group] = tok
            kids_l[group] = self._check_ids("local", self.local, group, lregs, local_block_ids[group], tok)
            kids_r[group] = self._check_ids("remote", self.remote, group, rregs, remote_block_ids[group], tok)
            if state and len(kids_l[group]) != len(kids_r[group]):
                raise TransferError(f"group '{group}': {len(kids_l[group])} local vs {len(kids_r[group])} "
                                    "remote state blocks; give one remote block per local block")
        return kids_l, kids_r, tokens_of

    @cached_property
    def _whole_blocks(self) -> tuple[bool, ...]:
        """Per block: does each tile copy one whole block, contiguous, on both sides?"""
        _, _, geo = self._geometry
        out = []
        for b in self._blocks:
            r = b.runs
            ok = (len(r) == 1 and b.local_sub == 1 and b.remote_sub == 1
                  and int(r.kl[0]) == 0 and int(r.kr[0]) == 0 and int(r.ol[0]) == 0 and int(r.orr[0]) == 0)
            if ok:
                g = geo[list(b.entries)]
                n = int(r.n[0])
                ok = bool(np.all(g[:, 2] == n) and np.all(g[:, 5] == n))
            out.append(ok)
        return tuple(out)


@dataclass(frozen=True)
class BoundProgram:
    """A program with storage bases fixed: the per-request hot path."""

    program: TransferProgram
    lbase: np.ndarray
    ldev: np.ndarray
    rbases: Mapping[int, tuple[np.ndarray, np.ndarray]]

    def instantiate(self, local_block_ids: Mapping[str, Sequence[int]],
                    remote_block_ids: Mapping[str, Sequence[int]],
                    num_tokens: int | Mapping[str, int], *, coalesce: str = "order") -> dict[PartKey, Part]:
        """Descriptors of one request, per part.

        ``coalesce="order"`` (the hot path, O(N)): within each region and group the
        descriptors are the coalesced minimum; across regions and groups rows merge
        where they continue in request order. ``coalesce="sort"`` sorts each part by
        address first and reaches the minimum for the whole part, at O(N log N).
        """
        ids = self.program.check_request(local_block_ids, remote_block_ids, num_tokens)
        return self._emit(*ids, coalesce=coalesce)

    def _emit(self, kids_l, kids_r, tokens_of, coalesce: str = "order") -> dict[PartKey, Part]:
        if coalesce not in ("order", "sort"):
            raise ValueError(f"coalesce must be 'order' or 'sort', got {coalesce!r}")
        prog = self.program
        _, _, geo = prog._geometry
        # Pass 1: per block, the arguments of its row pieces (no rows yet) and the rows per part.
        # Pass 2 writes every piece straight into one (N, 3) array per side and part: no
        # intermediate arrays, no concatenation (fresh memory is what costs most here).
        jobs = []
        sizes: dict[PartKey, int] = {}
        segments: dict = {}
        for b, whole in zip(prog._blocks, prog._whole_blocks):
            kl, kr = kids_l[b.group], kids_r[b.group]
            rbase, rdev = self.rbases[b.key.peer_rank]
            g = geo[list(b.entries)]
            if b.tile_tokens:
                full, tail = divmod(tokens_of[b.group], b.tile_tokens)
            else:
                full, tail = len(kl), 0
            lb = self.lbase[g[:, 0]] + g[:, 1]
            rbb = rbase[g[:, 3]] + g[:, 4]
            ldev, rdv = self.ldev[g[:, 0]], rdev[g[:, 3]]
            pieces = []
            if full and whole:
                if b.group not in segments:
                    cont = (kl[1:full] == kl[:full - 1] + 1) & (kr[1:full] == kr[:full - 1] + 1)
                    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
                    lens = np.diff(np.append(starts, full))
                    segments[b.group] = (kl[starts], kr[starts], lens)
                sl, sr, lens = segments[b.group]
                n = int(b.runs.n[0])
                pieces.append((sl, g[:, 2], lb, None, sr, g[:, 5], rbb, None, lens * n, ldev, rdv))
            elif full:
                pieces.append(self._tiles(b.runs, 0, full, b, kl, kr, g, lb, rbb, ldev, rdv))
            if tail:
                pieces.append(self._tiles(prog._tail_runs(b, tail), full, 1, b, kl, kr, g, lb, rbb, ldev, rdv))
            pieces = [a for a in pieces if a is not None and len(a[0])]
            if not pieces:
                continue
            rows = len(g) * sum(len(a[0]) for a in pieces)
            jobs.append((b.key, len(g), pieces, rows))
            sizes[b.key] = sizes.get(b.key, 0) + rows
        # Every part, both sides, in ONE allocation (parts are views of it): fresh memory is
        # what costs most here, and the allocator reuses one block across requests far more
        # often than several (measured: benchmarks/README.md, "Pairing & instantiation").
        whole_buf = np.empty((2, sum(sizes.values()), 3), dtype=np.int64)
        bufs, at = {}, 0
        for key, n in sizes.items():
            bufs[key] = whole_buf[:, at:at + n]
            at += n
        pos = dict.fromkeys(sizes, 0)
        for key, E, pieces, rows in jobs:
            p0 = pos[key]
            pos[key] = p0 + rows
            K = rows // E
            lv = bufs[key][0][p0:p0 + rows].reshape(E, K, 3)
            rv = bufs[key][1][p0:p0 + rows].reshape(E, K, 3)
            k0 = 0
            for a in pieces:
                k = len(a[0])
                _rows(*a, out=(lv[:, k0:k0 + k], rv[:, k0:k0 + k]))
                k0 += k
        out = {}
        for key, (local, remote) in bufs.items():
            if coalesce == "sort" and len(local) > 1:
                order = np.lexsort((local[:, 0], local[:, 2]))
                local, remote = local[order], remote[order]
            local, remote = _coalesce(local.view(np.uint64), remote.view(np.uint64))
            out[key] = Part(local, remote)
        return out

    def _tiles(self, runs: Runs, first: int, count: int, b: _Block, kl, kr, g, lb, rbb, ldev, rdev):
        """Arguments of :func:`_rows` for ``count`` tiles from tile ``first`` (None without runs)."""
        if not len(runs):
            return None
        tiles = np.arange(first, first + count, dtype=np.int64)[:, None]
        il = kl[tiles * b.local_sub + runs.kl[None, :]].ravel()          # (F*M,) kernel ids
        ir = kr[tiles * b.remote_sub + runs.kr[None, :]].ravel()
        return (il, g[:, 2], lb, np.tile(runs.ol, count), ir, g[:, 5], rbb, np.tile(runs.orr, count),
                np.tile(runs.n, count), ldev, rdev)

    # ------------------------------------------------------------------ prepared (strided) lists
    def prepared_rows(self) -> dict[PartKey, "PreparedLists"]:
        """Strided (R, 5) descriptor lists per part, to prepare once per connection.

        One row pair per (entry, run of the entry's whole-tile template), local and remote
        aligned: ``(base + region offset + run offset, run length, device, block stride,
        num kernel blocks of the region)`` for each side. NIXL expands a row to ``count``
        descriptors; the expanded index ``start + kernel_block_id`` is that run in that kernel
        block (``start`` per row: :attr:`PreparedLists.local_start` / ``remote_start``).
        Indices into these lists come from :meth:`prepared_indices`.

        Raises :class:`TransferError` when a part's expanded list has more than 2**31
        descriptors (``make_prepped_xfer`` takes int32 indices); such a part needs the
        (N, 3) rows of :meth:`instantiate`. Cached: computed once per bound program.
        """
        got = self.__dict__.get("_prepared_rows_cache")
        if got is None:
            got = _prepared_rows(self)
            self.__dict__["_prepared_rows_cache"] = got
        return got

    def prepared_indices(self, local_block_ids: Mapping[str, Sequence[int]],
                         remote_block_ids: Mapping[str, Sequence[int]],
                         num_tokens: int | Mapping[str, int]) -> "PreparedRequest":
        """One request against the lists of :meth:`prepared_rows`: indices plus a direct tail.

        Returns ``PreparedRequest(indices, tail)``:

        * ``indices[key] = (local_idx, remote_idx)``, int32 arrays of equal length that address
          the *expanded* descriptors of ``prepared_rows()[key]``: pass them to
          ``make_prepped_xfer``. They cover every **whole** tile of the request (every state
          block of a state region), one index per run per tile, entry by entry. Parts without
          a whole tile are absent.
        * ``tail[key]``: the clipped partial last tile of each region (tokens not a multiple of
          the tile), as ordinary (N, 3) :class:`Part` rows, for a direct transfer
          (``initialize_xfer``). Empty when tokens fill whole tiles.

        Together they move exactly the bytes of :meth:`instantiate` (more descriptors: runs
        of consecutive blocks are not merged). Ids are checked like :meth:`instantiate`
        (:meth:`TransferProgram.check_request`) before anything is built.
        """
        ids = self.program.check_request(local_block_ids, remote_block_ids, num_tokens)
        return _prepared_indices(self, *ids)


_CHUNK = 8192  # rows per step of the continuity test: temporaries stay small and in cache


def _coalesce(local: np.ndarray, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`~kvlc.compiler.algebra.coalesce_rows`, same result, without large temporaries.

    Tests chunk by chunk, in two small reused buffers, whether any row continues the previous
    one on both sides; only then (something may merge) it calls ``coalesce_rows``. Rows that
    continue in address but not in device do not merge there either.
    """
    if len(local) < 2:
        return local, remote
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


def _rows(il, lstride, lbase, loff, ir, rstride, rbase, roff, n, ldev, rdev, out=None):
    """Descriptor rows for E entries x K runs, written in place into two (E, K, 3) int64 arrays
    (``out``: two views to write into; new arrays without it).

    Address of run k of entry e: ``base[e] + id[k] * stride[e] + off[k]`` on each side.
    """
    E, K = len(lbase), len(il)
    res = []
    for i, (ids, stride, base, off, dev) in enumerate(((il, lstride, lbase, loff, ldev),
                                                       (ir, rstride, rbase, roff, rdev))):
        rows = np.empty((E, K, 3), dtype=np.int64) if out is None else out[i]
        addr = rows[:, :, 0]
        np.multiply(ids[None, :], stride[:, None], out=addr)
        addr += base[:, None]
        if off is not None:
            addr += off[None, :]
        rows[:, :, 1] = n[None, :]
        rows[:, :, 2] = dev[:, None]
        res.append(rows)
    return res[0], res[1]


def _bases(bases: Mapping[str, object], names: list[str], plan: Plan) -> tuple[np.ndarray, np.ndarray]:
    addr = np.empty(len(names), dtype=np.int64)
    dev = np.empty(len(names), dtype=np.int64)
    devices = None
    for i, name in enumerate(names):
        v = bases.get(name)
        if v is None:
            raise TransferError(f"no base address for storage '{name}' of plan '{plan.name}'")
        if isinstance(v, (tuple, list)):
            addr[i], dev[i] = int(v[0]), int(v[1])
        else:
            if devices is None:
                devices = {s.name: s.device for s in plan.storages}
            addr[i], dev[i] = int(v), devices[name]
    return addr, dev


# ----------------------------------------------------------------------------- pairing
def _consumer_counts(cons: Plan, prod: Plan, regions: list[str]) -> dict[int, int]:
    ctp, ptp = cons.parallel.tp_size, prod.parallel.tp_size
    readers: dict[int, set] = {p: set() for p in range(ptp)}
    seen = set()
    for name in regions:
        for f in cons.region(name).fields:
            hd = f.dim("head")
            key = (hd.global_size if hd else None)
            if key in seen:
                continue
            seen.add(key)
            for c in range(ctp):
                for p, _, _ in sources(c, f, ctp, ptp):
                    readers[p].add(c)
    return {p: len(c) for p, c in readers.items()}


def _pieces(cons_rank: int, cons: Plan, prod: Plan, lr: PlanRegion, local_is_consumer: bool):
    """Per producer rank: the (field, head slice, local head start, remote head start) pieces."""
    ctp, ptp = cons.parallel.tp_size, prod.parallel.tp_size
    out: dict[int, list] = {}
    for f in lr.fields:
        hd = f.dim("head")
        for p, h0, h1 in sources(cons_rank, f, ctp, ptp):
            if hd is None:
                piece = (f.name, (0, 0), 0, 0)
            else:
                c0 = heads_of(cons_rank, hd.global_size, ctp)[0]
                p0 = heads_of(p, hd.global_size, ptp)[0]
                piece = (f.name, (h0, h1), c0, p0) if local_is_consumer else (f.name, (h0, h1), p0, c0)
            out.setdefault(p, []).append(piece)
    return out


def check_pair(local_plan: Plan, remote_plan: Plan, *, local_rank: int, direction: str) -> CompatReport:
    """Every compatibility finding of a pairing; never raises for a mismatch."""
    report = check_plans(local_plan, remote_plan, local_rank, direction)
    if not report.ok:
        return report
    return _with_warnings(report, _build(local_plan, remote_plan, local_rank, direction, report))


def _with_warnings(report: CompatReport, prog: "TransferProgram") -> CompatReport:
    return CompatReport(report.local, report.remote, report.direction, report.local_rank,
                        report.findings + tuple(_explosions(prog)))


def _explosions(prog: "TransferProgram") -> list[Finding]:
    """Warn where a field needs about one descriptor per token per tile (token-major + hetero TP)."""
    local, remote = prog.local, prog.remote
    out: dict[tuple, list] = {}
    for e in prog.entries:
        if not e.tile_tokens or e.tile_tokens < 2:
            continue
        lr, rr = local.region(e.region), remote.region(e.region)
        for name in dict.fromkeys(p[0] for p in e.pieces):
            lf, rf = lr.field(name), rr.field(name)
            if lf.dim("token") is None or lf.dim("head") is None:
                continue
            key = (name, lf, rf, lr.block_tokens, rr.block_tokens, e.tile_tokens)
            if key in out:
                out[key][1].append(e.region)
                continue
            pcs = tuple(p for p in e.pieces if p[0] == name)
            n = len(tile_runs(lr, rr, pcs))
            out[key] = [n, [e.region], lf, rf, e.tile_tokens] if n >= e.tile_tokens else [0, [], None, None, 0]
    findings = []
    for (name, *_), (n, regions, lf, rf, tt) in out.items():
        if not n:
            continue
        regions = list(dict.fromkeys(regions))
        more = f" and {len(regions) - 1} more region(s)" if len(regions) > 1 else ""
        findings.append(Finding("descriptor-explosion", "warning",
                                f"{n} descriptors per {tt}-token tile (about one per token) because a head "
                                f"slice is not contiguous in a token-major order (and in{more[4:]})" if more else
                                f"{n} descriptors per {tt}-token tile (about one per token) because a head "
                                "slice is not contiguous in a token-major order",
                                regions[0], name, local=_order(lf), remote=_order(rf),
                                fix=f"order dims {head_major_order(lf)} on both engines (HND)"))
    return findings


def _order(f: PlanField) -> str:
    return "(" + ", ".join(d.name for d in f.dims) + ")"


def _build(local: Plan, remote: Plan, rank: int, direction: str, report) -> TransferProgram:
    local_is_consumer = direction == "READ"
    cons, prod = (local, remote) if local_is_consumer else (remote, local)
    rset = {r.name for r in remote.regions}
    names = [r.name for r in local.regions if r.name in rset]
    cons_ranks = [rank] if local_is_consumer else range(cons.parallel.tp_size)
    cache: dict = {}
    entries = []
    for name in names:
        lr, rr = local.region(name), remote.region(name)
        by_peer: dict[int, list] = {}
        for c in cons_ranks:
            for p, pieces in _pieces(c, cons, prod, cons.region(name), local_is_consumer).items():
                if local_is_consumer:
                    by_peer[p] = pieces
                elif p == rank:
                    by_peer[c] = pieces
        for peer in sorted(by_peer):
            pieces = tuple(by_peer[peer])
            key = (lr.fields, rr.fields, lr.block_tokens, rr.block_tokens, pieces)
            if key not in cache:
                cache[key] = tile_runs(lr, rr, pieces)
            runs = cache[key]
            if lr.is_state:
                tt, ls, rs = 0, 1, 1
            else:
                g = gcd(lr.block_tokens, rr.block_tokens)
                tt = lr.block_tokens * rr.block_tokens // g
                ls, rs = tt // lr.block_tokens, tt // rr.block_tokens
            for group in lr.groups:
                entries.append(Entry(name, group, peer, lr.mem, rr.mem, tt, ls, rs, pieces, runs))
    counts = _consumer_counts(cons, prod, names)
    return TransferProgram(local, remote, rank, direction, tuple(entries), counts, report)


def pair(local_plan: Plan, remote_plan: Plan, *, local_rank: int, direction: str = "READ") -> TransferProgram:
    """Check two plans and build the transfer program, or raise :class:`CompatError`."""
    report = check_plans(local_plan, remote_plan, local_rank, direction)
    if not report.ok:
        raise CompatError(report)
    prog = _build(local_plan, remote_plan, local_rank, direction, report)
    return replace(prog, report=_with_warnings(report, prog))


# ----------------------------------------------------------------------------- prepared (strided) lists
INDEX_LIMIT = 1 << 31  # descriptors an expanded list may hold: make_prepped_xfer takes int32 indices


@dataclass(frozen=True)
class PreparedLists:
    """Strided descriptor lists of one part (see :meth:`BoundProgram.prepared_rows`).

    ``local[r]`` and ``remote[r]`` are (addr, len, dev, stride, count) uint64 rows of the same
    (``entry[r]``, ``run[r]``): program entry index and run index in its whole-tile template.
    Expanded index ``local_start[r] + k`` is that run in local kernel block ``k`` (same for
    remote). ``local_size`` / ``remote_size``: descriptors of each expanded list.
    """

    key: PartKey
    local: np.ndarray
    remote: np.ndarray
    entry: np.ndarray
    run: np.ndarray
    local_start: np.ndarray
    remote_start: np.ndarray

    @property
    def local_size(self) -> int:
        return int(self.local[:, 4].sum()) if len(self.local) else 0

    @property
    def remote_size(self) -> int:
        return int(self.remote[:, 4].sum()) if len(self.remote) else 0

    def __len__(self) -> int:
        return len(self.local)


class PreparedRequest(NamedTuple):
    """One request for prepared lists: int32 index pairs per part (whole tiles) and a direct tail.

    ``nbytes[key]``: bytes the indices of part ``key`` move (the tail's are in its rows).
    """

    indices: dict
    tail: dict
    nbytes: dict


def _prepared_layout(prog: TransferProgram):
    """Base-independent layout of the strided lists: per part its entries and the expanded start
    of each (entry, run); per block of ``prog._blocks`` the (E, M) starts on each side."""
    got = prog.__dict__.get("_prepared_layout_cache")
    if got is not None:
        return got
    parts: dict[PartKey, list] = {}
    first: dict[int, tuple[int, int, int, int]] = {}
    for i, e in enumerate(prog.entries):
        lr, rr = prog.local.region(e.region), prog.remote.region(e.region)
        p = parts.setdefault(e.key, [[], 0, 0])
        first[i] = (p[1], p[2], lr.num_blocks, rr.num_blocks)
        p[0].append(i)
        p[1] += len(e.runs) * lr.num_blocks
        p[2] += len(e.runs) * rr.num_blocks
    for key, (_, nl, nr) in parts.items():
        for side, n in (("local", nl), ("remote", nr)):
            if n > INDEX_LIMIT:
                raise TransferError(
                    f"part {key}: the strided {side} list expands to {n:,} descriptors, more than "
                    f"make_prepped_xfer's int32 indices address ({INDEX_LIMIT:,}); use instantiate() "
                    "(direct (N, 3) rows) for this part")
    blocks = []
    for b in prog._blocks:
        s = np.array([first[i] for i in b.entries], dtype=np.int64).reshape(-1, 4)
        j = np.arange(len(b.runs), dtype=np.int64)[None, :]
        blocks.append((s[:, 0:1] + j * s[:, 2:3], s[:, 1:2] + j * s[:, 3:4]))
    got = ({k: tuple(v[0]) for k, v in parts.items()}, first, tuple(blocks))
    prog.__dict__["_prepared_layout_cache"] = got
    return got


def _prepared_rows(bound: BoundProgram) -> dict[PartKey, PreparedLists]:
    prog = bound.program
    parts, first, _ = _prepared_layout(prog)
    _, _, geo = prog._geometry
    out = {}
    for key, ents in parts.items():
        rbase, rdev = bound.rbases[key.peer_rank]
        side_rows: list[list[np.ndarray]] = [[], []]
        ent, run, starts = [], [], [[], []]
        for i in ents:
            e, g = prog.entries[i], geo[i]
            m = len(e.runs)
            j = np.arange(m, dtype=np.int64)
            for s, (base, dev, off, stride, count, start) in enumerate((
                    (bound.lbase[g[0]] + g[1], bound.ldev[g[0]], e.runs.ol, g[2], first[i][2], first[i][0]),
                    (rbase[g[3]] + g[4], rdev[g[3]], e.runs.orr, g[5], first[i][3], first[i][1]))):
                rows = np.empty((m, 5), dtype=np.int64)
                rows[:, 0] = base + off
                rows[:, 1] = e.runs.n
                rows[:, 2] = dev
                rows[:, 3] = stride
                rows[:, 4] = count
                side_rows[s].append(rows)
                starts[s].append(start + j * count)
            ent.append(np.full(m, i, dtype=np.int64))
            run.append(j)
        cat = lambda xs, shape: np.concatenate(xs) if xs else np.zeros(shape, dtype=np.int64)  # noqa: E731
        out[key] = PreparedLists(key, cat(side_rows[0], (0, 5)).view(np.uint64),
                                 cat(side_rows[1], (0, 5)).view(np.uint64), cat(ent, 0), cat(run, 0),
                                 cat(starts[0], 0), cat(starts[1], 0))
    return out


def _prepared_indices(bound: BoundProgram, kids_l, kids_r, tokens_of) -> PreparedRequest:
    prog = bound.program
    _, _, blocks = _prepared_layout(prog)
    _, _, geo = prog._geometry
    idx: dict[PartKey, tuple[list, list]] = {}
    tails: dict[PartKey, tuple[list, list]] = {}
    moved: dict[PartKey, int] = {}
    for b, (sl, sr) in zip(prog._blocks, blocks):
        kl, kr = kids_l[b.group], kids_r[b.group]
        if b.tile_tokens:
            full, tail = divmod(tokens_of[b.group], b.tile_tokens)
        else:
            full, tail = len(kl), 0
        if full and len(b.runs):
            t = np.arange(full, dtype=np.int64)[:, None]
            il = kl[t * b.local_sub + b.runs.kl[None, :]]           # (F, M) kernel ids
            ir = kr[t * b.remote_sub + b.runs.kr[None, :]]
            idx.setdefault(b.key, []).append((sl, il, sr, ir))
            moved[b.key] = moved.get(b.key, 0) + int(b.runs.n.sum()) * full * len(b.entries)
        if tail:
            g = geo[list(b.entries)]
            rbase, rdev = bound.rbases[b.key.peer_rank]
            a = bound._tiles(prog._tail_runs(b, tail), full, 1, b, kl, kr, g,
                             bound.lbase[g[:, 0]] + g[:, 1], rbase[g[:, 3]] + g[:, 4],
                             bound.ldev[g[:, 0]], rdev[g[:, 3]])
            if a is not None and len(a[0]):
                lrows, rrows = _rows(*a)
                lt, rt = tails.setdefault(b.key, ([], []))
                lt.append(lrows.reshape(-1, 3))
                rt.append(rrows.reshape(-1, 3))
    indices = {}
    for key, jobs in idx.items():
        # (E, F, M) per block: entry, tile, run; written straight into one int32 array per side.
        # Every index is below the expanded size, checked against INDEX_LIMIT by _prepared_layout.
        n = sum(sl.size // sl.shape[1] * il.size for sl, il, _, _ in jobs)
        buf = np.empty((2, n), dtype=np.int32)
        p0 = 0
        for sl, il, sr, ir in jobs:
            shape = (sl.shape[0], il.shape[0], il.shape[1])
            k = shape[0] * shape[1] * shape[2]
            np.add(sl[:, None, :], il[None, :, :], out=buf[0, p0:p0 + k].reshape(shape), casting="unsafe")
            np.add(sr[:, None, :], ir[None, :, :], out=buf[1, p0:p0 + k].reshape(shape), casting="unsafe")
            p0 += k
        indices[key] = (buf[0], buf[1])
    tail_parts = {}
    for key, (lt, rt) in tails.items():
        local, remote = _coalesce(np.concatenate(lt).view(np.uint64), np.concatenate(rt).view(np.uint64))
        tail_parts[key] = Part(local, remote)
    return PreparedRequest(indices, tail_parts, {k: moved[k] for k in indices})
