"""Resolve, part 1b — per-token records: exact byte checks for fields with explicit strides.

A field with explicit strides is a strided set of bytes, ``offset + sum(c[i] * stride[i]) + [0, itemsize)``.
Fields of a record layout interleave (fp8 values, fp32 scales and bf16 values inside one
656-byte token record), so the interval test of packed fields would call them overlapping.
Here each field is cut into its contiguous runs (inner dims whose stride continues the run
are merged), every run is enumerated, and sorted runs are compared: two fields share a byte
exactly when two of their runs do. The enumeration is bounded by :data:`MAX_RUNS`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvlc.compiler.algebra.layout import Layout
from kvlc.compiler.plan.model import PlanField
from kvlc.errors import Problem

MAX_RUNS = 1 << 22  # contiguous runs one layout's exact check may enumerate


@dataclass(frozen=True)
class Placed:
    """A spec field (``index`` in the layout) and the plan fields it resolved to."""

    index: int
    name: str
    fields: tuple[PlanField, ...]


def field_runs(f: PlanField) -> tuple[Layout, int]:
    """A field as its contiguous runs: the layout of run starts (offset excluded) and the run length.

    >>> from kvlc.compiler.plan.model import PlanDim
    >>> f = PlanField(name="nope", dtype="fp8_e4m3", itemsize=1, offset=0, dims=(
    ...     PlanDim(name="token", size=64, global_size=64, stride=656),
    ...     PlanDim(name="nope", size=512, global_size=512, stride=1)))
    >>> runs, length = field_runs(f)
    >>> str(runs), length
    ('64:656', 512)
    """
    run = f.itemsize
    dims = list(f.dims)
    while dims and (dims[-1].stride == run or dims[-1].size == 1):
        run *= dims.pop().size
    shape = tuple(d.size for d in dims) or (1,)
    stride = tuple(d.stride for d in dims) or (0,)
    return Layout(shape, stride), run


def _where(p: Placed, path: tuple) -> tuple:
    return path + ("fields", p.index)


def _describe(f: PlanField) -> str:
    return f"'{f.name}' {f.layout} from offset {f.offset}"


def record_overlaps(layout: str, placed: list[Placed]) -> list[Problem]:
    """Problems for every field sharing a byte with an earlier one (or with itself), exactly.

    >>> from kvlc.compiler.plan.model import PlanDim
    >>> def f(name, off, n, item, stride):
    ...     return Placed(0, name, (PlanField(name=name, dtype="x", itemsize=item, offset=off, dims=(
    ...         PlanDim(name="token", size=4, global_size=4, stride=16),
    ...         PlanDim(name="c", size=n, global_size=n, stride=item))),))
    >>> record_overlaps("r", [f("a", 0, 8, 1, 1), f("b", 8, 2, 4, 4)])
    []
    >>> [p.what for p in record_overlaps("r", [f("a", 0, 8, 1, 1), f("b", 6, 2, 4, 4)])]
    ["field 'b' overlaps field 'a'"]
    """
    path = ("layouts", layout)
    total = sum(field_runs(f)[0].size for p in placed for f in p.fields)
    if total > MAX_RUNS:
        return [Problem(path + ("fields",), f"layout '{layout}' is too fragmented to check exactly",
                        expected=f"at most {MAX_RUNS:,} contiguous runs", found=f"{total:,} runs",
                        fix="give fields longer contiguous inner dims, or fewer tokens per block")]
    starts, ends, owner = [], [], []
    flat = [(p, f) for p in placed for f in p.fields]
    for k, (_, f) in enumerate(flat):
        runs, length = field_runs(f)
        s = runs.offsets() + f.offset
        starts.append(s)
        ends.append(s + length)
        owner.append(np.full(len(s), k, dtype=np.int64))
    start, end, who = (np.concatenate(a) for a in (starts, ends, owner))
    order = np.lexsort((who, start))
    start, end, who = start[order], end[order], who[order]
    reach = np.maximum.accumulate(end)
    holder = who[_argmax_prefix(end)]
    clash = np.nonzero(start[1:] < reach[:-1])[0]
    out, seen = [], set()
    for i in clash.tolist():
        a, b = flat[int(holder[i])], flat[int(who[i + 1])]
        pair = (a[1].name, b[1].name)
        if pair in seen:
            continue
        seen.add(pair)
        what = (f"field '{b[1].name}' overlaps itself" if a[1] is b[1]
                else f"field '{b[1].name}' overlaps field '{a[1].name}'")
        other = "elements that never share a byte" if a[1] is b[1] else \
            f"no byte in common with {_describe(a[1])}"
        out.append(Problem(_where(b[0], path) + ("offset",), what, expected=other,
                           found=f"{_describe(b[1])} also takes byte {int(start[i + 1])}",
                           fix="move the field's offset or change its strides"))
    return out


def _argmax_prefix(values: np.ndarray) -> np.ndarray:
    """Index of the running maximum of ``values`` at each position (first index on ties)."""
    idx = np.arange(len(values))
    best = np.where(values == np.maximum.accumulate(values), idx, 0)
    return np.maximum.accumulate(best)


def alignment_problems(layout: str, index: int, f, itemsize: int) -> list[Problem]:
    """An explicit field offset or dim stride that is not a multiple of the field's dtype size.

    >>> from kvlc.compiler.spec.models import ArrayField
    >>> f = ArrayField(name="s", dtype="fp32", offset=514, dims=[{"name": "token", "stride": 656}])
    >>> [p.what for p in alignment_problems("r", 2, f, 4)]
    ["field 's' offset 514 is not aligned to its dtype fp32"]
    """
    path = ("layouts", layout, "fields", index)
    out = []
    if f.offset is not None and f.offset % itemsize:
        out.append(Problem(path + ("offset",), f"field '{f.name}' offset {f.offset} is not aligned to its "
                           f"dtype {f.dtype}", expected=f"a multiple of {itemsize}", found=str(f.offset),
                           fix=f"use offset {f.offset - f.offset % itemsize} or {f.offset + itemsize - f.offset % itemsize}"))
    for di, d in enumerate(f.dims):
        if d.stride is not None and d.stride % itemsize:
            out.append(Problem(path + ("dims", di, "stride"), f"dim '{d.name}' stride {d.stride} is not aligned "
                               f"to dtype {f.dtype}", expected=f"a multiple of {itemsize}", found=str(d.stride),
                               fix="use a stride that keeps every element aligned"))
    return out
