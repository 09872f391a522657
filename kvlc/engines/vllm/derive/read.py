"""Read an :class:`EngineView` from live vLLM objects (vLLM and torch are imported here only).

Facts read (vLLM 0.32): ``model_config`` (name, total layers, total KV heads, head
size, MLA ranks), ``parallel_config`` and the distributed groups (TP/PP/DCP sizes
and ranks), ``cache_config`` (block size, KV dtype, resolved KV-cache layout), the
``KVCacheConfig`` (block count, groups and their ``KVCacheSpec`` kinds), the
attention layers' backend names, and per tensor its shape, strides, dtype,
``data_ptr`` and its untyped storage (the allocation it is a view of). vLLM hands a
connector each layer as its logical ``[blocks, heads, tokens, content]`` view.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvlc.engines.vllm.derive.view import (Axis, EngineView, GroupKind, GroupView, KvPacking, LayerTensor,
                                           ModelIdentity, ParallelView, Provenance, ViewError, layer_index)

TORCH_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32",
                "torch.float8_e4m3fn": "fp8_e4m3", "torch.float8_e5m2": "fp8_e5m2", "torch.int8": "int8",
                "torch.uint8": "uint8"}
FP8_CACHE_DTYPES = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


def packing_for(backend: str, mla: bool) -> KvPacking:
    """How ``backend`` reads the K|V content dim: CPU_ATTN per head block, the others per token."""
    if mla:
        return KvPacking.NONE
    return KvPacking.PER_HEAD_BLOCK if backend.upper() == "CPU_ATTN" else KvPacking.PER_TOKEN


def kv_dtype(tensor_dtype: str, cache_dtype: str | None) -> str:
    """kvlc dtype name of a KV tensor; fp8 caches stored as uint8 take the cache dtype's name."""
    name = TORCH_DTYPES.get(str(tensor_dtype))
    if name is None:
        raise ViewError(f"KV tensor dtype {tensor_dtype} has no kvlc name; kvlc knows "
                        f"{', '.join(sorted(TORCH_DTYPES))}")
    if name == "uint8" and cache_dtype in FP8_CACHE_DTYPES:
        return FP8_CACHE_DTYPES[cache_dtype]
    return name


def _group(g: Any) -> GroupView:
    from vllm.v1 import kv_cache_interface as kci
    spec = g.kv_cache_spec
    if isinstance(spec, kci.UniformTypeKVCacheSpecs) and spec.kv_cache_specs:
        spec = next(iter(spec.kv_cache_specs.values()))
    kind, window, chunk = GroupKind.OTHER, 0, 0
    if isinstance(spec, kci.MLAAttentionSpec):
        kind = GroupKind.MLA
    elif isinstance(spec, kci.SlidingWindowSpec):
        kind, window = GroupKind.SLIDING_WINDOW, int(spec.sliding_window)
    elif isinstance(spec, kci.ChunkedLocalAttentionSpec):
        kind, chunk = GroupKind.CHUNKED_LOCAL, int(spec.attention_chunk_size)
    elif isinstance(spec, kci.FullAttentionSpec):
        kind = GroupKind.FULL_ATTENTION
    elif isinstance(spec, kci.MambaSpec):
        kind = GroupKind.MAMBA
    return GroupView(kind=kind, block_size=int(spec.block_size), layer_names=tuple(g.layer_names),
                     window=window, chunk=chunk, spec_type=type(spec).__name__)


def _ranks(parallel_config: Any) -> dict:
    """TP/PP/DCP ranks of this worker, from vLLM's process groups when they exist."""
    out = {"tp_rank": 0, "pp_rank": 0, "dcp_rank": 0}
    try:
        from vllm.distributed import parallel_state as ps
        out["tp_rank"] = ps.get_tensor_model_parallel_rank()
        out["pp_rank"] = ps.get_pp_group().rank_in_group
        if getattr(parallel_config, "decode_context_parallel_size", 1) > 1:
            out["dcp_rank"] = ps.get_dcp_group().rank_in_group
    except (AssertionError, AttributeError, ImportError, RuntimeError):
        pass  # not initialized (a view built outside a worker): rank 0
    return out


def _backends(vllm_config: Any, names) -> set[str]:
    ctx = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", {}) or {}
    out = set()
    for n in names:
        layer = ctx.get(n)
        backend = getattr(layer, "attn_backend", None) if layer is not None else None
        if backend is not None and hasattr(backend, "get_name"):
            out.add(backend.get_name())
    return out


def _cpu_isa(vllm_config: Any, names) -> str:
    """The CPU attention kernels' ISA the metadata builder set on the layers ("vec", "amx", ...)."""
    ctx = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", {}) or {}
    isas = {getattr(ctx.get(n), "isa", None) for n in names} - {None}
    return ",".join(sorted(map(str, isas)))


def _layout(vllm_config: Any, kv_cache_config: Any) -> str:
    layout = getattr(kv_cache_config, "kv_cache_layout", None)
    if layout is None:
        try:
            layout = vllm_config.cache_config.get_resolved_kv_cache_layout().name
        except (AttributeError, ValueError):
            layout = "unknown"
    return str(getattr(layout, "name", layout))


def layer_tensor(name: str, t: Any, mla: bool = False, cache_dtype: str | None = None) -> LayerTensor:
    """A :class:`LayerTensor` from a torch tensor of vLLM's logical [blocks, heads, tokens, content] view."""
    if not hasattr(t, "untyped_storage"):
        raise ViewError(f"kv_caches['{name}'] is a {type(t).__name__} of state tensors, not one KV tensor: a "
                        "Mamba / linear-attention layer; kvlc cannot derive those from live tensors yet, so "
                        "KvlcConnector cannot serve this hybrid engine (vLLM's NixlConnector can); "
                        "`kvlc init CONFIG.json --engine vllm` writes its spec offline (for kvlc pair / explain)")
    if mla and t.dim() == 3:  # an MLA layer's own [blocks, tokens, latent] view (vLLM squeezes the head)
        axes = (Axis.BLOCK, Axis.TOKEN, Axis.LATENT)
    elif t.dim() == 4:
        axes = (Axis.BLOCK, Axis.HEAD, Axis.TOKEN, Axis.LATENT if mla else Axis.CONTENT)
    else:
        raise ViewError(f"kv_caches['{name}'] has shape {tuple(t.shape)}; vLLM 0.32 hands connectors a "
                        "4-dim [blocks, heads, tokens, content] view per layer")
    st = t.untyped_storage()
    return LayerTensor(name=name, axes=axes,
                       shape=tuple(int(x) for x in t.shape), strides=tuple(int(x) for x in t.stride()),
                       dtype=kv_dtype(str(t.dtype), cache_dtype), itemsize=int(t.element_size()),
                       data_ptr=int(t.data_ptr()), nbytes=int(t.numel() * t.element_size()),
                       storage_ptr=int(st.data_ptr()), storage_nbytes=int(st.nbytes()), device=str(t.device))


def _backend(vllm_config: Any, layers: tuple[LayerTensor, ...]) -> str:
    """The one attention backend of the layers (CPU_ATTN for CPU tensors when the layers do not say)."""
    backends = _backends(vllm_config, [t.name for t in layers])
    if len(backends) > 1:
        raise ViewError(f"layers use several attention backends {sorted(backends)}; kvlc derives one layout "
                        "per engine; fix: pin one with --attention-backend")
    return backends.pop() if backends else ("CPU_ATTN" if layers[0].device == "cpu" else "unknown")


def _model_identity(mc: Any, layers: tuple[LayerTensor, ...], mla: bool) -> ModelIdentity:
    text = mc.hf_text_config
    return ModelIdentity(name=str(mc.model), num_layers=int(mc.get_total_num_hidden_layers()),
                         num_kv_heads=1 if mla else int(mc.get_total_num_kv_heads()),
                         head_dim=int(mc.get_head_size()), dtype=layers[0].dtype,
                         kv_lora_rank=getattr(text, "kv_lora_rank", None) if mla else None,
                         qk_rope_head_dim=getattr(text, "qk_rope_head_dim", None) if mla else None)


def _parallel(pc: Any, layers: tuple[LayerTensor, ...]) -> ParallelView:
    idx = sorted(layer_index(t.name) for t in layers)
    pp = int(pc.pipeline_parallel_size)
    dcp = int(getattr(pc, "decode_context_parallel_size", 1) or 1)
    interleave = int(getattr(pc, "cp_kv_cache_interleave_size", 1) or 1) if dcp > 1 else 1
    return ParallelView(tp_size=int(pc.tensor_parallel_size), pp_size=pp, dcp_size=dcp, dcp_interleave=interleave,
                        layers=(idx[0], idx[-1] + 1) if pp > 1 else None, **_ranks(pc))


def read_engine_view(vllm_config: Any, kv_cache_config: Any, kv_caches: Mapping[str, Any]) -> EngineView:
    """See :func:`kvlc.engines.vllm.derive.spec.engine_view`."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    mla = bool(getattr(mc, "use_mla", False))
    cache_dtype = getattr(cc, "cache_dtype", None)
    layers = tuple(layer_tensor(n, t, mla, cache_dtype) for n, t in kv_caches.items())
    if not layers:
        raise ViewError("kv_caches is empty; call engine_view from register_kv_caches")
    backend = _backend(vllm_config, layers)
    kernel = layers[0].shape[layers[0].axes.index(Axis.TOKEN)]
    return EngineView(model=_model_identity(mc, layers, mla), parallel=_parallel(vllm_config.parallel_config, layers),
                      backend=backend, kv_cache_layout=_layout(vllm_config, kv_cache_config),
                      kv_packing=packing_for(backend, mla), block_size=int(cc.block_size),
                      kernel_block_size=kernel, num_blocks=int(kv_cache_config.num_blocks),
                      groups=tuple(_group(g) for g in kv_cache_config.kv_cache_groups), layers=layers,
                      provenance=Provenance.LIVE,
                      cpu_isa=_cpu_isa(vllm_config, [t.name for t in layers]) if backend == "CPU_ATTN" else "")
