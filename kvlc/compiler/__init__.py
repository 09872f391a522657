"""kvlc's compiler: spec text → frozen, content-hashed :class:`Plan`.

Stages, in the order data flows (one module each):

    source    YAML / jinja2 template → plain data with file:line:col marks
    validate  plain data → typed, frozen :class:`LayoutSpec` (pydantic)
    PASSES    expand → resolve → check → build_plan (pure functions)

Pairing two plans lives in :mod:`kvlc.compiler.pair`. Nothing here imports nixl or torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from kvlc.compiler.check import check
from kvlc.compiler.expand import expand, layer_range
from kvlc.compiler.geometry import Resolved, resolve
from kvlc.compiler.plan import Plan, PlanModel, PlanParallel
from kvlc.compiler.source import read_source
from kvlc.compiler.spec import LayoutSpec
from kvlc.compiler.validate import validate
from kvlc.errors import CompileError, Problem, SpecError


def build_plan(res: Resolved) -> Plan:
    """Pass 4 — assemble the frozen :class:`Plan` from checked geometry."""
    spec = res.spec
    return Plan(
        name=spec.name,
        model=PlanModel(name=spec.model.name, num_layers=spec.model.num_layers,
                        sizes=dict(sorted(spec.model.known_sizes().items()))),
        parallel=PlanParallel(tp_size=spec.parallel.tp_size, dcp_size=spec.parallel.dcp_size,
                              layers=layer_range(spec)),
        groups=res.groups,
        storages=tuple(s.storage for s in res.storages),
        regions=tuple(r.region for r in res.regions),
    )


PASSES = (expand, resolve, check, build_plan)


def load_spec(path_or_text: str | Path, config: Mapping | None = None,
              overrides: Mapping | None = None) -> LayoutSpec:
    """Load and validate a spec from a file path (``.yaml`` or ``.yaml.j2``) or YAML text.

    >>> spec = load_spec("layouts/llama-3.1-8b.yaml")
    >>> spec.model.num_kv_heads
    8
    """
    source = read_source(path_or_text, config, overrides)
    spec = validate(source)
    spec._source = source
    return spec


def _locate(problems, source) -> list[Problem]:
    """Attach file marks, drop repeats, and order problems as they stand in the file."""
    out: dict = {}
    for p in problems:
        if p.mark is None and source is not None:
            p = Problem(p.path, p.what, p.expected, p.found, p.fix, source.mark(p.path))
        out.setdefault(str(p), p)
    return sorted(out.values(), key=lambda p: (p.mark.line, p.mark.col) if p.mark else (0, 0))


def compile_spec(spec_or_path: LayoutSpec | str | Path, config: Mapping | None = None,
                 overrides: Mapping | None = None) -> Plan:
    """Run every pass over a spec (or a path / YAML text) and return its :class:`Plan`.

    >>> plan = compile_spec("layouts/llama-3.1-8b.yaml")
    >>> len(plan.digest)
    64
    """
    spec = spec_or_path if isinstance(spec_or_path, LayoutSpec) else load_spec(spec_or_path, config, overrides)
    value = spec
    try:
        for stage in PASSES:
            value = stage(value)
    except SpecError as exc:
        raise type(exc)(_locate(exc.problems, spec._source)) from None
    return value


__all__ = ["PASSES", "Plan", "LayoutSpec", "load_spec", "compile_spec", "CompileError", "SpecError"]
