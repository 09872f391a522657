"""Pass 2 — resolve geometry: sizes, strides, offsets and block bytes in plain integers.

Field dims are laid out row-major (last dim innermost) on per-rank sizes; a
``head`` dim is divided by the TP size; a ``sections`` dim becomes one field
per section sharing the parent's strides. Region offsets marked ``auto`` pack
after the previous region of the same storage.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from kvlc.compiler.expand import Expanded, Sourced, layer_range
from kvlc.compiler.plan import PlanDim, PlanField, PlanGroup, PlanRegion, PlanStorage
from kvlc.compiler.spec import DTYPE_SIZES, STATE_GROUP_KINDS, BlockLayout, Dim, LayoutSpec
from kvlc.errors import Problem


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


def shard(global_size: int, tp: int) -> int | None:
    """Heads per rank: ``global/tp``, or 1 when tp is a multiple (replicas); None if neither.

    >>> shard(8, 2), shard(8, 16), shard(6, 4)
    (4, 1, None)
    """
    if global_size % tp == 0:
        return global_size // tp
    if tp % global_size == 0:
        return 1
    return None


def resolve_groups(spec: LayoutSpec, problems: list) -> tuple[PlanGroup, ...]:
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
        out.append(PlanGroup(name=g.name, kind=g.kind, window=window, block_size=block,
                             kernel_block_size=kernel))
    return tuple(out)


class _LayoutResolver:
    """Resolves a block layout for one (tokens per kernel block) setting; cached per key."""

    def __init__(self, spec: LayoutSpec):
        self.spec = spec
        self.tp = spec.parallel.tp_size
        self.known = spec.model.known_sizes()
        self.cache: dict = {}

    def __call__(self, name: str, layout: BlockLayout, tokens: int):
        key = (name, tokens)
        if key not in self.cache:
            problems: list = []
            fields, nbytes = self._resolve(name, layout, tokens, problems)
            self.cache[key] = (fields, nbytes, tuple(problems))
        return self.cache[key]

    def _dim_size(self, dim: Dim, tokens: int, path: tuple, problems: list) -> int | None:
        size = dim.size
        if isinstance(size, str):
            if size not in self.known:
                problems.append(Problem(path + ("size",), f"dim '{dim.name}' names unknown model size "
                                        f"'{size}'", expected=f"one of {sorted(self.known)}",
                                        found=repr(size), fix="declare it under model.sizes"))
                return None
            size = self.known[size]
        if size is None:
            if dim.role == "token":
                if tokens == 0:
                    problems.append(Problem(path, f"dim '{dim.name}' has role token, but the region's "
                                            "groups hold per-request state",
                                            expected="no token dim in a mamba/linear_attention layout",
                                            found="role: token", fix="drop the token role"))
                    return None
                return tokens
            if dim.name in self.known:
                return self.known[dim.name]
            problems.append(Problem(path, f"dim '{dim.name}' has no size",
                                    expected="an integer size", found="nothing",
                                    fix=f"add 'size:' or declare model.sizes.{dim.name}"))
            return None
        if dim.role == "token" and size != tokens:
            what = ("the region's groups hold per-request state" if tokens == 0
                    else f"kernel blocks hold {tokens} tokens")
            problems.append(Problem(path + ("size",), f"token dim '{dim.name}' has {size} tokens but {what}",
                                    expected=str(tokens), found=str(size),
                                    fix="omit the size of token dims; it follows the group's kernel block size"))
            return None
        expect = self.known.get(dim.name)
        if expect is not None and size != expect and not dim.sections:
            problems.append(Problem(path + ("size",), f"dim '{dim.name}' disagrees with the model",
                                    expected=f"{expect} (model)", found=str(size),
                                    fix=f"use size {expect} or correct the model"))
        return size

    def _local(self, dim_name: str, global_size: int, path: tuple, problems: list,
               allow_replicas: bool = True) -> int | None:
        local = shard(global_size, self.tp)
        if local is None or (not allow_replicas and global_size % self.tp):
            problems.append(Problem(path, f"'{dim_name}' of size {global_size} cannot be split over "
                                    f"tp_size {self.tp}",
                                    expected=f"a multiple of {self.tp}" + (f" (sharded) or a divisor of "
                                                                           f"{self.tp} (replicated)"
                                                                           if allow_replicas else ""),
                                    found=str(global_size),
                                    fix="change parallel.tp_size or the dim's size"))
            return None
        return local

    def _resolve(self, name: str, layout: BlockLayout, tokens: int, problems: list):
        itemsizes = DTYPE_SIZES
        fields: list[PlanField] = []
        cursor = 0
        spans = []  # (start, end, field index in spec)
        for fi, f in enumerate(layout.fields):
            fpath = ("layouts", name, "fields", fi)
            sizes: list[tuple[Dim, int, int]] = []  # (dim, local, global)
            ok = True
            for di, d in enumerate(f.dims):
                dpath = fpath + ("dims", di)
                if d.sections:
                    total_global = sum(d.sections.values())
                    locals_ = [self._local(f"{d.name}.{s}", g, dpath + ("sections", s), problems, False)
                               if d.role == "head" else g for s, g in d.sections.items()]
                    if None in locals_:
                        ok = False
                        continue
                    sizes.append((d, sum(locals_), total_global))
                    continue
                g = self._dim_size(d, tokens, dpath, problems)
                if g is None:
                    ok = False
                    continue
                local = self._local(d.name, g, dpath, problems) if d.role == "head" else g
                if local is None:
                    ok = False
                    continue
                sizes.append((d, local, g))
            if not ok:
                continue
            item = itemsizes[f.dtype]
            strides = []
            acc = item
            for _, local, _ in reversed(sizes):
                strides.append(acc)
                acc *= local
            strides.reverse()
            extent = acc
            start = cursor if f.offset is None else f.offset
            cursor = start + extent
            spans.append((start, start + extent, fi, f.name))
            if f.kind == "sections":
                split = next(i for i, (d, _, _) in enumerate(sizes) if d.sections)
                d_split = sizes[split][0]
                at = 0
                for sec, g in d_split.sections.items():
                    local = g // self.tp if d_split.role == "head" else g
                    dims = tuple(
                        PlanDim(name=d.name, role=d.role or "", size=(local if i == split else lo),
                                global_size=(g if i == split else gl), stride=strides[i])
                        for i, (d, lo, gl) in enumerate(sizes))
                    fields.append(PlanField(name=f"{f.name}.{sec}", dtype=f.dtype, itemsize=item,
                                            offset=start + at * strides[split], dims=dims))
                    at += local
            else:
                dims = tuple(PlanDim(name=d.name, role=d.role or "", size=lo, global_size=gl, stride=s)
                             for (d, lo, gl), s in zip(sizes, strides))
                fields.append(PlanField(name=f.name, dtype=f.dtype, itemsize=item, offset=start, dims=dims))
        block_bytes = layout.size if layout.size is not None else max((e for _, e, _, _ in spans), default=0)
        spans.sort()
        for (s0, e0, i0, n0), (s1, e1, i1, n1) in zip(spans, spans[1:]):
            if s1 < e0:
                problems.append(Problem(("layouts", name, "fields", i1, "offset"),
                                        f"field '{n1}' overlaps field '{n0}'",
                                        expected=f"offset >= {e0}", found=f"bytes [{s1}, {e1})",
                                        fix="move the field or let its offset default"))
        for s, e, i, n in spans:
            if e > block_bytes:
                problems.append(Problem(("layouts", name, "fields", i),
                                        f"field '{n}' ends outside its block",
                                        expected=f"end <= block size {block_bytes}", found=f"end {e}",
                                        fix="raise the layout's size or shrink the field"))
        return tuple(fields), block_bytes


def _block_geometry(g: PlanGroup) -> str:
    """What a group's blocks hold, in words: two groups may share a region only when equal."""
    if g.is_state:
        return "per-request state (no token dim)"
    return f"blocks of {g.block_size} tokens, kernel blocks of {g.kernel_block_size}"


def resolve(exp: Expanded) -> Resolved:
    """Resolve every expanded region to a :class:`PlanRegion` with byte geometry."""
    spec = exp.spec
    problems = list(exp.problems)
    groups = resolve_groups(spec, problems)
    group_by_name = {g.name: g for g in groups}
    layouts = _LayoutResolver(spec)
    reported_layout_problems: set = set()

    storage_by_name: dict[str, Sourced] = {}
    for s in exp.storages:
        storage_by_name.setdefault(s.item.name, s)
    cursor: dict[str, int] = {}
    ends: dict[str, int] = {}
    regions: list[ResolvedRegion] = []
    for src in exp.regions:
        r, path = src.item, src.path
        st = storage_by_name.get(r.storage)
        if st is None:
            problems.append(Problem(path + ("storage",), f"region '{r.name}' names unknown storage "
                                    f"'{r.storage}'", expected=f"one of {sorted(storage_by_name)}",
                                    found=repr(r.storage), fix="declare it under storages"))
            continue
        layout = spec.layouts.get(r.layout)
        if layout is None:
            problems.append(Problem(path + ("layout",), f"region '{r.name}' names unknown layout "
                                    f"'{r.layout}'", expected=f"one of {sorted(spec.layouts)}",
                                    found=repr(r.layout), fix="declare it under layouts"))
            continue
        rgroups = []
        for gi, gname in enumerate(r.groups):
            if gname not in group_by_name:
                problems.append(Problem(path + ("groups", gi), f"region '{r.name}' names unknown group "
                                        f"'{gname}'", expected=f"one of {sorted(group_by_name)}",
                                        found=repr(gname), fix="declare it under groups"))
            elif gname in r.groups[:gi]:
                problems.append(Problem(path + ("groups", gi), f"region '{r.name}' lists group '{gname}' twice",
                                        expected="each group once",
                                        found=f"'{gname}' at groups[{r.groups.index(gname)}] and groups[{gi}]",
                                        fix="list each group once"))
            else:
                rgroups.append(group_by_name[gname])
        if not rgroups:
            continue
        first = rgroups[0]
        mismatch = [g for g in rgroups[1:] if _block_geometry(g) != _block_geometry(first)]
        if mismatch:
            g = mismatch[0]
            problems.append(Problem(path + ("groups",), f"region '{r.name}' is shared by groups "
                                    f"'{first.name}' and '{g.name}' of different block geometry",
                                    expected=f"'{g.name}' like '{first.name}': {_block_geometry(first)}",
                                    found=_block_geometry(g),
                                    fix="share a region only between groups of one block geometry"))
            continue
        tokens = 0 if first.is_state else first.kernel_block_size
        fields, block_bytes, lprobs = layouts(r.layout, layout, tokens)
        if lprobs:
            key = (r.layout, tokens)
            if key not in reported_layout_problems:
                reported_layout_problems.add(key)
                problems.extend(lprobs)
            continue
        stride = block_bytes if r.block_stride == "auto" else r.block_stride
        align = st.item.align
        offset = r.offset if r.offset != "auto" else -(-cursor.get(r.storage, 0) // align) * align
        end = offset + (r.num_blocks - 1) * stride + block_bytes
        cursor[r.storage] = max(cursor.get(r.storage, 0), end)
        # a derived storage size holds every block at its full stride (a tensor of
        # num_blocks x block_stride bytes), padding after the last block included
        ends[r.storage] = max(ends.get(r.storage, 0), end, offset + r.num_blocks * stride)
        regions.append(ResolvedRegion(PlanRegion(
            name=r.name, storage=r.storage, mem=st.item.mem, device=st.item.device, offset=offset,
            num_blocks=r.num_blocks, block_bytes=block_bytes, block_stride=stride,
            groups=tuple(g.name for g in rgroups), block_tokens=tokens,
            kernel_blocks_per_block=1 if first.is_state else first.kernel_blocks_per_block,
            optional=r.optional, fields=fields), path))

    storages = []
    for s in exp.storages:
        size = s.item.size if s.item.size is not None else ends.get(s.item.name, 0)
        storages.append(ResolvedStorage(PlanStorage(name=s.item.name, mem=s.item.mem,
                                                    device=s.item.device, size=max(size, 1)),
                                        s.item.size, s.path))
    start, stop = layer_range(spec)
    if stop > spec.model.num_layers:
        problems.append(Problem(("parallel", "layers"), "pipeline layer range ends past the model",
                                expected=f"stop <= {spec.model.num_layers} (model.num_layers)",
                                found=f"[{start}, {stop}]",
                                fix=f"end the range at {spec.model.num_layers} at most"))
    return Resolved(spec, groups, tuple(storages), tuple(regions), tuple(problems))
