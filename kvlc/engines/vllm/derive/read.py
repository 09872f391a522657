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
                                           ModelIdentity, ParallelView, Provenance, StateLayout, StateTensors,
                                           ViewError, layer_index)

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


def _tensor(name: str, t: Any, axes: tuple[Axis, ...], dtype: str) -> LayerTensor:
    st = t.untyped_storage()
    return LayerTensor(name=name, axes=axes,
                       shape=tuple(int(x) for x in t.shape), strides=tuple(int(x) for x in t.stride()),
                       dtype=dtype, itemsize=int(t.element_size()),
                       data_ptr=int(t.data_ptr()), nbytes=int(t.numel() * t.element_size()),
                       storage_ptr=int(st.data_ptr()), storage_nbytes=int(st.nbytes()), device=str(t.device))


def is_state_entry(t: Any) -> bool:
    """Whether a ``kv_caches`` entry is a Mamba / linear-attention layer's state tensors (a list or tuple)."""
    return isinstance(t, (list, tuple))


def state_tensors(name: str, parts: Any) -> StateTensors:
    """A :class:`StateTensors` from a state layer's ``[conv, ssm]`` tensors, or its ``[conv]`` alone (a short
    convolution's), each ``[blocks, ...]``."""
    if len(parts) not in (1, 2) or not all(hasattr(p, "untyped_storage") for p in parts):
        raise ViewError(f"kv_caches['{name}'] holds {len(parts)} state part(s) "
                        f"({', '.join(type(p).__name__ for p in parts)}); kvlc knows Mamba-1, Mamba-2, "
                        "Gated-DeltaNet and short-convolution layers, whose state vLLM 0.32 hands as [conv, ssm] "
                        "tensors, or [conv] alone; fix: report this model's layer type (KDA states are not "
                        "derived yet)")
    return StateTensors(name, tuple(_tensor(name, p, (Axis.BLOCK,) + (Axis.STATE,) * (p.dim() - 1),
                                            kv_dtype(str(p.dtype), None)) for p in parts))


def layer_tensor(name: str, t: Any, mla: bool = False, cache_dtype: str | None = None) -> LayerTensor:
    """A :class:`LayerTensor` from a torch tensor of vLLM's logical [blocks, heads, tokens, content] view."""
    if not hasattr(t, "untyped_storage"):
        raise ViewError(f"kv_caches['{name}'] is a {type(t).__name__}, not a tensor; vLLM 0.32 hands an "
                        "attention layer's KV as one tensor (a state layer's as a list: see state_tensors)")
    if mla and t.dim() == 3:  # an MLA layer's own [blocks, tokens, latent] view (vLLM squeezes the head)
        axes = (Axis.BLOCK, Axis.TOKEN, Axis.LATENT)
    elif t.dim() == 4:
        axes = (Axis.BLOCK, Axis.HEAD, Axis.TOKEN, Axis.LATENT if mla else Axis.CONTENT)
    else:
        raise ViewError(f"kv_caches['{name}'] has shape {tuple(t.shape)}; vLLM 0.32 hands connectors a "
                        "4-dim [blocks, heads, tokens, content] view per layer")
    return _tensor(name, t, axes, kv_dtype(str(t.dtype), cache_dtype))


def _state_layer_names(kv_cache_config: Any) -> set[str]:
    """The layers of the engine's Mamba / linear-attention (``MambaSpec``) groups."""
    from vllm.v1 import kv_cache_interface as kci
    return {n for g in kv_cache_config.kv_cache_groups if isinstance(g.kv_cache_spec, kci.MambaSpec)
            for n in g.layer_names}


def _state_parts(vllm_config: Any, name: str, t: Any) -> Any:
    """A state layer's ``[conv, ssm]`` tensors. vLLM 0.32 hands ``register_kv_caches`` each state layer
    as one raw ``[blocks, 1, 1, state bytes]`` view of its pages; the layer's own views (its ``kv_cache``
    in the forward context) say where conv and ssm lie, and must start where that raw view starts."""
    if is_state_entry(t):
        return t
    ctx = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", {}) or {}
    parts = getattr(ctx.get(name), "kv_cache", None)
    if not is_state_entry(parts) or not parts or parts[0].data_ptr() != t.data_ptr():
        found = "none" if parts is None else (f"{type(parts).__name__} at {parts[0].data_ptr():#x}"
                                              if is_state_entry(parts) and parts else type(parts).__name__)
        raise ViewError(f"state layer '{name}': kv_caches gives a tensor at {t.data_ptr():#x}; expected the layer's "
                        f"own [conv, ssm] views (its kv_cache in the forward context) to start there, found "
                        f"{found}; fix: derive from the kv_caches of the engine's own register_kv_caches")
    return parts


# vLLM's MambaSpec.mamba_type -> the state kind of kvlc.engines.vllm.derive.state
_STATE_KINDS = {"MAMBA1": "mamba1", "MAMBA2": "mamba", "GDN_ATTN": "linear", "SHORT_CONV": "short_conv"}


def _state_kind(kv_cache_config: Any) -> str | None:
    """``mamba1``, ``mamba`` or ``linear``: the kind of the engine's state groups (None: it has none)."""
    from vllm.v1 import kv_cache_interface as kci
    types = {getattr(g.kv_cache_spec.mamba_type, "name", str(g.kv_cache_spec.mamba_type))
             for g in kv_cache_config.kv_cache_groups if isinstance(g.kv_cache_spec, kci.MambaSpec)}
    if not types:
        return None
    unknown = types - set(_STATE_KINDS)
    if unknown or len(types) > 1:
        raise ViewError(f"the engine's state groups are of vLLM mamba_type {sorted(types)}; kvlc derives "
                        f"{sorted(_STATE_KINDS)} (Mamba-1, Mamba-2, Gated DeltaNet, short convolution), one kind per "
                        "engine; fix: report this model's state layout (KDA is not derived yet)")
    return _STATE_KINDS[types.pop()]


def _state_layout(mc: Any, kv_cache_config: Any, states: tuple[StateTensors, ...]) -> StateLayout | None:
    """The model's state layer (section and head sizes from its config, Falcon-H1's field names translated as
    ``kvlc init`` translates them), in the dtypes of the live tensors."""
    from kvlc.engines.vllm.derive.state import mamba2_fields, state_layout
    kind = _state_kind(kv_cache_config)
    if kind is None or not states:
        return None
    conv, rec = states[0].parts[0], states[0].parts[-1]
    try:
        config = mamba2_fields({**mc.hf_text_config.to_dict(), "torch_dtype": _TORCH[conv.dtype]})
        return state_layout(config, kind, requested=_TORCH[rec.dtype])
    except KeyError as exc:
        raise ViewError(f"the model config has no {exc.args[0]!r}, which a {kind} state layer needs; "
                        "kvlc reads the state's sections and heads from the HuggingFace config (Nemotron-H's "
                        "field names, or Falcon-H1's mamba_n_heads / mamba_d_head / mamba_n_groups / mamba_d_state "
                        "/ mamba_d_conv)") from None


_TORCH = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _backend(vllm_config: Any, layers: tuple[LayerTensor, ...]) -> str:
    """The one attention backend of the layers (CPU_ATTN for CPU tensors when the layers do not say)."""
    backends = _backends(vllm_config, [t.name for t in layers])
    if len(backends) > 1:
        raise ViewError(f"layers use several attention backends {sorted(backends)}; kvlc derives one layout "
                        "per engine; fix: pin one with --attention-backend")
    return backends.pop() if backends else ("CPU_ATTN" if layers[0].device == "cpu" else "unknown")


def _num_layers(mc: Any, pc: Any, states: tuple[StateTensors, ...]) -> int:
    """The model's cache layers as vLLM numbers them: its decoder layers, or more where a decoder layer's state
    mixer is numbered past them (vLLM's falcon_h1.py names layer ``i``'s Mamba-2 mixer
    ``model.{num_hidden_layers + i}.mixer``: ``2 x num_hidden_layers`` cache layers, as ``kvlc init`` counts).
    Draft (MTP) attention layers numbered past them do not count, as in ``kvlc init``."""
    total = int(mc.get_total_num_hidden_layers())
    past = [s.name for s in states if layer_index(s.name) >= total]
    if not past:
        return total
    if int(pc.pipeline_parallel_size) > 1:
        raise ViewError(f"state layer '{past[0]}' is numbered past the model's {total} decoder layers (a second "
                        "mixer per decoder layer, as vLLM numbers Falcon-H1's Mamba-2 mixers): a pipeline stage "
                        "then holds two windows of cache layers, which parallel.layers cannot state; fix: "
                        "pipeline_parallel_size 1")
    return 1 + max(layer_index(n) for n in past)


def _model_identity(mc: Any, pc: Any, layers: tuple[LayerTensor, ...], states: tuple[StateTensors, ...],
                    mla: bool) -> ModelIdentity:
    text = mc.hf_text_config
    return ModelIdentity(name=str(mc.model), num_layers=_num_layers(mc, pc, states),
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
    stateful = _state_layer_names(kv_cache_config)
    layers = tuple(layer_tensor(n, t, mla, cache_dtype) for n, t in kv_caches.items()
                   if n not in stateful and not is_state_entry(t))
    states = tuple(state_tensors(n, _state_parts(vllm_config, n, t)) for n, t in kv_caches.items()
                   if n in stateful or is_state_entry(t))
    if not layers:
        raise ViewError("kv_caches is empty; call engine_view from register_kv_caches")
    backend = _backend(vllm_config, layers)
    kernel = layers[0].shape[layers[0].axes.index(Axis.TOKEN)]
    pc = vllm_config.parallel_config
    return EngineView(model=_model_identity(mc, pc, layers, states, mla), parallel=_parallel(pc, layers),
                      backend=backend, kv_cache_layout=_layout(vllm_config, kv_cache_config),
                      kv_packing=packing_for(backend, mla), block_size=int(cc.block_size),
                      kernel_block_size=kernel, num_blocks=int(kv_cache_config.num_blocks),
                      groups=tuple(_group(g) for g in kv_cache_config.kv_cache_groups), layers=layers,
                      provenance=Provenance.LIVE,
                      cpu_isa=_cpu_isa(vllm_config, [t.name for t in layers]) if backend == "CPU_ATTN" else "",
                      state=_state_layout(mc, kv_cache_config, states), states=states)
