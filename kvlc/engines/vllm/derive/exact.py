"""CPU_ATTN's block halves with their real dim orders, as a plan (the spec language cannot say them).

Measured on a live vLLM 0.32 engine with the CPU kernels' ``vec`` ISA (keys and values
of a real prefill compared with the same model's in transformers): per block and KV
head the K half holds K transposed, ``[head_dim][token]``, and the V half ``[token][head_dim]``.
The plan keeps everything of the derived plan (storages, offsets, block strides, groups)
and replaces each CPU region's opaque ``kv`` field by fields ``k`` and ``v`` whose dims
carry these byte strides, so pairing can cut token ranges out of blocks.
"""

from __future__ import annotations

from kvlc.compiler.plan.model import PlanDim, PlanField
from kvlc.engines.vllm.derive.view import EngineView, KvPacking, ViewError

MEASURED_ISAS = ("vec",)


def _fields(region, head_dim: int) -> tuple[PlanField, PlanField]:
    kv = region.fields[0]
    head = kv.dims[0]
    n, item = region.block_tokens, kv.itemsize
    token = dict(name="token", role="token", size=n, global_size=n)
    dim = dict(name="head_dim", size=head_dim, global_size=head_dim)
    k = PlanField(name="k", dtype=kv.dtype, itemsize=item, offset=kv.offset,
                  dims=(head, PlanDim(**dim, stride=n * item), PlanDim(**token, stride=item)))
    v = PlanField(name="v", dtype=kv.dtype, itemsize=item, offset=kv.offset + n * head_dim * item,
                  dims=(head, PlanDim(**token, stride=head_dim * item), PlanDim(**dim, stride=item)))
    return k, v


def cpu_exact_plan(view: EngineView, plan):
    """``plan`` (derived from ``view``) with exact K/V fields when ``view`` is CPU_ATTN; else ``plan``."""
    if view.kv_packing != KvPacking.PER_HEAD_BLOCK:
        return plan
    if view.cpu_isa not in MEASURED_ISAS:
        raise ViewError(f"the CPU attention ISA '{view.cpu_isa or 'unknown'}' was not measured; kvlc knows the "
                        f"order inside K/V halves for {', '.join(MEASURED_ISAS)} only; fix: use the derived plan "
                        "(same block size on both engines) or measure the ISA's layout")
    regions = tuple(r.model_copy(update={"fields": _fields(r, view.model.head_dim)}) for r in plan.regions)
    return plan.model_copy(update={"regions": regions, "name": plan.name + "-exact"})
