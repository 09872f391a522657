"""Per request, alternative — prepared (strided) descriptor lists and int32 indices into them.

Once per connection, :func:`prepared_rows` gives each part strided ``(R, 5)`` lists
(one row per entry and run, expanded by NIXL to one descriptor per kernel block);
per request, :func:`prepared_indices` gives the int32 index pairs of every whole tile
and ordinary rows for a clipped last tile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from kvlc.compiler.frozen import FrozenMap
from kvlc.compiler.pairing.program import Part, PartKey, TransferProgram
from kvlc.compiler.request.bind import BoundProgram
from kvlc.compiler.request.check import Request, block_tiles, check_request
from kvlc.compiler.request.index import program_index
from kvlc.compiler.request.rows import coalesce
from kvlc.compiler.request.tiles import partial_rows
from kvlc.errors import TransferError

INDEX_LIMIT = 1 << 31  # descriptors an expanded list may hold: make_prepped_xfer takes int32 indices


@dataclass(frozen=True, eq=False)
class PreparedLists:
    """Strided descriptor lists of one part (see :func:`prepared_rows`).

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


@dataclass(frozen=True, eq=False)
class PreparedRequest:
    """One request for prepared lists: int32 index pairs per part (whole tiles) and a direct tail.

    ``indices[key] = (local_idx, remote_idx)``; ``tail[key]``: a :class:`Part`;
    ``nbytes[key]``: bytes the indices of part ``key`` move (the tail's are in its rows).
    """

    indices: dict
    tail: dict
    nbytes: dict


@dataclass(frozen=True, eq=False)
class EntryStarts:
    """Per program entry: where its runs start in the expanded lists, and its kernel blocks, per side."""

    local_start: np.ndarray
    remote_start: np.ndarray
    local_blocks: np.ndarray
    remote_blocks: np.ndarray


@dataclass(frozen=True, eq=False)
class BlockStarts:
    """Per index block: the (E, M) expanded start of each (entry, run) on each side."""

    local: np.ndarray
    remote: np.ndarray


@dataclass(frozen=True, eq=False)
class PreparedLayout:
    """Base-independent layout of the strided lists of a program."""

    parts: FrozenMap          # PartKey -> entry indices of that part, in order
    starts: EntryStarts
    blocks: tuple[BlockStarts, ...]   # aligned with program_index(program).blocks


def _check_limit(key: PartKey, side: str, n: int) -> None:
    if n > INDEX_LIMIT:
        raise TransferError(
            f"part {key}: the strided {side} list expands to {n:,} descriptors, more than "
            f"make_prepped_xfer's int32 indices address ({INDEX_LIMIT:,}); use instantiate() "
            "(direct (N, 3) rows) for this part")


def layout_of(prog: TransferProgram) -> PreparedLayout:
    """Where each entry's runs start in its part's expanded lists (cached per program)."""
    return prog.memo.get("prepared_layout", lambda: _layout(prog))


def _layout(prog: TransferProgram) -> PreparedLayout:
    n = len(prog.entries)
    ls, rs, lb, rb = (np.zeros(n, dtype=np.int64) for _ in range(4))
    parts: dict[PartKey, list[int]] = {}
    size: dict[tuple[PartKey, str], int] = {}
    for i, e in enumerate(prog.entries):
        lr, rr = prog.local.region(e.region), prog.remote.region(e.remote_region)
        parts.setdefault(e.key, []).append(i)
        ls[i], rs[i] = size.get((e.key, "local"), 0), size.get((e.key, "remote"), 0)
        lb[i], rb[i] = lr.num_blocks, rr.num_blocks
        size[(e.key, "local")] = ls[i] + len(e.runs) * lr.num_blocks
        size[(e.key, "remote")] = rs[i] + len(e.runs) * rr.num_blocks
    for (key, side), total in size.items():
        _check_limit(key, side, int(total))
    starts = EntryStarts(ls, rs, lb, rb)
    blocks = []
    for b in program_index(prog).blocks:
        ents = np.array(b.entries, dtype=np.int64)
        j = np.arange(len(b.runs), dtype=np.int64)[None, :]
        blocks.append(BlockStarts(ls[ents][:, None] + j * lb[ents][:, None],
                                  rs[ents][:, None] + j * rb[ents][:, None]))
    return PreparedLayout(FrozenMap((k, tuple(v)) for k, v in parts.items()), starts, tuple(blocks))


def _side_rows(base, dev, offsets, length, stride, count) -> np.ndarray:
    rows = np.empty((len(length), 5), dtype=np.int64)
    rows[:, 0] = base + offsets
    rows[:, 1] = length
    rows[:, 2] = dev
    rows[:, 3] = stride
    rows[:, 4] = count
    return rows


def _cat(xs, shape) -> np.ndarray:
    return np.concatenate(xs) if xs else np.zeros(shape, dtype=np.int64)


def _part_lists(bound: BoundProgram, key: PartKey, ents, lay: PreparedLayout) -> PreparedLists:
    prog, idx, st = bound.program, program_index(bound.program), lay.starts
    rb = bound.remote[key.peer_rank]
    lrows, rrows, ent, run, lstart, rstart = [], [], [], [], [], []
    for i in ents:
        e = prog.entries[i]
        j = np.arange(len(e.runs), dtype=np.int64)
        s_l, s_r = int(idx.local.storage[i]), int(idx.remote.storage[i])
        lrows.append(_side_rows(bound.local.addr[s_l] + idx.local.offset[i], bound.local.device[s_l],
                                e.runs.local_offset, e.runs.length, idx.local.stride[i], st.local_blocks[i]))
        rrows.append(_side_rows(rb.addr[s_r] + idx.remote.offset[i], rb.device[s_r],
                                e.runs.remote_offset, e.runs.length, idx.remote.stride[i], st.remote_blocks[i]))
        lstart.append(st.local_start[i] + j * st.local_blocks[i])
        rstart.append(st.remote_start[i] + j * st.remote_blocks[i])
        ent.append(np.full(len(j), i, dtype=np.int64))
        run.append(j)
    return PreparedLists(key, _cat(lrows, (0, 5)).view(np.uint64), _cat(rrows, (0, 5)).view(np.uint64),
                         _cat(ent, 0), _cat(run, 0), _cat(lstart, 0), _cat(rstart, 0))


def prepared_rows(bound: BoundProgram) -> dict[PartKey, PreparedLists]:
    """Strided (R, 5) descriptor lists per part, to prepare once per connection (made once per binding).

    One row pair per (entry, run of the entry's whole-tile template), local and remote
    aligned: ``(base + region offset + run offset, run length, device, block stride,
    num kernel blocks of the region)`` for each side. NIXL expands a row to ``count``
    descriptors; the expanded index ``start + kernel_block_id`` is that run in that kernel
    block (``start`` per row: :attr:`PreparedLists.local_start` / ``remote_start``).

    Raises :class:`TransferError` when a part's expanded list has more than 2**31
    descriptors (``make_prepped_xfer`` takes int32 indices); such a part needs the
    (N, 3) rows of :func:`~kvlc.compiler.request.instantiate.instantiate`.

    >>> from kvlc import bind, compile_spec, pair
    >>> plan = compile_spec("layouts/llama-3.1-8b.yaml")
    >>> prog = pair(plan, plan, local_rank=0, direction="READ")
    >>> bound = bind(prog, {s.name: 1 << 40 for s in plan.storages}, {0: {s.name: 2 << 40 for s in plan.storages}})
    >>> lists = prepared_rows(bound)
    >>> [(str(k), len(pl), pl.local_size) for k, pl in lists.items()]   # one strided row per region
    [('peer0:VRAM->VRAM', 32, 131072)]
    """
    return bound.memo.get("prepared_rows", lambda: _lists(bound))


def _lists(bound: BoundProgram) -> dict[PartKey, PreparedLists]:
    lay = layout_of(bound.program)
    return {key: _part_lists(bound, key, ents, lay) for key, ents in lay.parts.items()}


def _indices(jobs) -> tuple[np.ndarray, np.ndarray]:
    # (E, F, M) per block: entry, tile, run; written straight into one int32 array per side.
    # Every index is below the expanded size, checked against INDEX_LIMIT by the layout.
    n = sum(s.local.shape[0] * il.size for s, il, _ in jobs)
    buf = np.empty((2, n), dtype=np.int32)
    p0 = 0
    for s, il, ir in jobs:
        shape = (s.local.shape[0], il.shape[0], il.shape[1])
        k = shape[0] * shape[1] * shape[2]
        np.add(s.local[:, None, :], il[None, :, :], out=buf[0, p0:p0 + k].reshape(shape), casting="unsafe")
        np.add(s.remote[:, None, :], ir[None, :, :], out=buf[1, p0:p0 + k].reshape(shape), casting="unsafe")
        p0 += k
    return buf[0], buf[1]


def prepared_indices(bound: BoundProgram, local_block_ids: Mapping[str, Sequence[int]],
                     remote_block_ids: Mapping[str, Sequence[int]],
                     num_tokens: int | Mapping[str, int] | None = None, *, tokens=None) -> PreparedRequest:
    """One request against the lists of :func:`prepared_rows`: indices plus a direct tail.

    The ids, ``num_tokens`` (a count) and ``tokens`` are checked as by
    :func:`~kvlc.compiler.request.check.check_request`.

    * ``indices[key] = (local_idx, remote_idx)``, int32 arrays of equal length that address
      the *expanded* descriptors of ``prepared_rows()[key]``: pass them to
      ``make_prepped_xfer``. They cover every **whole** tile of the request (every state
      block of a state region), one index per run per tile, entry by entry. Parts without
      a whole tile are absent.
    * ``tail[key]``: the clipped partial last tile of each region (tokens not a multiple of
      the tile), as ordinary (N, 3) :class:`Part` rows, for a direct transfer
      (``initialize_xfer``); for a token range ``[start, stop)`` also a partial first tile.
      Empty when the range fills whole tiles.

    Together they move exactly the bytes of ``instantiate`` (more descriptors: runs of
    consecutive blocks are not merged).
    """
    req = check_request(bound.program, local_block_ids, remote_block_ids, num_tokens, tokens=tokens)
    return prepared_request(bound, req)


def prepared_request(bound: BoundProgram, req: Request) -> PreparedRequest:
    """:func:`prepared_indices` of a checked request."""
    prog = bound.program
    lay = layout_of(prog)
    jobs: dict[PartKey, list] = {}
    tails: dict[PartKey, tuple[list, list]] = {}
    moved: dict[PartKey, int] = {}
    index = program_index(prog)
    for b, starts, geometry in zip(index.blocks, lay.blocks, bound.geometries()):
        kl, kr = req.local[b.group], req.remote[b.group]
        ts, shift = block_tiles(b, req)
        if ts.count and len(b.runs):
            t = np.arange(ts.first, ts.first + ts.count, dtype=np.int64)[:, None]
            il = kl[t * b.local_sub + b.runs.local_block[None, :] - shift[0]]           # (F, M) kernel ids
            ir = kr[t * b.remote_sub + b.runs.remote_block[None, :] - shift[1]]
            jobs.setdefault(b.key, []).append((starts, il, ir))
            moved[b.key] = moved.get(b.key, 0) + b.runs.nbytes * ts.count * len(b.entries)
        for lrows, rrows in partial_rows(index, b, req, geometry):
            lt, rt = tails.setdefault(b.key, ([], []))
            lt.append(lrows)
            rt.append(rrows)
    indices = {key: _indices(js) for key, js in jobs.items()}
    tail_parts = {key: Part(*coalesce(np.concatenate(lt).view(np.uint64), np.concatenate(rt).view(np.uint64)))
                  for key, (lt, rt) in tails.items()}
    return PreparedRequest(indices, tail_parts, {k: moved[k] for k in indices})
