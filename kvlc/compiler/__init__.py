"""kvlc's compiler: spec text → frozen, content-hashed :class:`Plan` → transfer program → descriptors.

Stages as folders, in the order data flows (every pass and check is a pure function):

    spec/        source (YAML / jinja2 template → plain data with file:line:col marks), the typed,
                 frozen models of the spec language, validate → :class:`LayoutSpec`
    plan/        PASSES: expand → resolve (fields) → check (CHECKS) → build: the :class:`Plan`
    pairing/     match (which regions pair: fields by the region they belong to, ``part_of``) →
                 compat (CHECKS, REGION_CHECKS, FIELD_CHECKS) → tp (head mapping) → runs (tile
                 templates) → program (:class:`TransferProgram`, pure data); pair puts them together
    request/     free functions over a program, per request: check_request → bind → instantiate
                 ((N, 3) rows) or prepared (strided lists + indices); window_stats

Shared algebra: :mod:`~kvlc.compiler.algebra.layout` (``shape:stride``, shard, tile) and
:mod:`~kvlc.compiler.algebra.copies` (runs). Nothing here imports nixl or torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from pydantic import ValidationError

from kvlc.compiler.plan.build import build_plan
from kvlc.compiler.plan.check import check
from kvlc.compiler.plan.expand import expand
from kvlc.compiler.plan.model import Plan
from kvlc.compiler.plan.resolve import resolve
from kvlc.compiler.spec.source import read_source
from kvlc.compiler.spec.models import LayoutSpec
from kvlc.compiler.spec.validate import validate
from kvlc.errors import Mark, Problem, SpecError

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


def load_plan(path: str | Path, config: Mapping | None = None, overrides: Mapping | None = None) -> Plan:
    """The plan an engine needs, from a plan JSON file (``kvlc compile`` output) or a spec / template.

    A ``.json`` file is read as a plan (its canonical form is checked by the model); anything
    else is compiled. Raises :class:`~kvlc.errors.SpecError` for a file that is neither.

    >>> load_plan("layouts/llama-3.1-8b.yaml").name
    'llama-3.1-8b-tp1'
    """
    p = Path(path)
    if p.suffix != ".json":
        return compile_spec(p, config, overrides)
    try:
        return Plan.from_json(p.read_bytes())
    except OSError as exc:
        raise SpecError([Problem((), f"cannot read plan: {exc.strerror}", expected="a readable plan JSON file",
                                 found=str(p), mark=Mark(str(p), 1, 1))]) from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "<root>"
        raise SpecError([Problem((), f"not a kvlc plan: {where}: {first['msg']}", expected="the JSON that "
                                 "`kvlc compile` writes", found=f"{exc.error_count()} problem(s)",
                                 fix="compile the spec again with this kvlc version",
                                 mark=Mark(str(p), 1, 1))]) from None


__all__ = ["PASSES", "load_spec", "compile_spec", "load_plan"]
