"""The engine's KV cache as a kvlc plan: derived from vLLM, or a given spec checked against it.

:func:`engine_plan` is the connector's only door to the derivation
(:mod:`kvlc.engines.vllm.derive`): it reads the engine view, takes the derived plan
(``exact_plan``: for the CPU backend the plan with K and V in the real dim orders of the
engine's attention ISA, so engines of different block sizes pair) or compiles ``spec`` and
checks it against the live tensors, and picks the tensors to bind, one per storage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlc.compiler import compile_spec
from kvlc.compiler.plan.model import Plan


@dataclass(frozen=True)
class EnginePlan:
    """A worker rank's plan, the tensors that back its storages, and the plan's group names
    in vLLM's KV-cache group order."""

    plan: Plan
    tensors: Mapping[str, Any]
    groups: tuple[str, ...]
    rank: int
    block_size: int
    cpu_isa: str = ""  # CPU_ATTN: the attention ISA whose in-block order the plan states
    backend: str = ""  # the attention backend's name, as vLLM gives it


# vLLM 0.32's MLA backends on CPU: a token computed after KV loaded by any connector gets other RoPE keys
# than its own prefill gives it, so a decode engine's tokens differ from the engine alone (docs/vllm.md,
# "MLA on CPU"); vLLM turns prefix caching and chunked prefill off for them for the same reason.
CPU_MLA_BACKENDS = frozenset({"CPU_MLA", "AMX_MLA"})


def engine_plan(vllm_config, kv_cache_config, kv_caches: Mapping[str, Any], rank: int,
                spec: str | None = None) -> EnginePlan:
    """Derive (or load and check) this worker's plan and its storage tensors."""
    from kvlc.engines.vllm.derive import spec as derive
    from kvlc.engines.vllm.derive.storages import storage_tensors

    view = derive.engine_view(vllm_config, kv_cache_config, kv_caches)
    if spec:
        plan = compile_spec(Path(spec))
        derive.check_spec(plan, view)
    else:
        plan = derive.exact_plan(view)
    return EnginePlan(plan, storage_tensors(plan, view, kv_caches), derive.group_names(view), rank,
                      int(vllm_config.cache_config.block_size), view.cpu_isa, view.backend)
