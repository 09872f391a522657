"""Stand-in for :mod:`kvlc.engines.vllm.derive` until it lands: the CPU attention backend only.

Same four functions, same meaning, fewer checks. Deleted once ``derive`` is merged.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvlc.errors import KvlcError

_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


@dataclass(frozen=True)
class _View:
    model: str
    layers: tuple[str, ...]
    num_blocks: int
    heads: int
    block_size: int
    head_size: int
    dtype: str
    tp_rank: int
    tp_size: int


def _layer_index(name: str) -> int:
    m = re.search(r"layers\.(\d+)\.", name)
    if not m:
        raise KvlcError(f"layer name {name!r}: expected '...layers.N....'")
    return int(m.group(1))


def engine_view(vllm_config, kv_cache_config, kv_caches: Mapping[str, Any]) -> _View:
    from vllm.distributed.parallel_state import get_tp_group

    names = tuple(sorted(kv_caches, key=_layer_index))
    t = kv_caches[names[0]]
    nb, heads, bs, two_c = t.shape
    tp = vllm_config.parallel_config.tensor_parallel_size
    return _View(str(vllm_config.model_config.model), names, nb, heads, bs, two_c // 2,
                 _DTYPES[str(t.dtype)], get_tp_group().rank_in_group, tp)


def derive_spec(view: _View) -> dict:
    """The CPU backend's "vec" layout: per layer, per KV head, K as [head_dim][token] then V as
    [token][head_dim] (measured with vLLM's own ``cpu_attn_reshape_and_cache``). The spec
    language has no dim strides, so each (layer, head) is a region whose block stride is the
    whole block; TP heads are therefore not mapped across engines of different TP."""
    es = {"bf16": 2, "fp16": 2, "fp32": 4}[view.dtype]
    n, c, h = view.block_size, view.head_size, view.heads
    head_bytes = 2 * n * c * es
    layer_bytes = view.num_blocks * h * head_bytes
    regions = [{"name": f"layer.{li}.head.{hi}", "storage": "kv", "layout": "cpu_vec",
                "num_blocks": view.num_blocks, "groups": ["full"],
                "offset": li * layer_bytes + hi * head_bytes, "block_stride": h * head_bytes}
               for li in range(len(view.layers)) for hi in range(h)]
    fields = [{"name": "k", "dtype": view.dtype, "dims": [{"name": "head_dim", "size": c},
                                                         {"name": "token", "role": "token"}]},
              {"name": "v", "dtype": view.dtype, "dims": [{"name": "token", "role": "token"},
                                                         {"name": "head_dim", "size": c}]}]
    return {
        "kvlc": 1,
        "name": f"vllm-cpu-tp{view.tp_size}-h{h}-b{view.block_size}-{view.dtype}",
        "model": {"name": view.model.rsplit("/", 1)[-1] or "model", "num_layers": len(view.layers),
                  "num_kv_heads": h * view.tp_size, "head_dim": c},
        "parallel": {"tp_size": view.tp_size},
        "block_size": view.block_size,
        "groups": [{"name": "full", "kind": "full_attention"}],
        "storages": [{"name": "kv", "mem": "DRAM", "size": len(view.layers) * layer_bytes}],
        "layouts": {"cpu_vec": {"fields": fields}},
        "regions": regions,
    }


def spec_yaml(view: _View) -> str:
    import yaml

    return yaml.safe_dump(derive_spec(view), sort_keys=False)


def check_spec(plan, view: _View) -> None:
    if plan.block_size != view.block_size if hasattr(plan, "block_size") else False:
        raise KvlcError(f"spec block_size {plan.block_size} != engine {view.block_size}")


def storage_tensors(plan, view: _View, kv_caches: Mapping[str, Any]) -> dict[str, Any]:
    import torch

    first = kv_caches[view.layers[0]]
    whole = torch.empty(0, dtype=torch.uint8)
    whole.set_(first.untyped_storage(), 0, (first.untyped_storage().nbytes(),))
    if whole.data_ptr() != min(kv_caches[n].data_ptr() for n in view.layers):
        raise KvlcError("interim derive: layer tensors do not start at their allocation's start")
    return {"kv": whole}
