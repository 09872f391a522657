"""Per request, step 1 — check what an engine asks for before any descriptor exists.

Block ids must be integers (a list / tuple of ``int`` or an integer numpy array; never
bool, float, str or None), one per block the tokens occupy, inside every region of the
group, and distinct on the receiving (consumer) side. ``num_tokens`` is a positive
integer, or one per group. Every refusal is a :class:`~kvlc.errors.TransferError`
that says which side, group and value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import numpy as np

from kvlc.compiler.layout import ceildiv, kernel_ids
from kvlc.errors import TransferError, did_you_mean

if TYPE_CHECKING:
    from kvlc.compiler.program import TransferProgram

ID_MAX = (1 << 63) - 1


@dataclass(frozen=True, eq=False)
class Request:
    """A checked request: kernel block ids per group on each side, and tokens per token group."""

    local: Mapping[str, np.ndarray]
    remote: Mapping[str, np.ndarray]
    tokens: Mapping[str, int]


def _type_name(t: type) -> str:
    return "None" if t is type(None) else t.__name__


def block_ids(ids, where: str) -> np.ndarray:
    """Block ids as a 1-D int64 array, or a :class:`TransferError` saying what was wrong.

    >>> block_ids([3, 1], "local ids of group 'full'").tolist()
    [3, 1]
    >>> block_ids([2.7], "local ids of group 'full'")
    Traceback (most recent call last):
    kvlc.errors.TransferError: local ids of group 'full': block ids must be integers (a list of int or an integer numpy array); found float
    """
    if isinstance(ids, np.ndarray):
        kind = ids.dtype.kind
        if kind not in "iu":
            raise TransferError(f"{where}: block ids must be an integer numpy array; found dtype {ids.dtype}")
        if kind == "u" and ids.size and int(ids.max()) > ID_MAX:
            raise TransferError(f"{where}: block id {int(ids.max())} is too large")
        return ids.astype(np.int64, copy=False).ravel()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple, range)):
        raise TransferError(f"{where}: block ids must be a list of int or an integer numpy array; "
                            f"found {_type_name(type(ids))}")
    bad = sorted({_type_name(t) for t in set(map(type, ids))
                  if t is bool or t is np.bool_ or not issubclass(t, (int, np.integer))})
    if bad:
        raise TransferError(f"{where}: block ids must be integers (a list of int or an integer numpy array); "
                            f"found {', '.join(bad)}")
    try:
        return np.asarray(ids, dtype=np.int64).ravel()
    except OverflowError:
        raise TransferError(f"{where}: block id {max(ids, key=abs)} is too large") from None


def token_count(value, group: str) -> int:
    """A positive integer token count (bool, float, str, NaN refused).

    >>> token_count(7, "full")
    7
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TransferError(f"group '{group}': num_tokens must be a positive integer; found {value!r} "
                            f"({_type_name(type(value))})")
    tok = int(value)
    if tok <= 0:
        raise TransferError(f"group '{group}': num_tokens must be positive, got {tok}")
    return tok


def _known_groups(ids, plan, side: str) -> None:
    if not isinstance(ids, Mapping):
        raise TransferError(f"{side} block ids must map group name -> ids; found {_type_name(type(ids))}")
    names = [g.name for g in plan.groups]
    for name in ids:
        if name not in names:
            raise TransferError(f"{side} block ids name unknown group {name!r} of plan '{plan.name}'; "
                                f"{did_you_mean(str(name), names)}")


def _tokens_of(num_tokens, group: str, prog) -> int:
    if isinstance(num_tokens, Mapping):
        if group not in num_tokens:
            raise TransferError(f"num_tokens has no entry for group '{group}' "
                                f"(give one per token group: {sorted(prog.index.groups)})")
        return token_count(num_tokens[group], group)
    return token_count(num_tokens, group)


def _side_ids(prog, side: str, group: str, ids, tokens: int | None, receiving: bool) -> np.ndarray:
    where = f"{side} block ids of group '{group}'"
    arr = block_ids(ids, where)
    plan = prog.local if side == "local" else prog.remote
    g = plan.group(group)
    if tokens is not None:
        per = g.block_size * plan.parallel.dcp_size  # DCP: one block id per block_size slots on each rank
        need = ceildiv(tokens, per)
        if len(arr) != need:
            dcp = f" x dcp_size {plan.parallel.dcp_size}" if plan.parallel.dcp_size > 1 else ""
            raise TransferError(f"group '{group}': {len(arr)} {side} block ids for {tokens} tokens; "
                                f"expected {need} (block size {g.block_size}{dcp})")
    if len(arr):
        lo, hi = int(arr.min()), int(arr.max())
        r = prog.index.groups[group].smallest(side)
        if lo < 0 or hi >= r.capacity:
            bad = lo if lo < 0 else hi
            raise TransferError(f"{side} block id {bad} out of range for region '{r.name}' "
                                f"(group '{group}', capacity {r.capacity} blocks)")
        if receiving and len(arr) > 1:
            ordered = np.sort(arr)
            if np.any(ordered[1:] == ordered[:-1]):
                uniq, counts = np.unique(arr, return_counts=True)
                dup = int(uniq[np.argmax(counts > 1)])
                raise TransferError(f"{where}: block id {dup} appears {int(counts.max())} times; the receiving "
                                    "side writes each block once, so give distinct ids")
    return kernel_ids(arr, 1 if g.is_state else g.kernel_blocks_per_block)


def check_request(prog: "TransferProgram", local_block_ids, remote_block_ids, num_tokens) -> Request:
    """Validate a request's ids (types, counts, bounds, duplicates) and expand them to kernel block ids."""
    _known_groups(local_block_ids, prog.local, "local")
    _known_groups(remote_block_ids, prog.remote, "remote")
    local_receives = prog.direction == "READ"
    kids_l: dict[str, np.ndarray] = {}
    kids_r: dict[str, np.ndarray] = {}
    tokens_of: dict[str, int] = {}
    groups = prog.index.groups
    for group, regions in groups.items():
        if group not in local_block_ids or group not in remote_block_ids:
            raise TransferError(f"no block ids for group '{group}' "
                                f"(give local and remote ids for groups {sorted(groups)})")
        tok = None
        if not regions.is_state:
            tok = tokens_of[group] = _tokens_of(num_tokens, group, prog)
        kids_l[group] = _side_ids(prog, "local", group, local_block_ids[group], tok, local_receives)
        kids_r[group] = _side_ids(prog, "remote", group, remote_block_ids[group], tok, not local_receives)
        if regions.is_state and len(kids_l[group]) != len(kids_r[group]):
            raise TransferError(f"group '{group}': {len(kids_l[group])} local vs {len(kids_r[group])} "
                                "remote state blocks; give one remote block per local block")
    _pool_conflicts(prog.local if local_receives else prog.remote, kids_l if local_receives else kids_r,
                    "local" if local_receives else "remote")
    return Request(kids_l, kids_r, tokens_of)


def _pool_conflicts(plan, kids: Mapping[str, np.ndarray], side: str) -> None:
    """Groups whose regions share one page pool (declared aliases) must not receive into one page."""
    if not any(r.aliases for r in plan.regions):
        return
    from kvlc.compiler.aliases import pools
    members: dict[str, list] = {}
    pool = pools(plan.regions)
    for r in plan.regions:
        members.setdefault(pool[r.name], []).append(r)
    for regions in members.values():
        groups = sorted({g for r in regions for g in r.groups if g in kids})
        for i, ga in enumerate(groups):
            for gb in groups[i + 1:]:
                both = np.intersect1d(kids[ga], kids[gb])
                if both.size:
                    raise TransferError(f"{side} page {int(both[0])} of pool '{regions[0].name}' is given to "
                                        f"groups '{ga}' and '{gb}', whose regions share one page pool "
                                        "(aliases); give each group its own pages")
