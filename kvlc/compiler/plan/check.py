"""Pass 3 — check: facts that span objects — names, bounds and overlaps.

Runs every check of :data:`CHECKS` (each a small function ``Resolved -> [Problem]``),
collects every problem and raises :class:`CompileError` with all of them (and those
of earlier passes) when any is found.
"""

from __future__ import annotations

from collections import defaultdict

from kvlc.compiler.plan.aliases import check_aliases, pools
from kvlc.compiler.plan.overlap import first_shared_byte
from kvlc.compiler.plan.parts import check_parts
from kvlc.compiler.plan.resolve import Resolved, ResolvedRegion
from kvlc.errors import CompileError, Problem, format_path


def _duplicates(items, what: str, problems: list) -> None:
    seen: dict[str, tuple] = {}
    for item, name, path in items:
        if name in seen:
            first = seen[name]
            problems.append(Problem(path, f"duplicate {what} name '{name}'",
                                    expected="unique names",
                                    found=f"'{name}' declared again" + (
                                        " by another value of the same repeat" if first == path
                                        else f" (first at {format_path(first)})"),
                                    fix=f"rename one {what}" + (" or use '{var}' in a repeated name"
                                                                 if what != "group" else "")))
        else:
            seen[name] = path


def _disjoint(a, b) -> bool:
    """True when the block sets of two regions of one storage never share a byte."""
    a_end, b_end = a.end, b.end
    if a_end <= b.offset or b_end <= a.offset:
        return True
    if a.block_stride == b.block_stride:  # interleaved regions (K/V alternating): compare phases
        s = a.block_stride
        d = (b.offset - a.offset) % s
        return a.block_bytes <= d and d + b.block_bytes <= s
    return first_shared_byte(a, b) is None  # different strides: exact (kvlc.compiler.plan.overlap)


def _overlap_problem(a, rr: ResolvedRegion) -> Problem:
    """Region ``rr`` shares bytes with region ``a`` (which starts no later)."""
    r = rr.region
    expected = f"bytes disjoint from [{a.offset}, {a.end})"
    found = f"[{r.offset}, {r.end})"
    s = a.block_stride
    if r.block_stride != s:
        byte = first_shared_byte(a, r)
        found = f"[{r.offset}, {r.end}) every {r.block_stride} bytes; both hold byte {byte}"
    if r.block_stride == s and a.block_bytes + r.block_bytes <= s:  # could interleave, but collides
        phase = f"(offset - {a.offset}) mod {s}" if a.offset else f"offset mod {s}"
        expected = (f"{phase} in [{a.block_bytes}, {s - r.block_bytes}] to fit between its blocks, "
                    f"or {expected}")
        found = f"offset {r.offset}, {phase} = {(r.offset - a.offset) % s}"
    return Problem(rr.path + ("offset",),
                   f"region '{r.name}' overlaps region '{a.name}' in storage '{r.storage}'",
                   expected=expected, found=found, fix="move the offset, or let it default to 'auto'" + (
                       f"; if both lie over one page pool on purpose, declare aliases: ['{a.name}'] "
                       "(one offset, block_stride and num_blocks)"
                       if r.offset == a.offset and not set(r.groups) & set(a.groups) else ""))


def _overlaps(regions: list[ResolvedRegion], problems: list) -> None:
    pool = pools(regions)
    by_storage: dict[str, list[ResolvedRegion]] = defaultdict(list)
    for rr in regions:
        by_storage[rr.region.storage].append(rr)
    for members in by_storage.values():
        members.sort(key=lambda rr: rr.region.offset)
        active: list[ResolvedRegion] = []
        for rr in members:
            r = rr.region
            active = [a for a in active if a.region.end > r.offset]
            for a in active:
                if pool[a.region.name] == pool[r.name]:
                    continue  # a declared page pool: checked by check_aliases
                if not _disjoint(a.region, r):
                    problems.append(_overlap_problem(a.region, rr))
                    break
            active.append(rr)


def check_names(res: Resolved) -> list[Problem]:
    """Group, storage and region names are unique.

    >>> from kvlc.compiler import load_spec
    >>> from kvlc.compiler.plan.expand import expand
    >>> from kvlc.compiler.plan.resolve import resolve
    >>> check_names(resolve(expand(load_spec("layouts/llama-3.1-8b.yaml"))))
    []
    """
    problems: list[Problem] = []
    _duplicates(((g, g.name, ("groups", i, "name")) for i, g in enumerate(res.spec.groups)), "group", problems)
    _duplicates(((s, s.storage.name, s.path + ("name",)) for s in res.storages), "storage", problems)
    _duplicates(((r, r.region.name, r.path + ("name",)) for r in res.regions), "region", problems)
    return problems


def check_strides(res: Resolved) -> list[Problem]:
    """A region's block stride holds its block.

    >>> from kvlc.compiler import load_spec
    >>> from kvlc.compiler.plan.expand import expand
    >>> from kvlc.compiler.plan.resolve import resolve
    >>> check_strides(resolve(expand(load_spec("layouts/deepseek-v3-tp8.yaml"))))
    []
    """
    return [Problem(rr.path + ("block_stride",), f"region '{r.name}' block_stride is smaller than its block",
                    expected=f">= {r.block_bytes} (block bytes)", found=str(r.block_stride),
                    fix="raise block_stride or let it default to 'auto'")
            for rr in res.regions for r in (rr.region,) if r.block_stride < r.block_bytes]


def blocks_that_fit(size: int, offset: int, block_bytes: int, stride: int) -> int:
    """How many blocks of a region fit in ``size`` bytes from ``offset``.

    >>> blocks_that_fit(1024, 0, 256, 256), blocks_that_fit(100, 0, 256, 256)
    (4, 0)
    """
    room = size - offset - block_bytes
    return 0 if room < 0 else room // max(stride, 1) + 1


def check_storage_ends(res: Resolved) -> list[Problem]:
    """A region ends inside its storage's declared size; the message says how many blocks fit.

    >>> from kvlc.compiler import load_spec
    >>> from kvlc.compiler.plan.expand import expand
    >>> from kvlc.compiler.plan.resolve import resolve
    >>> check_storage_ends(resolve(expand(load_spec("layouts/nemotron-h-8b-tp2.yaml"))))
    []
    """
    sizes = {s.storage.name: s for s in res.storages}
    out = []
    for rr in res.regions:
        r, st = rr.region, sizes.get(rr.region.storage)
        if st is None or st.declared_size is None or r.end <= st.declared_size:
            continue
        fit = blocks_that_fit(st.declared_size, r.offset, r.block_bytes, r.block_stride)
        out.append(Problem(rr.path + ("num_blocks",), f"region '{r.name}' ends past storage '{r.storage}'",
                           expected=f"end <= {st.declared_size} (storage size)",
                           found=f"end {r.end} (offset {r.offset} + {r.num_blocks} blocks)",
                           fix=f"lower num_blocks to {fit} (what fits) or raise the storage size to {r.end}"
                           if fit else f"raise the storage size to {r.end} or move the region"))
    return out


ADDRESS_LIMIT = 1 << 63  # descriptors are int64 offsets from a storage base: nothing may reach past it


def check_address_space(res: Resolved) -> list[Problem]:
    """Every region and storage ends below 2**63 bytes, so no address computed from them can wrap.

    >>> from kvlc.compiler import load_spec
    >>> from kvlc.compiler.plan.expand import expand
    >>> from kvlc.compiler.plan.resolve import resolve
    >>> check_address_space(resolve(expand(load_spec("layouts/llama-3.1-8b.yaml"))))
    []
    """
    out = [Problem(rr.path + ("num_blocks",), f"region '{rr.region.name}' ends past 2**63 bytes",
                   expected=f"end <= {ADDRESS_LIMIT:,}", found=f"end {rr.region.end:,}",
                   fix="lower num_blocks, block_stride or offset")
           for rr in res.regions if rr.region.end > ADDRESS_LIMIT]
    flagged = {rr.region.storage for rr in res.regions if rr.region.end > ADDRESS_LIMIT}
    out += [Problem(s.path + ("size",), f"storage '{s.storage.name}' is larger than 2**63 bytes",
                    expected=f"size <= {ADDRESS_LIMIT:,}", found=f"{s.storage.size:,}",
                    fix="lower its size or the blocks of its regions")
            for s in res.storages if s.storage.size > ADDRESS_LIMIT and s.storage.name not in flagged]
    return out


def check_overlaps(res: Resolved) -> list[Problem]:
    """Regions of one storage never share a byte (interleaved regions may share a stride).

    >>> from kvlc.compiler import load_spec
    >>> from kvlc.compiler.plan.expand import expand
    >>> from kvlc.compiler.plan.resolve import resolve
    >>> check_overlaps(resolve(expand(load_spec("layouts/qwen3-next-80b-a3b-tp4.yaml"))))
    []
    """
    problems: list[Problem] = []
    _overlaps(list(res.regions), problems)
    return problems


CHECKS = (check_names, check_strides, check_storage_ends, check_address_space, check_overlaps, check_aliases,
          check_parts)


def check(res: Resolved) -> Resolved:
    """Raise :class:`CompileError` listing every problem, or return ``res`` unchanged.

    >>> from kvlc.compiler import load_spec
    >>> from kvlc.compiler.plan.expand import expand
    >>> from kvlc.compiler.plan.resolve import resolve
    >>> res = resolve(expand(load_spec("layouts/llama-3.1-8b.yaml")))
    >>> check(res) is res
    True
    """
    problems = list(res.problems) + [p for c in CHECKS for p in c(res)]
    if problems:
        raise CompileError(problems)
    return res
