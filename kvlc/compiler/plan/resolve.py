"""Pass 2 — resolve: sizes, strides, offsets and block bytes in plain integers.

Groups get their block and kernel block sizes; each expanded region gets its storage,
groups and block layout (:mod:`kvlc.compiler.plan.fields`) resolved to a :class:`PlanRegion`;
offsets marked ``auto`` pack after the previous region of the same storage (aligned);
storages without a declared size hold every block of their regions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlc.compiler.plan.expand import Expanded, Sourced, layer_range
from kvlc.compiler.plan.fields import LayoutResolver, unknown_fix
from kvlc.compiler.algebra.layout import ceildiv, is_state_kind, lcm, shard
from kvlc.compiler.plan.model import PlanGroup, PlanRegion, PlanStorage
from kvlc.compiler.spec.models import LayoutSpec
from kvlc.errors import Problem

__all__ = ["Resolved", "ResolvedRegion", "ResolvedStorage", "resolve", "resolve_groups", "shard"]


@dataclass(frozen=True)
class ResolvedRegion:
    region: PlanRegion
    path: tuple


@dataclass(frozen=True)
class ResolvedStorage:
    storage: PlanStorage
    declared_size: int | None
    path: tuple


@dataclass(frozen=True)
class Resolved:
    spec: LayoutSpec
    groups: tuple[PlanGroup, ...]
    storages: tuple[ResolvedStorage, ...]
    regions: tuple[ResolvedRegion, ...]
    problems: tuple[Problem, ...]


def resolve_groups(spec: LayoutSpec, problems: list) -> tuple[PlanGroup, ...]:
    """Each group's block size and kernel block size (inherited from the spec where not its own).

    >>> from kvlc.compiler import load_spec
    >>> [(g.name, g.block_size) for g in resolve_groups(load_spec("layouts/llama-3.1-8b.yaml"), [])]
    [('full', 16)]
    """
    out = []
    for i, g in enumerate(spec.groups):
        block = g.block_size or spec.block_size
        # a group with its own block size and no kernel size of its own uses whole blocks
        kernel = g.kernel_block_size or (block if g.block_size else spec.kernel_block_size) or block
        own = bool(g.block_size or g.kernel_block_size)
        if block % kernel:
            # A spec-level kernel block size that fails the spec-level block size is one problem,
            # reported once at the top level, not once per group that inherits both.
            where = ("groups", i) if own else ()
            whose = f" (group '{g.name}')" if own else ""
            problem = Problem(where + ("kernel_block_size",),
                              f"kernel block size {kernel} does not divide block size {block}{whose}",
                              expected=f"a divisor of {block}", found=str(kernel),
                              fix="use a kernel block size that divides the block size")
            if problem not in problems:
                problems.append(problem)
            kernel = block
        window = getattr(g, "window", 0) or getattr(g, "chunk", 0)
        per = _tokens_per_entry(g, i, block, kernel, problems)
        out.append(PlanGroup(name=g.name, kind=g.kind, window=window, block_size=block,
                             kernel_block_size=kernel, tokens_per_entry=per,
                             dcp_replicated=g.dcp == "replicated" and spec.parallel.dcp_size > 1))
    return tuple(out)


def _tokens_per_entry(g, i: int, block: int, kernel: int, problems: list) -> int:
    """A group's tokens per entry: every block and kernel block holds whole entries (else a problem, 1)."""
    per = g.tokens_per_entry
    if per == 1:
        return 1
    where = ("groups", i, "tokens_per_entry")
    if is_state_kind(g.kind):
        problems.append(Problem(where, f"group '{g.name}' holds per-request state, so it has no token entries",
                                expected="tokens_per_entry 1 (or none) on a mamba/linear_attention group",
                                found=f"tokens_per_entry: {per}", fix="remove 'tokens_per_entry'"))
        return 1
    for what, tokens in (("block size", block), ("kernel block size", kernel)):
        if tokens % per:
            up = ceildiv(tokens, per) * per
            problems.append(Problem(where, f"group '{g.name}' {what} {tokens} is not a whole number of "
                                    f"{per}-token entries", expected=f"a {what} that is a multiple of {per}",
                                    found=f"{what} {tokens}, tokens_per_entry {per}",
                                    fix=f"use a {what} of {up}" + (f" or {up - per}" if up > per else "")
                                    + f", or a tokens_per_entry that divides {tokens}"))
            return 1
    return per


def _block_geometry(g: PlanGroup) -> str:
    """What a group's blocks hold, in words: two groups may share a region only when equal."""
    if g.is_state:
        return "per-request state (no token dim)"
    per = f", one entry per {g.tokens_per_entry} tokens" if g.tokens_per_entry > 1 else ""
    rep = ", replicated under DCP" if g.dcp_replicated else ""
    return f"blocks of {g.block_size} tokens, kernel blocks of {g.kernel_block_size}{per}{rep}"


@dataclass
class _Packing:
    """Where the next ``auto`` region of each storage starts, and how far each storage's blocks reach."""

    cursor: dict[str, int] = field(default_factory=dict)
    ends: dict[str, int] = field(default_factory=dict)

    def place(self, storage: str, offset: int | str, align: int, num_blocks: int, stride: int,
              block_bytes: int) -> int:
        at = offset if offset != "auto" else ceildiv(self.cursor.get(storage, 0), align) * align
        end = at + (num_blocks - 1) * stride + block_bytes
        self.cursor[storage] = max(self.cursor.get(storage, 0), end)
        # a derived storage size holds every block at its full stride (a tensor of
        # num_blocks x block_stride bytes), padding after the last block included
        self.ends[storage] = max(self.ends.get(storage, 0), end, at + num_blocks * stride)
        return at


@dataclass
class _Context:
    spec: LayoutSpec
    groups: dict[str, PlanGroup]
    storages: dict[str, Sourced]
    layouts: LayoutResolver
    problems: list
    packing: _Packing = field(default_factory=_Packing)
    reported_layouts: set = field(default_factory=set)


def _unknown(path: tuple, region: str, what: str, name: str, choices, where: str) -> Problem:
    return Problem(path, f"region '{region}' names unknown {what} '{name}'", expected=f"one of {sorted(choices)}",
                   found=repr(name), fix=unknown_fix(name, choices, where))


def _region_groups(r, path: tuple, ctx: _Context) -> list[PlanGroup]:
    """The groups a region names, each once and all of one block geometry (else problems, [])."""
    out = []
    for gi, gname in enumerate(r.groups):
        if gname not in ctx.groups:
            ctx.problems.append(_unknown(path + ("groups", gi), r.name, "group", gname, ctx.groups, "groups"))
        elif gname in r.groups[:gi]:
            ctx.problems.append(Problem(path + ("groups", gi), f"region '{r.name}' lists group '{gname}' twice",
                                        expected="each group once",
                                        found=f"'{gname}' at groups[{r.groups.index(gname)}] and groups[{gi}]",
                                        fix="list each group once"))
        else:
            out.append(ctx.groups[gname])
    mismatch = [g for g in out[1:] if _block_geometry(g) != _block_geometry(out[0])]
    if mismatch:
        first, g = out[0], mismatch[0]
        ctx.problems.append(Problem(path + ("groups",), f"region '{r.name}' is shared by groups "
                                    f"'{first.name}' and '{g.name}' of different block geometry",
                                    expected=f"'{g.name}' like '{first.name}': {_block_geometry(first)}",
                                    found=_block_geometry(g),
                                    fix="share a region only between groups of one block geometry"))
        return []
    return out


def _region(src: Sourced, ctx: _Context) -> ResolvedRegion | None:
    """One expanded region with its byte geometry, or None (problems recorded in ``ctx``)."""
    r, path = src.item, src.path
    st = ctx.storages.get(r.storage)
    if st is None:
        ctx.problems.append(_unknown(path + ("storage",), r.name, "storage", r.storage, ctx.storages, "storages"))
        return None
    layout = ctx.spec.layouts.get(r.layout)
    if layout is None:
        ctx.problems.append(_unknown(path + ("layout",), r.name, "layout", r.layout, ctx.spec.layouts, "layouts"))
        return None
    groups = _region_groups(r, path, ctx)
    if not groups:
        return None
    first = groups[0]
    tokens = 0 if first.is_state else first.kernel_block_size
    per = first.tokens_per_entry
    res = ctx.layouts(r.layout, layout, tokens // per, per)
    if res.problems:
        if (r.layout, tokens, per) not in ctx.reported_layouts:
            ctx.reported_layouts.add((r.layout, tokens, per))
            ctx.problems.extend(res.problems)
        return None
    ctx.problems.extend(_region_alignment(r, path, st.item, first, res.fields))
    stride = res.block_bytes if r.block_stride == "auto" else r.block_stride
    offset = ctx.packing.place(r.storage, r.offset, st.item.align, r.num_blocks, stride, res.block_bytes)
    return ResolvedRegion(PlanRegion(
        name=r.name, storage=r.storage, mem=st.item.mem, device=st.item.device, offset=offset,
        num_blocks=r.num_blocks, block_bytes=res.block_bytes, block_stride=stride,
        groups=tuple(g.name for g in groups), block_tokens=tokens, tokens_per_entry=per,
        dcp_replicated=first.dcp_replicated,
        kernel_blocks_per_block=1 if first.is_state else first.kernel_blocks_per_block,
        optional=r.optional, fields=res.fields, aliases=r.aliases, part_of=r.part_of or ""), path)


def _region_alignment(r, path: tuple, storage, group: PlanGroup, fields) -> list[Problem]:
    """A whole number of logical blocks; an explicit offset aligned to the storage's ``align`` and the dtypes."""
    out = []
    ratio = 1 if group.is_state else group.kernel_blocks_per_block
    if r.num_blocks % ratio:
        down = r.num_blocks - r.num_blocks % ratio
        out.append(Problem(path + ("num_blocks",), f"region '{r.name}' num_blocks {r.num_blocks} is not a whole "
                           f"number of logical blocks", expected=f"a multiple of {ratio} (kernel blocks per "
                           f"{group.block_size}-token block of group '{group.name}')", found=str(r.num_blocks),
                           fix=f"use {down or ratio} or {down + ratio}"))
    item = max((f.itemsize for f in fields), default=1)
    if r.offset != "auto":
        need = lcm(storage.align, item)
        if r.offset % need:
            out.append(Problem(path + ("offset",), f"region '{r.name}' offset {r.offset} is not aligned",
                               expected=f"a multiple of {need} (storage '{storage.name}' align {storage.align}, "
                               f"largest dtype {item} bytes)", found=str(r.offset),
                               fix=f"use offset {r.offset - r.offset % need + need} or 'auto'"))
    return out


def _storages(exp: Expanded, ends: dict[str, int]) -> tuple[ResolvedStorage, ...]:
    out = []
    for s in exp.storages:
        size = s.item.size if s.item.size is not None else ends.get(s.item.name, 0)
        out.append(ResolvedStorage(PlanStorage(name=s.item.name, mem=s.item.mem, device=s.item.device,
                                               size=max(size, 1)), s.item.size, s.path))
    return tuple(out)


def _layer_problems(spec: LayoutSpec) -> list[Problem]:
    start, stop = layer_range(spec)
    if stop <= spec.model.num_layers:
        return []
    return [Problem(("parallel", "layers"), "pipeline layer range ends past the model",
                    expected=f"stop <= {spec.model.num_layers} (model.num_layers)", found=f"[{start}, {stop}]",
                    fix=f"end the range at {spec.model.num_layers} at most")]


def resolve(exp: Expanded) -> Resolved:
    """Resolve every expanded region to a :class:`PlanRegion` with byte geometry.

    >>> from kvlc.compiler import load_spec
    >>> from kvlc.compiler.plan.expand import expand
    >>> res = resolve(expand(load_spec("layouts/llama-3.1-8b.yaml")))
    >>> res.regions[0].region.block_bytes, res.problems
    (65536, ())
    """
    spec = exp.spec
    problems = list(exp.problems)
    groups = resolve_groups(spec, problems)
    storages: dict[str, Sourced] = {}
    for s in exp.storages:
        storages.setdefault(s.item.name, s)
    ctx = _Context(spec, {g.name: g for g in groups}, storages, LayoutResolver(spec), problems)
    regions = tuple(rr for rr in (_region(src, ctx) for src in exp.regions) if rr is not None)
    problems.extend(_layer_problems(spec))
    return Resolved(spec, groups, _storages(exp, ctx.packing.ends), regions, tuple(problems))
