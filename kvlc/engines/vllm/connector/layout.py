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
from kvlc.errors import KvlcError


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


def runnable_state(kv_cache_config) -> None:
    """Refuse, at start, an engine whose state layers vLLM cannot compute on this platform: Mamba-1 (vLLM's
    ``mamba_type`` MAMBA1: Jamba) on vLLM's CPU platform, whose ``vllm._C`` has no ``selective_scan_fwd``
    (``mamba_ssm.selective_scan_fn`` calls it for every prefill, so the engine's first request fails there,
    whatever connector it has). Checked by asking for the op, so a CPU build that has it passes."""
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import MambaSpec

    types = {getattr(g.kv_cache_spec.mamba_type, "name", str(g.kv_cache_spec.mamba_type))
             for g in getattr(kv_cache_config, "kv_cache_groups", None) or () if isinstance(g.kv_cache_spec, MambaSpec)}
    if "MAMBA1" not in types or not current_platform.is_cpu():
        return
    import torch
    try:
        torch.ops._C.selective_scan_fwd
    except (AttributeError, RuntimeError):
        raise KvlcError("this engine's state layers are vLLM mamba_type MAMBA1 (Mamba-1, e.g. Jamba), which vLLM's "
                        "CPU platform cannot compute: its vllm._C has no selective_scan_fwd (the first prefill fails "
                        "with \"'_OpNamespace' '_C' object has no attribute 'selective_scan_fwd'\", with or without a "
                        "KV connector); fix: serve this model on a GPU build of vLLM (kvlc derives its Mamba-1 state, "
                        "`kvlc from-vllm --from-engine` writes it)") from None


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
