"""A user's spec against a live engine: every mismatch at once.

The plan compiled from the user's spec is compared with the plan derived from
the engine (:func:`~kvlc.engines.vllm.derive.spec.derive_spec`), region by region and
field by field; each mismatch names the vLLM tensor, the field, the spec's value
and the engine's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvlc.errors import did_you_mean
from kvlc.errors import BindingError


@dataclass(frozen=True)
class Mismatch:
    """One disagreement: which tensor (or ``model``/``storage ...``), which field, both values."""

    tensor: str
    field: str
    spec: str
    engine: str

    def __str__(self) -> str:
        return f"{self.tensor}: {self.field}: spec has {self.spec}, engine has {self.engine}"


class SpecMismatchError(BindingError):
    """A given spec does not describe the engine's KV-cache tensors; ``mismatches`` lists each."""

    def __init__(self, plan_name: str, mismatches: tuple[Mismatch, ...]):
        self.mismatches = tuple(mismatches)
        n = len(self.mismatches)
        lines = [f"spec '{plan_name}' does not match the engine's KV cache ({n} mismatch{'es' * (n != 1)}):"]
        lines += [f"  {m}" for m in self.mismatches]
        lines.append("  fix: regenerate the spec with `kvlc from-vllm`, or correct the values above")
        super().__init__("\n".join(lines))


def _cmp(out: list, tensor: str, field: str, spec: Any, engine: Any) -> None:
    if spec != engine:
        out.append(Mismatch(tensor, field, str(spec), str(engine)))


def _dims_text(f) -> str:
    return "(" + ", ".join(f"{d.name}={d.size}:{d.stride}" for d in f.dims) + ")"


def _compare_region(out: list, tensor: str, mine, theirs) -> None:
    for attr in ("storage", "offset", "num_blocks", "block_stride", "block_bytes", "block_tokens",
                 "kernel_blocks_per_block", "mem", "device"):
        _cmp(out, tensor, f"{mine.name}.{attr}", getattr(mine, attr), getattr(theirs, attr))
    fields = {f.name: f for f in theirs.fields}
    for f in mine.fields:
        g = fields.get(f.name)
        if g is None:
            out.append(Mismatch(tensor, f"{mine.name}.fields", f"field '{f.name}'",
                                f"fields {sorted(fields)} ({did_you_mean(f.name, fields)})"))
            continue
        where = f"{mine.name}.{f.name}"
        _cmp(out, tensor, f"{where}.dtype", f.dtype, g.dtype)
        _cmp(out, tensor, f"{where}.offset", f.offset, g.offset)
        _cmp(out, tensor, f"{where}.dims (name=size:byte stride)", _dims_text(f), _dims_text(g))
    missing = sorted(set(fields) - {f.name for f in mine.fields})
    if missing:
        out.append(Mismatch(tensor, f"{mine.name}.fields", "no field " + ", ".join(map(repr, missing)),
                            "fields " + ", ".join(map(repr, sorted(fields)))))


def _compare_model(out: list, plan, derived) -> None:
    _cmp(out, "model", "num_layers", plan.model.num_layers, derived.model.num_layers)
    for key, value in derived.model.sizes.items():
        _cmp(out, "model", f"sizes.{key}", plan.model.sizes.get(key, "nothing"), value)
    for attr in ("tp_size", "dcp_size", "dcp_interleave", "layers"):
        _cmp(out, "parallel", attr, getattr(plan.parallel, attr), getattr(derived.parallel, attr))


def _compare_storages(out: list, plan, derived) -> None:
    theirs = {s.name: s for s in derived.storages}
    for s in plan.storages:
        t = theirs.get(s.name)
        if t is None:
            out.append(Mismatch(f"storage '{s.name}'", "name", repr(s.name),
                                f"allocations {sorted(theirs)} ({did_you_mean(s.name, theirs)})"))
            continue
        _cmp(out, f"storage '{s.name}'", "mem:device", f"{s.mem}:{s.device}", f"{t.mem}:{t.device}")
        if s.size > t.size:
            out.append(Mismatch(f"storage '{s.name}'", "size", f"{s.size} bytes", f"{t.size} bytes allocated"))


def _compare_regions(out: list, plan, derived, view) -> None:
    tensor_of = {f"layer.{t.layer_index}": t.name for t in view.layers}

    def tensor(region: str) -> str:  # 'layer.3' and 'layer.3.k' name tensor model.layers.3...
        return tensor_of.get(".".join(region.split(".")[:2]), region)

    theirs = {r.name: r for r in derived.regions}
    for r in plan.regions:
        t = theirs.get(r.name)
        if t is not None:
            _compare_region(out, tensor(r.name), r, t)
        elif not r.optional:
            out.append(Mismatch(tensor(r.name), "region", f"region '{r.name}'",
                                f"no such layer tensor ({did_you_mean(r.name, theirs)})"))
    mine = {r.name for r in plan.regions}
    for name, t in theirs.items():
        if name not in mine:
            out.append(Mismatch(tensor(name), "region", "nothing", f"region '{name}' ({t.num_blocks} blocks)"))


def check_plan_against_view(plan, derived, view) -> None:
    """Raise :class:`SpecMismatchError` unless ``plan`` has the geometry of ``derived``, the plan derived
    from the engine in ``view`` (:func:`~kvlc.engines.vllm.derive.spec.derive_plan`)."""
    out: list[Mismatch] = []
    _compare_model(out, plan, derived)
    _compare_storages(out, plan, derived)
    _compare_regions(out, plan, derived, view)
    if out:
        raise SpecMismatchError(plan.name, tuple(out))
