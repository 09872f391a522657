"""Pass 3 — check: facts that span objects — names, bounds and overlaps.

Collects every problem; raises :class:`CompileError` with all of them (and
those of earlier passes) when any is found.
"""

from __future__ import annotations

from collections import defaultdict

from kvlc.compiler.geometry import Resolved, ResolvedRegion
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
    return False


def _overlap_problem(a, rr: ResolvedRegion) -> Problem:
    """Region ``rr`` shares bytes with region ``a`` (which starts no later)."""
    r = rr.region
    expected = f"bytes disjoint from [{a.offset}, {a.end})"
    found = f"[{r.offset}, {r.end})"
    s = a.block_stride
    if r.block_stride == s and a.block_bytes + r.block_bytes <= s:  # could interleave, but collides
        phase = f"(offset - {a.offset}) mod {s}" if a.offset else f"offset mod {s}"
        expected = (f"{phase} in [{a.block_bytes}, {s - r.block_bytes}] to fit between its blocks, "
                    f"or {expected}")
        found = f"offset {r.offset}, {phase} = {(r.offset - a.offset) % s}"
    return Problem(rr.path + ("offset",),
                   f"region '{r.name}' overlaps region '{a.name}' in storage '{r.storage}'",
                   expected=expected, found=found, fix="move the offset, or let it default to 'auto'")


def _overlaps(regions: list[ResolvedRegion], problems: list) -> None:
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
                if not _disjoint(a.region, r):
                    problems.append(_overlap_problem(a.region, rr))
                    break
            active.append(rr)


def check(res: Resolved) -> Resolved:
    """Raise :class:`CompileError` listing every problem, or return ``res`` unchanged."""
    problems = list(res.problems)
    spec = res.spec
    _duplicates(((g, g.name, ("groups", i, "name")) for i, g in enumerate(spec.groups)), "group", problems)
    _duplicates(((s, s.storage.name, s.path + ("name",)) for s in res.storages), "storage", problems)
    _duplicates(((r, r.region.name, r.path + ("name",)) for r in res.regions), "region", problems)
    sizes = {s.storage.name: s for s in res.storages}
    for rr in res.regions:
        r = rr.region
        if r.block_stride < r.block_bytes:
            problems.append(Problem(rr.path + ("block_stride",),
                                    f"region '{r.name}' block_stride is smaller than its block",
                                    expected=f">= {r.block_bytes} (block bytes)", found=str(r.block_stride),
                                    fix="raise block_stride or let it default to 'auto'"))
        st = sizes.get(r.storage)
        if st is not None and st.declared_size is not None and r.end > st.declared_size:
            problems.append(Problem(rr.path + ("num_blocks",),
                                    f"region '{r.name}' ends past storage '{r.storage}'",
                                    expected=f"end <= {st.declared_size} (storage size)",
                                    found=f"end {r.end} (offset {r.offset} + {r.num_blocks} blocks)",
                                    fix="lower num_blocks or raise the storage size"))
    _overlaps(list(res.regions), problems)
    if problems:
        raise CompileError(problems)
    return res
