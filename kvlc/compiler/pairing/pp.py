"""Pipeline parallelism: which layers an engine holds, which a pairing covers, what a consumer lacks.

An engine holds the layers ``plan.parallel.layers = (start, stop)`` (all of them
without a pipeline split). A region belongs to layer ``N`` when its name is
``layer.N`` or starts with ``layer.N.`` (the names checked-in layouts, ``kvlc init``
and the vLLM adapter give); layers past the model's last (MTP draft layers) belong
to the stage that holds the last layer. Regions with other names belong to no layer
and must exist on both engines, as without pipeline parallelism.

Two engines pair the layers both hold (:func:`overlap`); a consumer gets all its
layers by pairing with every producer stage (:func:`coverage`).

>>> from kvlc import compile_spec
>>> plan = compile_spec("layouts/llama-3.1-8b.yaml")
>>> region_layer("layer.3.k"), region_layer("attn.0"), layers_text(plan.parallel.layers)
(3, None, '[0, 32)')
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvlc.compiler.plan.model import Plan

_LAYER = re.compile(r"^layer\.(\d+)(?:\.|$)")


def region_layer(name: str) -> int | None:
    """The layer a region name belongs to, or None when it names no layer."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def holds(plan: Plan, layer: int) -> bool:
    """Whether ``plan``'s engine holds ``layer`` (draft layers past the last: the last stage)."""
    start, stop = plan.parallel.layers
    return start <= layer < stop or (layer >= plan.model.num_layers and stop == plan.model.num_layers)


def holds_region(plan: Plan, name: str) -> bool:
    """Whether the region ``name`` lies in ``plan``'s layer window (True for regions of no layer)."""
    layer = region_layer(name)
    return layer is None or holds(plan, layer)


def overlap(a: Plan, b: Plan) -> tuple[int, int] | None:
    """The layers both engines hold, ``(start, stop)``, or None when they hold none in common."""
    start = max(a.parallel.layers[0], b.parallel.layers[0])
    stop = min(a.parallel.layers[1], b.parallel.layers[1])
    return (start, stop) if start < stop else None


def layers_text(window: tuple[int, int] | None) -> str:
    """``[start, stop)``, or ``none``."""
    return f"[{window[0]}, {window[1]})" if window else "none"


def _runs(layers: Sequence[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for x in layers:
        if out and out[-1][1] == x:
            out[-1] = (out[-1][0], x + 1)
        else:
            out.append((x, x + 1))
    return out


@dataclass(frozen=True)
class StageCover:
    """The layers one producer stage gives the consumer."""

    producer: str
    layers: tuple[int, int] | None


@dataclass(frozen=True)
class Coverage:
    """Which producer stage gives which of the consumer's layers, and which none gives."""

    consumer: str
    needs: tuple[int, int]
    stages: tuple[StageCover, ...]
    missing: tuple[tuple[int, int], ...]

    @property
    def complete(self) -> bool:
        return not self.missing

    def text(self) -> str:
        """One line per stage and one for what is missing.

        >>> from kvlc import compile_spec
        >>> p = compile_spec("layouts/llama-3.1-70b-tp4.yaml")
        >>> print(coverage(p, [p]).text())
        consumer llama-3.1-70b-tp4 needs layers [0, 80)
          llama-3.1-70b-tp4 gives layers [0, 80)
          every layer covered
        """
        lines = [f"consumer {self.consumer} needs layers {layers_text(self.needs)}"]
        lines += [f"  {s.producer} gives layers {layers_text(s.layers)}" for s in self.stages]
        lines.append("  missing layers " + ", ".join(layers_text(w) for w in self.missing) if self.missing
                     else "  every layer covered")
        return "\n".join(lines)


def cache_layers(plan: Plan) -> list[int]:
    """The layers of ``plan``'s window that hold a region, in order: a hybrid's MLP-only layers hold
    none and need no producer. A plan whose regions name no layer needs every layer of its window."""
    start, stop = plan.parallel.layers
    named = {x for r in plan.regions if (x := region_layer(r.name)) is not None}
    return [x for x in range(start, stop) if x in named or not named]


def coverage(consumer: Plan, producers: Sequence[Plan]) -> Coverage:
    """What a consumer gets by pairing with each of ``producers`` (its producer's pipeline stages):
    every layer of its window that holds a region must lie in some producer's window."""
    stages = tuple(StageCover(p.name, overlap(consumer, p)) for p in producers)
    given = {x for s in stages if s.layers for x in range(*s.layers)}
    return Coverage(consumer.name, consumer.parallel.layers, stages,
                    tuple(_runs([x for x in cache_layers(consumer) if x not in given])))


__all__ = ["region_layer", "cache_layers", "holds", "holds_region", "overlap", "layers_text", "coverage", "Coverage", "StageCover"]
