"""The byte map of one block: where each field lies, in which dim order, and what is replicated.

For each distinct block layout of a plan (regions with equal fields and block bytes share one),
:func:`block_maps` gives every field's byte range and the byte runs of its **first slice**:
head 0 of the rank for a field with a head dim (one run in a head-major HND layout, one run
per token in a token-major NHD one), else token 0, else the whole field. Pure arithmetic over
the plan's dims and strides.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from kvlc.compiler.plan.model import Plan, PlanField, PlanRegion
from kvlc.collapse import vary_label
from kvlc.explain.numbers import dim_short
from kvlc.explain.summary import replicas

MAX_RUNS = 512     # runs of a slice drawn at most (a longer list is cut, and says so)


@dataclass(frozen=True)
class FieldMap:
    """One field of a block: ``[offset, offset + extent)``; ``slice_runs`` are ``(start, length)``."""

    name: str
    dtype: str
    offset: int
    extent: int
    order: str                 # "token x head x head_dim" (outermost first)
    shape: str                 # "token=16 head=8/8 head_dim=128"
    replicas: int
    slice_what: str            # "head 0", "token 0" or "all"
    slice_runs: tuple[tuple[int, int], ...]
    slice_total: int           # runs of the slice before MAX_RUNS cut them


@dataclass(frozen=True)
class BlockMap:
    """One block layout: its bytes, its fields, and the regions (runs of names) that use it."""

    regions: str               # e.g. "layer.{0..31}"
    count: int                 # regions using it
    block_bytes: int
    block_stride: int
    tokens: int                # tokens per kernel block (0: per-request state)
    fields: tuple[FieldMap, ...]


def slice_runs(f: PlanField, role: str) -> list[tuple[int, int]]:
    """Byte runs ``(start, length)`` of index 0 of the ``role`` dim of ``f``, merged where contiguous.

    >>> from kvlc import compile_spec
    >>> nhd = compile_spec("layouts/llama-3.1-8b.yaml").regions[0].fields[1]         # 8 heads a rank
    >>> hnd = compile_spec("layouts/llama-3.1-70b-hnd-tp4.yaml").regions[0].fields[1]  # 2 heads a rank
    >>> len(slice_runs(nhd, "head")), slice_runs(nhd, "head")[:2], slice_runs(hnd, "head")
    (16, [(32768, 256), (34816, 256)], [(8192, 4096)])
    """
    dims = [d for d in f.dims if d.role != role]
    # innermost dims that are contiguous form one run
    run, i = f.itemsize, len(dims)
    while i > 0 and dims[i - 1].stride == run:
        run *= dims[i - 1].size
        i -= 1
    outer = dims[:i]
    starts = [f.offset + sum(k * d.stride for k, d in zip(idx, outer))
              for idx in product(*(range(d.size) for d in outer))] if outer else [f.offset]
    return _merged(sorted(starts), run)


def _merged(starts: list[int], run: int) -> list[tuple[int, int]]:
    """Runs of ``run`` bytes at sorted ``starts`` as ``(start, length)``, a run that continues the last joined to it."""
    out: list[list[int]] = []
    for s in starts:
        if out and out[-1][0] + out[-1][1] == s:
            out[-1][1] += run
        else:
            out.append([s, run])
    return [(a, b) for a, b in out]


def field_map(f: PlanField, tp_size: int) -> FieldMap:
    """The :class:`FieldMap` of one field."""
    role = "head" if f.dim("head") is not None else ("token" if f.dim("token") is not None else "")
    if role:
        runs = slice_runs(f, role)
        what = f"{role} 0" + (" of this rank" if role == "head" else "")
    else:
        runs, what = [(f.offset, f.extent)], "all"
    shape = " ".join(dim_short(f, i) for i in range(len(f.dims)))
    return FieldMap(f.name, f.dtype, f.offset, f.extent, " x ".join(d.name for d in f.dims), shape,
                    replicas(f, tp_size), what, tuple(runs[:MAX_RUNS]), len(runs))


def block_maps(plan: Plan) -> tuple[BlockMap, ...]:
    """One :class:`BlockMap` per distinct block layout, in plan order.

    >>> from kvlc import compile_spec
    >>> [(m.regions, m.block_bytes, [(f.name, f.offset) for f in m.fields])
    ...  for m in block_maps(compile_spec("layouts/llama-3.1-8b.yaml"))]
    [('layer.{0..31}', 65536, [('k', 0), ('v', 32768)])]
    """
    by_key: dict[tuple, list[PlanRegion]] = {}
    for r in plan.regions:
        by_key.setdefault((r.fields, r.block_bytes, r.block_tokens), []).append(r)
    out = []
    for regs in by_key.values():
        r = regs[0]
        out.append(BlockMap(vary_label([x.name for x in regs]), len(regs), r.block_bytes, r.block_stride,
                            r.block_tokens, tuple(field_map(f, plan.parallel.tp_size) for f in r.fields)))
    return tuple(out)
