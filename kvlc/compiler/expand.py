"""Pass 1 — expand: unroll ``repeat`` entries into flat storages and regions.

Each expanded item keeps the YAML path of the entry it came from, so that later
passes report problems at the right place in the file.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlc.compiler.spec import LayoutSpec, Range, Region, Storage
from kvlc.errors import Problem


@dataclass(frozen=True)
class Sourced:
    """An expanded item and the YAML path of the entry it was stamped from."""

    item: Region | Storage
    path: tuple


@dataclass(frozen=True)
class Expanded:
    spec: LayoutSpec
    storages: tuple[Sourced, ...]
    regions: tuple[Sourced, ...]
    problems: tuple[Problem, ...] = ()


def layer_range(spec: LayoutSpec) -> tuple[int, int]:
    """The layers this engine holds: the pipeline range, or all of the model's."""
    return spec.parallel.layers or (0, spec.model.num_layers)


def _values(rng: Range, spec: LayoutSpec) -> range:
    start, stop = layer_range(spec) if rng.range == "layers" else rng.range
    return range(start, stop)


def _stamp(item, env: dict):
    """Substitute ``{var}`` in every string field of a region or storage."""
    if not env:
        return item
    updates = {}
    for key, value in item:
        if isinstance(value, str) and "{" in value:
            updates[key] = value.format(**env)
        elif isinstance(value, tuple) and value and all(isinstance(v, str) for v in value):
            updates[key] = tuple(v.format(**env) if "{" in v else v for v in value)
    return item.model_copy(update=updates) if updates else item


def _unroll(entries, key: str, path: tuple, spec, env: dict, out: list, problems: list) -> None:
    for i, entry in enumerate(entries):
        here = path + (i,)
        if getattr(entry, "kind", None) == "repeat":
            var = entry.repeat.var
            if var in env:
                problems.append(Problem(here + ("repeat", "var"), f"repeat variable '{var}' shadows an "
                                        "outer one", fix="use another name"))
                continue
            for value in _values(entry.repeat, spec):
                _unroll(getattr(entry, key), key, here + (key,), spec, {**env, var: value}, out, problems)
        else:
            try:
                out.append(Sourced(_stamp(entry, env), here))
            except (KeyError, IndexError, ValueError) as exc:
                problems.append(Problem(here + ("name",), f"cannot substitute {exc} in '{entry.name}'",
                                        expected=f"only variables {sorted(env) or 'none'}",
                                        found=str(exc), fix="use '{var}' of an enclosing repeat"))


def expand(spec: LayoutSpec) -> Expanded:
    """Unroll repetition; names like ``layer.{layer}.kv`` become ``layer.0.kv`` …"""
    problems: list = []
    storages: list = []
    regions: list = []
    _unroll(spec.storages, "storages", ("storages",), spec, {}, storages, problems)
    _unroll(spec.regions, "regions", ("regions",), spec, {}, regions, problems)
    return Expanded(spec, tuple(storages), tuple(regions), tuple(problems))
