"""Resolve, part 1 — block layouts: a layout's fields as byte geometry for one kernel block size.

Field dims are laid out row-major (last dim innermost, :func:`kvlc.compiler.algebra.layout.row_major`)
on per-rank sizes; a ``head`` dim is divided by the TP size (:func:`~kvlc.compiler.algebra.layout.shard`);
a ``sections`` dim becomes one field per section sharing the parent's strides (a ``replicated`` section
keeps its whole size on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlc.compiler.algebra.layout import row_major, shard, valid_tp_sizes
from kvlc.compiler.plan.model import PlanDim, PlanField
from kvlc.compiler.plan.records import Placed, alignment_problems, record_overlaps
from kvlc.compiler.spec.dtypes import DTYPE_SIZES, PACKED
from kvlc.compiler.spec.models import BlockLayout, Dim, LayoutSpec
from kvlc.errors import Problem, did_you_mean, format_path


def unknown_fix(name: str, choices, where: str) -> str:
    """How to fix an unknown name: the closest valid names, else declaring it ``where``.

    >>> unknown_fix("kv_hnd", ["kv", "kv_nhd"], "layouts")
    "did you mean 'kv_nhd'? Otherwise declare it under layouts"
    >>> unknown_fix("zzz", ["kv"], "layouts")
    'declare it under layouts'
    """
    hint = did_you_mean(name, choices)
    return f"{hint} Otherwise declare it under {where}" if hint.startswith("did you mean") else \
        f"declare it under {where}"


@dataclass(frozen=True)
class SizedDim:
    """A spec dim with its per-rank (``local``) and global size resolved."""

    dim: Dim
    local: int
    global_size: int


@dataclass(frozen=True)
class FieldExtent:
    """Bytes ``[start, end)`` a field takes in its block; ``index`` is its position in the spec."""

    start: int
    end: int
    index: int
    name: str


@dataclass(frozen=True)
class ResolvedLayout:
    """A block layout's fields and block bytes, and the problems found (empty when it resolved)."""

    fields: tuple[PlanField, ...]
    block_bytes: int
    problems: tuple[Problem, ...]


class LayoutResolver:
    """Resolves block layouts of one spec, once per (layout name, token entries per kernel block, tokens per entry).

    ``tokens`` counts the entries of a ``token`` dim: the kernel block's tokens divided by the group's
    ``tokens_per_entry`` (``per``; 1 unless the group's cache is compressed).
    """

    def __init__(self, spec: LayoutSpec):
        self.tp = spec.parallel.tp_size
        self.known = spec.model.known_sizes()
        self._done: dict[tuple[str, int, int], ResolvedLayout] = {}

    def __call__(self, name: str, layout: BlockLayout, tokens: int, per: int = 1) -> ResolvedLayout:
        key = (name, tokens, per)
        if key not in self._done:
            problems: list[Problem] = []
            fields, nbytes = self._layout(name, layout, tokens, problems, per)
            self._done[key] = ResolvedLayout(fields, nbytes, tuple(problems))
        return self._done[key]

    # ------------------------------------------------------------------ dims
    def _named_size(self, dim: Dim, path: tuple, problems: list) -> int | None:
        if dim.size not in self.known:
            problems.append(Problem(path + ("size",), f"dim '{dim.name}' names unknown model size "
                                    f"'{dim.size}'", expected=f"one of {sorted(self.known)}",
                                    found=repr(dim.size), fix=unknown_fix(dim.size, self.known, "model.sizes")))
            return None
        return self.known[dim.size]

    def _implied_size(self, dim: Dim, tokens: int, path: tuple, problems: list) -> int | None:
        """A dim without a size: the kernel block's tokens, or the model size of that name."""
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
        problems.append(Problem(path, f"dim '{dim.name}' has no size", expected="an integer size",
                                found="nothing", fix=f"add 'size:' or declare model.sizes.{dim.name}"))
        return None

    def dim_size(self, dim: Dim, tokens: int, path: tuple, problems: list, per: int = 1) -> int | None:
        """The global size of a dim, checked against the model and the kernel block size."""
        size = self._named_size(dim, path, problems) if isinstance(dim.size, str) else dim.size
        if size is None:
            return None if isinstance(dim.size, str) else self._implied_size(dim, tokens, path, problems)
        if dim.role == "token" and size != tokens:
            problems.append(_token_size_problem(dim, size, tokens, path, per))
            return None
        expect = self.known.get(dim.name)
        if expect is not None and size != expect and not dim.sections:
            problems.append(Problem(path + ("size",), f"dim '{dim.name}' disagrees with the model",
                                    expected=f"{expect} (model)", found=str(size),
                                    fix=f"use size {expect} or correct the model"))
        return size

    def per_rank(self, dim_name: str, global_size: int, where: str, problems: list,
                 allow_replicas: bool = True) -> int | None:
        """Heads per rank of a head dim, or a problem at ``parallel.tp_size`` listing the TPs that work."""
        local = shard(global_size, self.tp)
        if local is not None and (allow_replicas or global_size % self.tp == 0):
            return local
        valid = valid_tp_sizes(global_size) if allow_replicas else \
            [t for t in range(1, global_size + 1) if global_size % t == 0]
        shown = ", ".join(map(str, valid))
        problems.append(Problem(("parallel", "tp_size"), f"tp_size {self.tp} cannot split '{dim_name}' of size "
                                f"{global_size} ({where})",
                                expected=f"a divisor of {global_size}" + (f" (sharded) or a multiple of "
                                                                          f"{global_size} (replicated)"
                                                                          if allow_replicas else ""),
                                found=str(self.tp),
                                fix=f"set parallel.tp_size to one of {shown}, or change the dim's size"))
        return None

    def _sized(self, f, fpath: tuple, tokens: int, problems: list, per: int = 1) -> list[SizedDim] | None:
        """Every dim of a spec field with its per-rank and global size (None if one failed)."""
        out: list[SizedDim] = []
        ok = True
        for di, d in enumerate(f.dims):
            where = format_path(fpath + ("dims", di))
            if d.sections:
                locs = [self.per_rank(f"{d.name}.{s}", g, f"{where}.sections.{s}", problems, False)
                        if d.role == "head" and s not in f.replicated else g for s, g in d.sections.items()]
                if None in locs:
                    ok = False
                else:
                    out.append(SizedDim(d, sum(locs), sum(d.sections.values())))
                continue
            g = self.dim_size(d, tokens, fpath + ("dims", di), problems, per)
            local = None if g is None else (self.per_rank(d.name, g, where, problems) if d.role == "head" else g)
            if local is None:
                ok = False
            else:
                out.append(SizedDim(d, local, g))
        return out if ok else None

    # ------------------------------------------------------------------ fields
    def _fields(self, f, sizes: list[SizedDim], start: int) -> list[PlanField]:
        """The plan field(s) of one spec field at byte ``start``: one, or one per section of a sectioned dim."""
        item = DTYPE_SIZES[f.dtype]
        strides = (tuple(s.dim.stride for s in sizes) if f.dims[0].stride is not None
                   else row_major([s.local for s in sizes], item).stride)
        if f.kind == "sections":
            return self._sections(f, sizes, start, strides, item)
        dims = tuple(PlanDim(name=s.dim.name, role=s.dim.role or "", size=s.local, global_size=s.global_size,
                             stride=st) for s, st in zip(sizes, strides))
        return [PlanField(name=f.name, dtype=f.dtype, itemsize=item, offset=start, dims=dims)]

    def _sections(self, f, sizes: list[SizedDim], start: int, strides: tuple, item: int) -> list[PlanField]:
        """A sectioned field (Mamba conv x|B|C) as one plan field ``name.section`` per section, in order,
        each at the offset where the previous section ends along the split dim. A ``replicated`` section's
        split dim is a plain dim of its whole size: every rank holds all of it, like a field without heads."""
        split = next(i for i, s in enumerate(sizes) if s.dim.sections)
        d_split = sizes[split].dim
        out, at = [], 0
        for sec, g in d_split.sections.items():
            sharded = d_split.role == "head" and sec not in f.replicated
            local = g // self.tp if sharded else g
            dims = tuple(PlanDim(name=s.dim.name, size=(local if i == split else s.local),
                                 role=("head" if sharded else "") if i == split else s.dim.role or "",
                                 global_size=(g if i == split else s.global_size), stride=strides[i])
                         for i, s in enumerate(sizes))
            out.append(PlanField(name=f"{f.name}.{sec}", dtype=f.dtype, itemsize=item,
                                 offset=start + at * strides[split], dims=dims))
            at += local
        return out

    def _layout(self, name: str, layout: BlockLayout, tokens: int, problems: list, per: int = 1):
        fields: list[PlanField] = []
        spans: list[FieldExtent] = []
        placed: list[Placed] = []
        cursor = 0
        for fi, f in enumerate(layout.fields):
            sizes = self._sized(f, ("layouts", name, "fields", fi), tokens, problems, per)
            if sizes is not None and f.dtype in PACKED:
                sizes = packed_sizes(f, sizes, ("layouts", name, "fields", fi), problems)
            if sizes is None:
                continue
            item = DTYPE_SIZES[f.dtype]
            problems.extend(alignment_problems(name, fi, f, item))
            start = cursor if f.offset is None else f.offset
            made = self._fields(f, sizes, start)
            extent = made[0].extent if f.dims[0].stride is not None else \
                row_major([s.local for s in sizes]).size * item
            cursor = start + extent
            spans.append(FieldExtent(start, cursor, fi, f.name))
            placed.append(Placed(fi, f.name, tuple(made)))
            fields.extend(made)
        block_bytes = layout.size if layout.size is not None else max((s.end for s in spans), default=0)
        strided = any(f.dims[0].stride is not None for f in layout.fields)
        if strided:  # interleaved records: the byte-exact check replaces the interval one
            problems.extend(record_overlaps(name, placed))
        problems.extend(span_problems(name, spans, block_bytes, overlaps=not strided))
        return tuple(fields), block_bytes


def packed_sizes(f, sizes: list[SizedDim], fpath: tuple, problems: list) -> list[SizedDim] | None:
    """The dims of a packed-dtype field (``fp4_e2m1``) in storage items: the innermost dim counts bytes, each
    holding ``PACKED[dtype]`` consecutive values; a size that fills a byte only partly is a problem there.

    >>> from kvlc.compiler.spec.models import ArrayField
    >>> f = ArrayField(name="k", dtype="fp4_e2m1", dims=({"name": "head_dim", "size": 7},))
    >>> problems = []
    >>> packed_sizes(f, [SizedDim(f.dims[0], 7, 7)], ("layouts", "kv"), problems), problems[0].what
    (None, "fp4_e2m1 field 'k' packs 2 values per byte, but its innermost dim 'head_dim' has 7")
    """
    per, last = PACKED[f.dtype], sizes[-1]
    if last.local % per == 0:
        return sizes[:-1] + [SizedDim(last.dim, last.local // per, last.global_size // per)]
    problems.append(Problem(fpath + ("dims", len(sizes) - 1),
                            f"{f.dtype} field '{f.name}' packs {per} values per byte, but its innermost "
                            f"dim '{last.dim.name}' has {last.local}",
                            expected=f"a multiple of {per} (whole bytes)", found=str(last.local),
                            fix=f"use an even size ({last.local - last.local % per} or "
                                f"{last.local + per - last.local % per}), put a dim of even size innermost, "
                                "or store the values as uint8"))
    return None


def span_problems(layout: str, spans: list[FieldExtent], block_bytes: int, overlaps: bool = True) -> list[Problem]:
    """Fields that overlap one another (unless ``overlaps`` is False), or end outside their block.

    >>> [p.what for p in span_problems("kv", [FieldExtent(0, 8, 0, "k"), FieldExtent(4, 12, 1, "v")], 10)]
    ["field 'v' overlaps field 'k'", "field 'v' ends outside its block"]
    """
    out = []
    ordered = sorted(spans, key=lambda s: (s.start, s.end, s.index, s.name))
    for a, b in zip(ordered, ordered[1:]) if overlaps else ():
        if b.start < a.end:
            out.append(Problem(("layouts", layout, "fields", b.index, "offset"), f"field '{b.name}' overlaps field "
                               f"'{a.name}'", expected=f"offset >= {a.end}", found=f"bytes [{b.start}, {b.end})",
                               fix="move the field or let its offset default"))
    for s in ordered:
        if s.end > block_bytes:
            out.append(Problem(("layouts", layout, "fields", s.index), f"field '{s.name}' ends outside its block",
                               expected=f"end <= block size {block_bytes}", found=f"end {s.end}",
                               fix="raise the layout's size or shrink the field"))
    return out


def _token_size_problem(dim: Dim, size: int, tokens: int, path: tuple, per: int) -> Problem:
    """A token dim whose explicit size is not the kernel block's tokens (or entries, ``per`` tokens each)."""
    what = ("the region's groups hold per-request state" if tokens == 0
            else f"kernel blocks hold {tokens} tokens" if per == 1 else
            f"kernel blocks hold {tokens} entries ({tokens * per} tokens, one entry per {per})")
    unit = "tokens" if per == 1 else "entries"
    return Problem(path + ("size",), f"token dim '{dim.name}' has {size} {unit} but {what}",
                   expected=str(tokens), found=str(size),
                   fix="omit the size of token dims; it follows the group's kernel block size"
                   + ("" if per == 1 else " and tokens_per_entry"))
