"""Pass 1 — expand: unroll ``repeat`` entries into flat storages and regions.

Each expanded item keeps the YAML path of the entry it came from, so that later
passes report problems at the right place in the file.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlc.compiler.spec.models import LayoutSpec, Range, Region, Storage
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
    """The layers this engine holds: the pipeline range, or all of the model's.

    >>> from kvlc.compiler import load_spec
    >>> layer_range(load_spec("layouts/llama-3.1-8b.yaml"))
    (0, 32)
    """
    return spec.parallel.layers or (0, spec.model.num_layers)


def _values(rng: Range, spec: LayoutSpec):
    if rng.values is not None:
        return rng.values
    if rng.range == "layers":
        return range(*layer_range(spec))
    return range(*rng.range)


class StampError(ValueError):
    """A ``{...}`` in a repeated name that the enclosing repeats do not define."""

    def __init__(self, key: tuple, text: str, detail: str):
        super().__init__(detail)
        self.key, self.text, self.detail = key, text, detail


def _format(text: str, env: dict, key: tuple) -> str:
    try:
        return text.format(**env)
    except KeyError as exc:
        raise StampError(key, text, f"{{{exc.args[0]}}}") from None
    except (IndexError, ValueError) as exc:
        raise StampError(key, text, str(exc)) from None


def _has_var(text: str) -> bool:
    return "{" in text or "}" in text


def _stamp(item, env: dict):
    """Substitute ``{var}`` in every string field of a region or storage."""
    updates = {}
    for key, value in item:
        if isinstance(value, str) and _has_var(value):
            updates[key] = _format(value, env, (key,))
        elif isinstance(value, tuple) and value and all(isinstance(v, str) for v in value):
            updates[key] = tuple(_format(v, env, (key, i)) if _has_var(v) else v for i, v in enumerate(value))
    return item.model_copy(update=updates) if updates else item


def _unroll(entries, key: str, path: tuple, spec, env: dict, out: list, problems: list) -> None:
    for i, entry in enumerate(entries):
        here = path + (i,)
        if getattr(entry, "kind", None) == "repeat":
            var = entry.repeat.var
            if var in env:
                problems.append(Problem(here + ("repeat", "var"), f"repeat variable '{var}' shadows an "
                                        "outer one", expected=f"a name other than {sorted(env)}",
                                        found=repr(var), fix="use another name"))
                continue
            for value in _values(entry.repeat, spec):
                _unroll(getattr(entry, key), key, here + (key,), spec, {**env, var: value}, out, problems)
        else:
            try:
                out.append(Sourced(_stamp(entry, env), here))
            except StampError as exc:
                problem = Problem(here + exc.key, f"'{exc.text}' uses {exc.detail}, which no enclosing "
                                  "repeat defines",
                                  expected="{" + "}, {".join(sorted(env)) + "}" if env else
                                  "no '{...}' outside a repeat",
                                  found=exc.detail, fix="use the variable of an enclosing repeat"
                                  if env else "put the entry under 'repeat:' or drop the braces")
                if problem not in problems:  # once per entry, not once per repeated value
                    problems.append(problem)


def expand(spec: LayoutSpec) -> Expanded:
    """Unroll repetition; names like ``layer.{layer}.kv`` become ``layer.0.kv`` …

    >>> from kvlc.compiler import load_spec
    >>> exp = expand(load_spec("layouts/llama-3.1-8b.yaml"))
    >>> [r.item.name for r in exp.regions][:3], len(exp.regions)
    (['layer.0', 'layer.1', 'layer.2'], 32)
    """
    problems: list = []
    storages: list = []
    regions: list = []
    _unroll(spec.storages, "storages", ("storages",), spec, {}, storages, problems)
    _unroll(spec.regions, "regions", ("regions",), spec, {}, regions, problems)
    return Expanded(spec, tuple(storages), tuple(regions), tuple(problems))
