"""The engine's KV cache as a kvlc plan: derived from vLLM, or a given spec checked against it.

:func:`engine_plan` is the connector's only door to the derivation
(:mod:`kvlc.engines.vllm.derive`): it builds the engine view, derives the spec
(or loads ``spec`` and checks it against the live tensors), compiles the plan and
picks the tensors to bind, one per storage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvlc.compiler import compile_spec
from kvlc.compiler.plan import Plan


@dataclass(frozen=True)
class EnginePlan:
    """A worker rank's plan, the tensors that back its storages, and the plan's group names
    in vLLM's KV-cache group order."""

    plan: Plan
    tensors: Mapping[str, Any]
    groups: tuple[str, ...]
    rank: int
    block_size: int


def engine_plan(vllm_config, kv_cache_config, kv_caches: Mapping[str, Any], rank: int,
                spec: str | None = None) -> EnginePlan:
    """Derive (or load and check) this worker's plan and its storage tensors."""
    try:
        from kvlc.engines.vllm import derive
    except ImportError:  # until the derivation lands
        from kvlc.engines.vllm import _interim_derive as derive

    view = derive.engine_view(vllm_config, kv_cache_config, kv_caches)
    if spec:
        plan = compile_spec(Path(spec))
        derive.check_spec(plan, view)
    else:
        plan = compile_spec(yaml.safe_dump(derive.derive_spec(view), sort_keys=False))
    tensors = derive.storage_tensors(plan, view, kv_caches)
    groups = tuple(g.name for g in plan.groups)
    return EnginePlan(plan, tensors, groups, rank, int(vllm_config.cache_config.block_size))
