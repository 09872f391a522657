"""An :class:`EngineView` from a model's ``config.json`` and engine options, without an engine.

The geometry restates vLLM's published layouts. vLLM 0.32 gives every attention
backend one logical ``[layers, blocks, heads, tokens, content]`` allocation whose
physical order is a ``KVCacheLayout`` (``LBHNC`` = head-major blocks, ``LBNHC`` =
token-major, ``BLHNC``/``BLNHC`` = layers interleaved inside each block); each
layer is a ``[blocks, heads, tokens, content]`` view of it, ``content`` being
``2 * head_dim`` K|V elements (MLA: one ``kv_lora_rank + rope`` latent, one head).
Older vLLM (before the unified layout) allocated one tensor per layer:
FLASH_ATTN ``[2, blocks, tokens, heads, head_dim]`` (``split-NHD``; ``split-HND``
with heads before tokens) and FLASHINFER ``[blocks, 2, tokens, heads, head_dim]``
(``blockkv-NHD`` / ``blockkv-HND``). Only the CPU backend was run here; the CUDA
backends' views are marked ``Provenance.PUBLISHED`` (not run on a GPU).

A model with sliding-window and full-attention layers (``layer_types``: Gemma-3, gpt-oss) gets
vLLM's hybrid KV-cache manager (on by default, and kept on by KvlcConnector): its layers form
groups of equal size (:func:`~kvlc.engines.vllm.derive.hybrid.vllm_groups`) and the ``k``-th
layers of all groups share the ``k``-th layer slab of one allocation of ``group size`` layers,
page for page (the derived spec declares them ``aliases``). ``hybrid_manager=False`` gives the
layout of an engine started with ``--disable-hybrid-kv-cache-manager``: one slab per layer.

>>> cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
>>> v = published_view(cfg, "tiny", backend="FLASH_ATTN", block_size=16, num_blocks=4, tp_size=1, kv_dtype="bf16")
>>> v.kv_cache_layout, v.layers[0].shape, v.layers[0].strides
('LBNHC', (4, 2, 16, 128), (4096, 128, 256, 1))
"""

from __future__ import annotations

from collections.abc import Mapping
from math import prod
from typing import Any

from kvlc.compiler.spec.dtypes import DTYPE_SIZES
from kvlc.engines.vllm.derive.cpu import resolve_isa
from kvlc.engines.vllm.derive.groups import vllm_groups
from kvlc.engines.vllm.derive.read import packing_for
from kvlc.engines.vllm.derive.view import (Axis, EngineView, GroupKind, GroupView, KvPacking, LayerTensor,
                                           ModelIdentity, ParallelView, Provenance, ViewError, heads_per_rank)
from kvlc.errors import did_you_mean

# Physical order of the logical [L, B, H, N, C] dims (vLLM's KVCacheLayout values).
UNIFIED_LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "BLHNC": (1, 0, 2, 3, 4),
                   "BLNHC": (1, 0, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4), "BHLNC": (1, 2, 0, 3, 4)}
# Older per-layer tensors: logical axes, physical order of them.
_K, _B, _N, _H, _D = Axis.KV, Axis.BLOCK, Axis.TOKEN, Axis.HEAD, Axis.HEAD_DIM
LEGACY_LAYOUTS = {"split-NHD": ((_K, _B, _N, _H, _D), (0, 1, 2, 3, 4)),
                  "split-HND": ((_K, _B, _N, _H, _D), (0, 1, 3, 2, 4)),
                  "blockkv-NHD": ((_B, _K, _N, _H, _D), (0, 1, 2, 3, 4)),
                  "blockkv-HND": ((_B, _K, _N, _H, _D), (0, 1, 3, 2, 4))}
MLA_BACKENDS = {"FLASHMLA", "FLASHINFER_MLA", "CUTLASS_MLA", "TRITON_MLA", "FLASH_ATTN_MLA", "CPU_MLA",
                "ROCM_AITER_MLA", "FLASHMLA_SPARSE"}
ATTENTION_BACKENDS = {"CPU_ATTN", "FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"}
CPU_BACKENDS = ("CPU_ATTN", "CPU_MLA")  # vLLM's CPU platform: the cache is in host memory
# The smallest kernel block of each attention backend (vLLM 0.32's get_supported_kernel_block_sizes): CPU_ATTN's
# kernels take multiples of 32 tokens (cpu_attn.py: MultipleOf(32)), the GPU backends' multiples of 16.
KERNEL_BLOCK = {"CPU_ATTN": 32}


def kernel_block(backend: str) -> int:
    """Tokens of ``backend``'s smallest kernel block (block sizes are multiples of it; 16 unless listed)."""
    return KERNEL_BLOCK.get(backend, 16)

DEFAULT_LAYOUT = {"CPU_ATTN": "LBHNC"}  # the CPU kernels read head-major blocks only; vLLM's default: LBNHC


# fields that declare layers keeping a state (Mamba-1/2, Gated DeltaNet, short convolutions) instead of, or beside,
# paged K/V
STATE_FIELDS = ("hybrid_override_pattern", "layers_block_type", "linear_num_value_heads", "attn_layer_period",
                "mamba_d_ssm", "mamba_n_heads", "mamba_num_heads", "mamba_d_state", "ssm_state_size", "conv_L_cache")


# vLLM 0.32's reading of a config's KV heads (ModelArchConfigConvertorBase.get_total_num_kv_heads): the first of
# these keys the text config sets, else one per attention head; Falcon's multi-query without its new decoder
# architecture has one; DBRX keeps its count in attn_config
KV_HEAD_KEYS = ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num", "num_attention_groups")
_FALCON_TYPES = {"falcon", "RefinedWeb", "RefinedWebModel"}


def kv_heads(text: Mapping[str, Any]) -> int:
    """The KV heads of a text config, as vLLM 0.32 counts them (see :data:`KV_HEAD_KEYS`).

    >>> kv_heads({"model_type": "falcon", "num_attention_heads": 8, "num_key_value_heads": 8, "num_kv_heads": 1,
    ...           "new_decoder_architecture": True})
    1
    >>> kv_heads({"model_type": "falcon", "num_attention_heads": 71, "multi_query": True})
    1
    >>> kv_heads({"model_type": "chatglm", "num_attention_heads": 32, "multi_query_group_num": 2})
    2
    """
    if text.get("model_type") in _FALCON_TYPES and not text.get("new_decoder_architecture") \
            and text.get("multi_query"):
        return 1
    if text.get("model_type") == "dbrx" and isinstance(text.get("attn_config"), Mapping):
        return int(text["attn_config"].get("kv_n_heads") or text["num_attention_heads"])
    for key in KV_HEAD_KEYS:
        if text.get(key) is not None:
            return int(text[key])
    return int(text["num_attention_heads"])


def _model(config: Mapping, name: str, kv_dtype: str) -> ModelIdentity:
    text = config.get("text_config", config)
    state = [k for k in STATE_FIELDS if text.get(k)]
    if state:
        raise ViewError(f"config.json has {', '.join(state)}: layers that keep a state, which an attention view "
                        "would leave out (every layer written as attention); fix: `kvlc init CONFIG --engine vllm` "
                        "(or `kvlc from-vllm`) writes vLLM's hybrid page pool of such models")
    try:
        layers = int(text["num_hidden_layers"])
        heads = int(text["num_attention_heads"])
    except KeyError as exc:
        raise ViewError(f"config.json has no {exc.args[0]!r}; expected a HuggingFace model config") from None
    n_kv = kv_heads(text)
    head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
    rank, rope = text.get("kv_lora_rank"), text.get("qk_rope_head_dim")
    if rank:
        return ModelIdentity(name, layers, 1, int(rank) + int(rope or 0), kv_dtype, int(rank), int(rope or 0))
    return ModelIdentity(name, layers, n_kv, head_dim, kv_dtype)


_KINDS = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked"}


def _groups(config: Mapping, block_size: int, names: list[str], mla: bool,
            hybrid_manager: bool) -> tuple[GroupView, ...]:
    """One full-attention (or MLA) group, or sliding / chunked and full ones from ``layer_types`` (Gemma-3,
    gpt-oss, Llama-4): one of each kind without vLLM's hybrid manager, its groups of equal size with it."""
    text = config.get("text_config", config)
    if mla:
        return (GroupView(GroupKind.MLA, block_size, tuple(names)),)
    kinds = _layer_kinds(text, len(names))
    if all(k == "full" for _, k in kinds):
        return (GroupView(GroupKind.FULL_ATTENTION, block_size, tuple(names)),)
    if hybrid_manager and len({k for _, k in kinds}) > 1:
        groups = vllm_groups(kinds)
    else:
        groups = [(kind, tuple(i for i, k in kinds if k == kind)) for kind in ("sliding", "chunked", "full")]
    window = sliding_window(text)
    return tuple(_group(kind, block_size, tuple(names[i] for i in members), window, chunk_size(text))
                 for kind, members in groups if members)


def _layer_kinds(text: Mapping[str, Any], n: int) -> list[tuple[int, str]]:
    """``(index, full | sliding | chunked)`` of the ``n`` layers (sliding without a window: full)."""
    types = layer_types({**text, "num_hidden_layers": n}) or []
    unknown = sorted({str(t) for t in types} - set(_KINDS))
    if unknown:
        raise ViewError(f"config.json: layer_types names {', '.join(map(repr, unknown))}: layers without paged "
                        "K/V or of a kind the offline view does not derive (it derives full, sliding and chunked "
                        "attention); fix: `kvlc init CONFIG --engine vllm` writes the hybrid page pool of Mamba-2, "
                        "Mamba-1 and Gated-DeltaNet hybrids")
    window = sliding_window(text)
    return [(i, "full" if _KINDS[t] == "sliding" and not window else _KINDS[t]) for i, t in enumerate(types[:n])]


# The window vLLM 0.32 gives a sliding layer, from what transformers' config class makes of config.json:
# a class default where the key is absent, none where a ``use_sliding_window`` switch is off (the Qwen
# classes null it then), and one token more for Cohere-2 (commandr.py / cohere2_moe.py: its sliding layers
# see [pos - window, pos]).
_WINDOW_DEFAULTS = {"mistral": 4096, "gemma2": 4096, "gemma3": 4096, "gemma3_text": 4096, "cohere2": 4096}
_WINDOW_SWITCHED = {"qwen2", "qwen3", "qwen3_moe", "qwen2_moe"}   # model types with ``use_sliding_window``
_WINDOW_EXTRA = {"cohere2": 1, "cohere2_moe": 1}


def sliding_window(text: Mapping[str, Any]) -> int:
    """Tokens a sliding-window layer of this text config attends to in vLLM 0.32 (0: no window).

    >>> sliding_window({"model_type": "mistral"}), sliding_window({"model_type": "mistral", "sliding_window": None})
    (4096, 0)
    >>> sliding_window({"model_type": "qwen2", "sliding_window": 32768}), sliding_window({"model_type": "cohere2"})
    (0, 4097)
    """
    kind = str(text.get("model_type", ""))
    value = text["sliding_window"] if "sliding_window" in text else _WINDOW_DEFAULTS.get(kind)
    if (kind in _WINDOW_SWITCHED or "use_sliding_window" in text) and not text.get("use_sliding_window"):
        return 0
    if value is None or value == 0:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ViewError(f"config.json: sliding_window must be a positive integer or null, found {value!r}; "
                        "fix: give the model's value")
    return value + _WINDOW_EXTRA.get(kind, 0)


def _switched_types(text: Mapping[str, Any], n: int) -> list[str]:
    """transformers' Qwen2 / Qwen3 layer types with ``use_sliding_window`` on: sliding from layer
    ``max_window_layers`` (28 by default) on."""
    first = int(text.get("max_window_layers", 28))
    return ["sliding_attention" if i >= first else "full_attention" for i in range(n)]


# transformers' defaults where config.json has no ``layer_types`` (what vLLM then reads): Gemma-2 / Gemma-3
# layer i slides unless (i + 1) is a multiple of the period; Llama-4 (Llama4TextConfig) chunks attention over
# 8192 tokens on its RoPE layers and has a NoPE (full-attention) layer every 4th
_PERIODS = {"gemma2": lambda c: 2, "cohere2": lambda c: 4, "gemma3": lambda c: c.get("sliding_window_pattern", 6),
            "gemma3_text": lambda c: c.get("sliding_window_pattern", 6)}
_CHUNK_DEFAULTS = {"llama4_text": (8192, 4)}   # model_type -> (attention_chunk_size, no_rope_layer_interval)


def chunk_size(text: Mapping[str, Any]) -> int:
    """Tokens per chunk of a text config's chunked local attention (0: none): ``attention_chunk_size``, or
    transformers' default for the model type where the key is absent (an explicit null means none)."""
    default = _CHUNK_DEFAULTS.get(str(text.get("model_type", "")), (0, 0))[0]
    if "attention_chunk_size" not in text:
        return default
    value = text["attention_chunk_size"]
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ViewError(f"config.json: attention_chunk_size must be a positive integer or null, found {value!r}; "
                        "fix: give the model's value")
    return value


def _chunked_types(text: Mapping[str, Any], n: int) -> list[str] | None:
    """Chunked local attention on the RoPE layers (``no_rope_layers[i] == 1``), full on the NoPE ones (vLLM's
    llama4.py: ``use_chunked_local_attn = not nope and attention_chunk_size``)."""
    if not chunk_size(text):
        return None
    rope = text.get("no_rope_layers")
    if not rope:   # transformers fills an empty or absent list from no_rope_layer_interval
        interval = text.get("no_rope_layer_interval") or _CHUNK_DEFAULTS.get(str(text.get("model_type", "")),
                                                                             (0, 0))[1]
        if not interval:
            raise ViewError("config.json: attention_chunk_size is set but neither no_rope_layers nor "
                            "no_rope_layer_interval says which layers are chunked (vLLM chunks the RoPE layers, "
                            "no_rope_layers[i] == 1); fix: add the model's no_rope_layers")
        rope = [int((i + 1) % int(interval) != 0) for i in range(n)]
    return ["chunked_attention" if r else "full_attention" for r in rope]


def layer_types(text: Mapping[str, Any]) -> list[str] | None:
    """``layer_types`` of a text config, or transformers' default: chunked / full from ``attention_chunk_size``
    and ``no_rope_layers`` (Llama-4), sliding / full every ``sliding_window_pattern``-th layer, the
    Gemma-2 / Gemma-3 default period, Qwen's ``max_window_layers``, or (a window and nothing per layer, as
    Mistral's) every layer sliding: vLLM gives such a model-wide window to every layer; None: all full.

    >>> layer_types({"model_type": "gemma2", "num_hidden_layers": 4, "sliding_window": 4096})
    ['sliding_attention', 'full_attention', 'sliding_attention', 'full_attention']
    >>> layer_types({"model_type": "llama4_text", "num_hidden_layers": 4, "no_rope_layers": []})
    ['chunked_attention', 'chunked_attention', 'chunked_attention', 'full_attention']
    """
    if text.get("layer_types"):
        return list(text["layer_types"])
    n = int(text["num_hidden_layers"])
    chunked = _chunked_types(text, n)
    if chunked is not None:
        return chunked
    window = sliding_window(text)
    if not window:
        return None
    kind = str(text.get("model_type", ""))
    if kind in _WINDOW_SWITCHED:
        return _switched_types(text, n)
    period = _PERIODS.get(kind)
    if text.get("sliding_window_pattern"):
        period = lambda c: c["sliding_window_pattern"]  # noqa: E731 - any model type that states its period
    if period is None:  # vLLM's CacheConfig.sliding_window: one model-wide window, on every layer
        return ["sliding_attention"] * n
    p = int(period(text))
    return ["sliding_attention" if (i + 1) % p else "full_attention" for i in range(n)]


def _group(kind: str, block_size: int, layers: tuple[str, ...], window: int, chunk: int) -> GroupView:
    if kind == "sliding":
        return GroupView(GroupKind.SLIDING_WINDOW, block_size, layers, window=window)
    if kind == "chunked":
        return GroupView(GroupKind.CHUNKED_LOCAL, block_size, layers, chunk=chunk)
    return GroupView(GroupKind.FULL_ATTENTION, block_size, layers)


def _slabs(groups: tuple[GroupView, ...], names: list[str], pooled: bool) -> list[int]:
    """Each layer's slab of the allocation: its own, or under vLLM's hybrid manager (``pooled``) its
    place in its group (the k-th layers of all groups share slab k)."""
    if not pooled:
        return list(range(len(names)))
    slab = {n: k for g in groups for k, n in enumerate(g.layer_names)}
    return [slab[n] for n in names]


def _pooled(groups: tuple[GroupView, ...], hybrid_manager: bool) -> bool:
    """Whether vLLM's hybrid manager puts the groups over one page pool: attention groups of more than one
    kind (sliding and full), the manager on."""
    return hybrid_manager and len({g.kind for g in groups}) > 1


def _strides(shape: tuple[int, ...], order: tuple[int, ...]) -> tuple[int, ...]:
    """Dense strides for logical ``shape`` stored in physical ``order`` (outermost first)."""
    strides = [0] * len(shape)
    acc = 1
    for dim in reversed(order):
        strides[dim] = acc
        acc *= shape[dim]
    return tuple(strides)


def _unified(m: ModelIdentity, layout: str, names: list[str], heads: int, kernel: int, blocks: int,
             item: int, device: str, mla: bool, slabs: list[int]) -> tuple[LayerTensor, ...]:
    content = m.head_dim if mla else 2 * m.head_dim
    logical = (max(slabs) + 1, blocks, 1 if mla else heads, kernel, content)  # C in elements
    st = _strides(logical, UNIFIED_LAYOUTS[layout])
    total = prod(logical) * item
    axes = (Axis.BLOCK, Axis.HEAD, Axis.TOKEN, Axis.LATENT if mla else Axis.CONTENT)
    return tuple(LayerTensor(name=n, axes=axes, shape=logical[1:], strides=st[1:], dtype=m.dtype, itemsize=item,
                             data_ptr=k * st[0] * item, nbytes=prod(logical[1:]) * item, storage_ptr=0,
                             storage_nbytes=total, device=device) for k, n in zip(slabs, names))


def _legacy(m: ModelIdentity, layout: str, names: list[str], heads: int, kernel: int, blocks: int,
            item: int, device: str) -> tuple[LayerTensor, ...]:
    axes, order = LEGACY_LAYOUTS[layout]
    size = {Axis.KV: 2, Axis.BLOCK: blocks, Axis.TOKEN: kernel, Axis.HEAD: heads, Axis.HEAD_DIM: m.head_dim}
    shape = tuple(size[a] for a in axes)
    nbytes = prod(shape) * item
    # one allocation per layer, at made-up addresses 1 TiB apart
    return tuple(LayerTensor(name=n, axes=axes, shape=shape, strides=_strides(shape, order), dtype=m.dtype,
                             itemsize=item, data_ptr=(i + 1) << 40, nbytes=nbytes, storage_ptr=(i + 1) << 40,
                             storage_nbytes=nbytes, device=device) for i, n in enumerate(names))


def _check_backend(backend: str, mla: bool) -> None:
    if backend not in ATTENTION_BACKENDS | MLA_BACKENDS:
        raise ViewError(f"unknown backend '{backend}'; {did_you_mean(backend, ATTENTION_BACKENDS | MLA_BACKENDS)}")
    if mla != (backend in MLA_BACKENDS):
        raise ViewError(f"backend '{backend}' is {'an MLA' if backend in MLA_BACKENDS else 'not an MLA'} backend "
                        f"but the model {'uses' if mla else 'does not use'} MLA (kv_lora_rank in config.json); "
                        f"fix: pick one of {sorted(MLA_BACKENDS if mla else ATTENTION_BACKENDS)}")


def _pick_layout(backend: str, layout: str | None, mla: bool) -> str:
    _check_backend(backend, mla)
    layout = layout or DEFAULT_LAYOUT.get(backend, "LBNHC")
    if layout not in UNIFIED_LAYOUTS and layout not in LEGACY_LAYOUTS:
        hint = did_you_mean(layout, [*UNIFIED_LAYOUTS, *LEGACY_LAYOUTS])
        raise ViewError(f"unknown KV-cache layout '{layout}'; {hint}")
    if backend == "CPU_ATTN" and layout != "LBHNC":
        raise ViewError(f"the CPU backend supports only layout LBHNC (head-major blocks), not '{layout}'")
    if layout in LEGACY_LAYOUTS and (mla or not layout.startswith("split" if backend == "FLASH_ATTN" else "blockkv")):
        raise ViewError(f"layout '{layout}' is not one backend '{backend}' used; split-* is FLASH_ATTN's, "
                        "blockkv-* FLASHINFER's (older vLLM)")
    return layout


def check_engine_block(backend: str, block_size: int, kernel_block_size: int | None = None) -> None:
    """A :class:`ViewError` with the fix where no vLLM 0.32 engine of ``backend`` runs ``block_size``-token blocks
    as asked: CPU_ATTN's kernels take multiples of 32 tokens. (:func:`published_view` itself computes any
    geometry; ``kvlc init`` and ``from-vllm`` call this first.)"""
    kernel, base = kernel_block_size or block_size, kernel_block(backend)
    if backend == "CPU_ATTN" and kernel % base:
        raise ViewError(f"--block-size {block_size}: vLLM 0.32's CPU attention kernels take blocks of a multiple of "
                        f"{base} tokens (CPU_ATTN's kernel block sizes: MultipleOf({base})); an "
                        "engine asked for another size refuses to start (\"No common block size\"), or, with only "
                        "sliding-window layers, runs another size than asked; fix: --block-size 32 (or 64, 96, 128, "
                        "...) here and in the engine")


def published_view(config: Mapping[str, Any], name: str, *, backend: str, block_size: int, num_blocks: int,
                   tp_size: int = 1, tp_rank: int = 0, kv_dtype: str = "bf16", layout: str | None = None,
                   kernel_block_size: int | None = None, device: str | None = None,
                   cpu_isa: str = "", hybrid_manager: bool = True) -> EngineView:
    """The view an engine with these options would give (see the module docstring). ``cpu_isa``: a CPU_ATTN
    engine's attention ISA (``auto``: what vLLM picks on this host; empty: not said, as ``vec``; another is taken
    as given: :func:`~kvlc.engines.vllm.derive.cpu.resolve_isa` checks one a user asked for)."""
    if kv_dtype not in DTYPE_SIZES:
        raise ViewError(f"unknown KV dtype '{kv_dtype}'; {did_you_mean(kv_dtype, DTYPE_SIZES)}")
    m = _model(config, name, kv_dtype)
    mla = m.kv_lora_rank is not None
    layout = _pick_layout(backend, layout, mla)
    kernel = kernel_block_size or block_size
    if block_size % kernel:
        raise ViewError(f"kernel block size {kernel} does not divide block size {block_size}")
    if backend == "CPU_ATTN" and cpu_isa == "auto":
        cpu_isa = resolve_isa(cpu_isa, kv_dtype=kv_dtype, block_size=kernel, head_size=m.head_dim)
    heads = heads_per_rank(m.num_kv_heads, tp_size)
    if heads is None:
        raise ViewError(f"{m.num_kv_heads} KV heads cannot be split over tp_size {tp_size}")
    names = [f"model.layers.{i}.self_attn.attn" for i in range(m.num_layers)]
    device = device or ("cpu" if backend in CPU_BACKENDS else "cuda:0")
    item = DTYPE_SIZES[kv_dtype]
    blocks = num_blocks * (block_size // kernel)
    groups = _groups(config, block_size, names, mla, hybrid_manager and layout not in LEGACY_LAYOUTS)
    if layout in LEGACY_LAYOUTS:
        layers = _legacy(m, layout, names, heads, kernel, blocks, item, device)
        packing = KvPacking.NONE
    else:
        slabs = _slabs(groups, names, _pooled(groups, hybrid_manager))
        layers = _unified(m, layout, names, heads, kernel, blocks, item, device, mla, slabs)
        packing = packing_for(backend, mla)
    return EngineView(model=m, parallel=ParallelView(tp_size=tp_size, tp_rank=tp_rank), backend=backend,
                      kv_cache_layout=layout, kv_packing=packing, block_size=block_size, kernel_block_size=kernel,
                      num_blocks=num_blocks, groups=groups,
                      layers=layers,
                      provenance=Provenance.PUBLISHED_CPU if backend == "CPU_ATTN" else Provenance.PUBLISHED,
                      cpu_isa=cpu_isa if backend == "CPU_ATTN" else "")
