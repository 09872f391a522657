"""Per request, step 1 — check what an engine asks for before any descriptor exists.

A request moves tokens ``[start, stop)``: ``tokens=(start, stop)`` (or ``range(start,
stop)``), or ``num_tokens=N`` for ``[0, N)``; either one for all token groups or one per
local group (a mapping). Ids come per group on each side: where the two engines put a region in other
groups (a group link, :func:`kvlc.compiler.pairing.match.group_links`), its local ids are those of its
local group and its remote ids those of its remote group. Block ids must be integers (a list / tuple of ``int`` or an integer
numpy array; never bool, float, str or None): on each side, the logical blocks of that
side that the range touches, in order (``start // bs .. ceil(stop / bs) - 1``, block size
``bs`` of that side's group; :mod:`kvlc.compiler.request.tokens`). A sliding-window group takes the
same ids and moves only the blocks its window still needs, a chunked-local group only those of the
receiver's current chunk; the ids of the blocks before
them are placeholders kvlc never reads (vLLM's null block may repeat there). Ids that are
read must lie inside every region of the group and be distinct on the receiving side.
Every refusal is a :class:`~kvlc.errors.TransferError` that says which side, group and value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from kvlc.compiler.algebra.layout import kernel_ids
from kvlc.compiler.pairing.program import TransferProgram
from kvlc.compiler.plan.aliases import pools
from kvlc.compiler.request import native
from kvlc.compiler.request.index import Block
from kvlc.compiler.request.rules import GroupRule, SideRule, request_rules
from kvlc.compiler.request.tokens import TileSpan, TokenRange, block_span, chunk_start, tile_spans, window_start
from kvlc.errors import TransferError, did_you_mean, type_name

ID_MAX = (1 << 63) - 1


@dataclass(frozen=True)
class GroupRange:
    """Tokens one token group moves, and the kernel block number of each side's first id.

    ``local_first`` / ``remote_first``: kernel block ``k`` of the sequence (tokens
    ``k * kernel block size ..``) is ``ids[k - first]`` of that side.
    """

    span: TokenRange
    local_first: int
    remote_first: int


@dataclass(frozen=True, eq=False)
class Request:
    """A checked request: kernel block ids per group link on each side (only those read), and spans per token
    link (keys: :attr:`~kvlc.compiler.pairing.program.Entry.link`, the group where both sides name it alike)."""

    local: Mapping[str, np.ndarray]
    remote: Mapping[str, np.ndarray]
    spans: Mapping[str, GroupRange]


def block_ids(ids, where: str) -> np.ndarray:
    """Block ids as a 1-D int64 array, or a :class:`TransferError` saying what was wrong.

    >>> block_ids([3, 1], "local ids of group 'full'").tolist()
    [3, 1]
    >>> block_ids([2.7], "local ids of group 'full'")
    Traceback (most recent call last):
    kvlc.errors.TransferError: local ids of group 'full': block ids must be integers (a list of int or an integer numpy array); found float
    """
    if isinstance(ids, np.ndarray):
        return _array_ids(ids, where)
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple, range)):
        raise TransferError(f"{where}: block ids must be a list of int or an integer numpy array; "
                            f"found {type_name(type(ids))}")
    if not set(map(type, ids)) <= _PLAIN_INT:  # the common case, plain ints only, needs no further look
        _integers_only(ids, where)
    try:
        return np.asarray(ids, dtype=np.int64).ravel()
    except OverflowError:
        raise TransferError(f"{where}: block id {max(ids, key=abs)} is too large") from None


_PLAIN_INT = frozenset((int,))


def _array_ids(ids: np.ndarray, where: str) -> np.ndarray:
    kind = ids.dtype.kind
    if kind not in "iu":
        raise TransferError(f"{where}: block ids must be an integer numpy array; found dtype {ids.dtype}")
    if kind == "u" and ids.size and int(ids.max()) > ID_MAX:
        raise TransferError(f"{where}: block id {int(ids.max())} is too large")
    return ids.astype(np.int64, copy=False).ravel()


def _integers_only(ids, where: str) -> None:
    bad = sorted({type_name(t) for t in set(map(type, ids))
                  if t is bool or t is np.bool_ or not issubclass(t, (int, np.integer))})
    if bad:
        raise TransferError(f"{where}: block ids must be integers (a list of int or an integer numpy array); "
                            f"found {', '.join(bad)}")


def _known_groups(ids, plan, side: str, names: frozenset) -> None:
    if type(ids) is dict and ids.keys() <= names:  # the common case: a dict of known groups
        return
    if not isinstance(ids, Mapping):
        raise TransferError(f"{side} block ids must map group name -> ids; found {type_name(type(ids))}")
    names = [g.name for g in plan.groups]
    for name in ids:
        if name not in names:
            raise TransferError(f"{side} block ids name unknown group {name!r} of plan '{plan.name}'; "
                                f"{did_you_mean(str(name), names)}")


def _count(arr: np.ndarray, side: str, group: str, span: TokenRange, bs: int, dcp: int = 1) -> None:
    first, need = block_span(span, bs * dcp)  # DCP: one block id per block_size slots on each rank
    if len(arr) == need:
        return
    size = f"{bs} x dcp_size {dcp}" if dcp > 1 else f"{bs}"
    if span.start == 0:
        raise TransferError(f"group '{group}': {len(arr)} {side} block ids for {span.stop} tokens; "
                            f"expected {need} (block size {size})")
    raise TransferError(f"group '{group}': {len(arr)} {side} block ids for tokens [{span.start}, {span.stop}); "
                        f"expected {need}, one per block the range touches (block size {size}: logical blocks "
                        f"{first}..{first + need - 1})")


_SMALL = 128  # ids up to this many: checked in Python (numpy's per-call cost is larger there)


def _check_ids(rule: SideRule, arr: np.ndarray) -> None:
    if not len(arr):
        return
    if len(arr) > _SMALL and native.library() is not None and native.ids_ok(arr, rule.bound.capacity, rule.receiving):
        return  # (a refusal is worded below, by the reference)
    small = arr.tolist() if len(arr) <= _SMALL else None
    lo, hi = (min(small), max(small)) if small is not None else (int(arr.min()), int(arr.max()))
    r = rule.bound
    if lo < 0 or hi >= r.capacity:
        bad = lo if lo < 0 else hi
        raise TransferError(f"{rule.side} block id {bad} out of range for region '{r.name}' "
                            f"(group '{rule.group}', capacity {r.capacity} blocks)")
    if rule.receiving and len(arr) > 1 and _repeats(arr, small):
        uniq, counts = np.unique(arr, return_counts=True)
        dup = int(uniq[np.argmax(counts > 1)])
        raise TransferError(f"{rule.where}: block id {dup} appears {int(counts.max())} times; the receiving "
                            "side writes each block once, so give distinct ids")


def _repeats(arr: np.ndarray, small: list | None) -> bool:
    if small is not None:
        return len(set(small)) != len(small)
    ordered = np.sort(arr)
    return bool(np.any(ordered[1:] == ordered[:-1]))


def _moved(rule: GroupRule, span: TokenRange) -> TokenRange:
    """The part of ``span`` a group moves: all of it, or what a sliding window or the current chunk of a
    chunked-local group still needs (possibly nothing)."""
    if rule.chunk is not None:
        return TokenRange(chunk_start(span, rule.chunk, rule.window_block), span.stop)
    if rule.window is None:
        return span
    return TokenRange(window_start(span, rule.window, rule.window_block), span.stop)


def _whole_blocks_only(rule: GroupRule, moved: TokenRange, asked: TokenRange) -> None:
    """A per-block field (no token dim) cannot be split: a range starting mid-block is refused there."""
    if moved.start == 0:
        return
    for w in rule.whole_blocks:
        if moved.start % w.per:
            raise TransferError(f"group '{rule.name}': tokens [{asked.start}, {asked.stop}) start inside a block "
                                f"of region '{w.region}' ({w.per} tokens per block), whose field "
                                f"'{w.field}' has no token dim (one value per block); start the range on a "
                                f"multiple of {w.per}")


def _token_group(rule: GroupRule, ids: tuple, span: TokenRange):
    """Check one token group's ids on both sides; return kernel ids of the blocks read, and their span."""
    moved = _moved(rule, span)
    _whole_blocks_only(rule, moved, span)
    kl, fl = _side_ids(rule.local, ids[0], span, moved)
    kr, fr = _side_ids(rule.remote, ids[1], span, moved)
    return kl, kr, GroupRange(moved, fl, fr)


def _side_ids(rule: SideRule, raw, span: TokenRange, moved: TokenRange) -> tuple[np.ndarray, int]:
    """One side's ids checked: kernel ids of the blocks read, and the kernel block number of the first."""
    per = rule.block_size * rule.dcp  # tokens per block id
    first, n = block_span(moved, per) if len(moved) else (span.start // per, 0)
    skip = first - span.start // per
    arr = native.seq_ids(raw, skip, skip + n, rule.bound.capacity, rule.receiving,  # in C, where it can
                         count=block_span(span, per)[1])
    if arr is None:  # the reference: every refusal is worded here
        arr = block_ids(raw, rule.where)
        _count(arr, rule.side, rule.group, span, rule.block_size, rule.dcp)
        if skip or n != len(arr):
            arr = arr[skip:][:n]
        _check_ids(rule, arr)
    elif skip or n != len(arr):
        arr = arr[skip:skip + n]
    return kernel_ids(arr, rule.kernel_blocks), first * rule.kernel_blocks


def _state_group(rule: GroupRule, ids: tuple):
    out = []
    for side, raw in ((rule.local, ids[0]), (rule.remote, ids[1])):
        arr = native.seq_ids(raw, 0, None, side.bound.capacity, side.receiving)
        if arr is None:  # the reference words every refusal
            arr = block_ids(raw, side.where)
            _check_ids(side, arr)
        out.append(arr)
    if len(out[0]) != len(out[1]):
        raise TransferError(f"group '{rule.name}': {len(out[0])} local vs {len(out[1])} "
                            "remote state blocks; give one remote block per local block")
    return out[0], out[1]


def check_request(prog: TransferProgram, local_block_ids, remote_block_ids, num_tokens=None, *,
                  tokens=None) -> Request:
    """Validate a request's ids (types, counts, bounds, duplicates) and expand them to kernel block ids.

    ``num_tokens=N`` (a count) moves tokens ``[0, N)``; ``tokens=(start, stop)`` (or a ``range``,
    or a mapping group -> either) moves ``[start, stop)`` (:meth:`TokenRange.of`). Give exactly one.
    Raises only :class:`~kvlc.errors.TransferError`.

    >>> from kvlc import compile_spec, pair
    >>> p = compile_spec("layouts/llama-3.1-8b.yaml")
    >>> req = check_request(pair(p, p, local_rank=0), {"full": [3, 4]}, {"full": [7, 8]}, tokens=(16, 40))
    >>> req.spans["full"].span, req.local["full"].tolist()    # ids of blocks 1..2 (16 tokens each)
    (TokenRange(start=16, stop=40), [3, 4])
    """
    rules = request_rules(prog)
    _known_groups(local_block_ids, prog.local, "local", rules.local_names)
    _known_groups(remote_block_ids, prog.remote, "remote", rules.remote_names)
    kids_l: dict[str, np.ndarray] = {}
    kids_r: dict[str, np.ndarray] = {}
    spans: dict[str, GroupRange] = {}
    for rule in rules.groups:
        link, lg, rg = rule.name, rule.local.group, rule.remote.group
        if lg not in local_block_ids or rg not in remote_block_ids:
            raise TransferError(_no_ids(rule, lg in local_block_ids, rules, prog))
        ids = (local_block_ids[lg], remote_block_ids[rg])
        if rule.state:
            kids_l[link], kids_r[link] = _state_group(rule, ids)
            continue
        span = TokenRange.of(num_tokens, tokens, group=lg, groups=rules.names)
        kids_l[link], kids_r[link], spans[link] = _token_group(rule, ids, span)
    if rules.aliased:
        local_receives = prog.direction == "READ"
        side = "local" if local_receives else "remote"
        kids = {getattr(r, side).group: (kids_l if local_receives else kids_r)[r.name] for r in rules.groups}
        _pool_conflicts(prog.local if local_receives else prog.remote, kids, side)
    return Request(kids_l, kids_r, spans)


def _no_ids(rule: GroupRule, has_local: bool, rules, prog: TransferProgram) -> str:
    """Which side lacks the ids of which group (both groups named where a region links two)."""
    lg, rg = rule.local.group, rule.remote.group
    if lg == rg:
        return f"no block ids for group '{lg}' (give local and remote ids for groups {sorted(rules.names)})"
    side, plan, group = ("remote", prog.remote, rg) if has_local else ("local", prog.local, lg)
    return (f"no {side} block ids for group '{group}' of plan '{plan.name}': regions in local group '{lg}' are "
            f"in remote group '{rg}', so a request gives local ids of '{lg}' and remote ids of '{rg}'")


def _pool_conflicts(plan, kids: Mapping[str, np.ndarray], side: str) -> None:
    """Groups whose regions share one page pool (declared aliases) must not receive into one page."""
    members: dict[str, list] = {}
    pool = pools(plan.regions)
    for r in plan.regions:
        members.setdefault(pool[r.name], []).append(r)
    # a page is one logical block: a group of m kernel blocks per block has kernel ids b*m .. b*m+m-1 on page b
    pages = {g: np.unique(k // plan.group(g).kernel_blocks_per_block) for g, k in kids.items()}
    for regions in members.values():
        groups = sorted({g for r in regions for g in r.groups if g in kids})
        for i, ga in enumerate(groups):
            for gb in groups[i + 1:]:
                both = np.intersect1d(pages[ga], pages[gb])
                if both.size:
                    raise TransferError(f"{side} page {int(both[0])} of pool '{regions[0].name}' is given to "
                                        f"groups '{ga}' and '{gb}', whose regions share one page pool "
                                        "(aliases); give each group its own pages")


def block_tiles(b: Block, req: Request) -> tuple[TileSpan, tuple[int, int]]:
    """The tiles a request moves in block ``b``'s group, and each side's first kernel block number.

    Tile ``t`` run ``k`` reads local id ``ids[t * local_sub + run block - first]`` (same remote).
    State: one whole "tile" per state block, from 0.
    """
    if not b.tile_tokens:
        return TileSpan(0, len(req.local[b.group]), ()), (0, 0)
    gs = req.spans[b.group]
    return tile_spans(gs.span, b.tile_tokens), (gs.local_first, gs.remote_first)
