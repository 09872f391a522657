"""What a HuggingFace ``config.json`` says about a model's KV cache, read by its fields.

:func:`read_model` dispatches on config fields, never on a model name, in this order:

* ``kv_lora_rank`` → MLA (one latent of ``kv_lora_rank + qk_rope_head_dim`` per token);
  ``index_head_dim`` / ``index_topk`` besides it → the sparse-attention indexer;
* ``mamba_d_ssm`` / ``mamba_n_heads`` (attention *and* Mamba-2 in every layer, Falcon-H1) → parallel
  hybrid: as vLLM numbers them, layer ``i``'s attention is cache layer ``i`` and its Mamba-2 mixer
  cache layer ``num_hidden_layers + i``;
* ``hybrid_override_pattern`` (``M`` Mamba, ``*`` attention, ``-`` / ``E`` MLP), or the
  ``layers_block_type`` list transformers 5.x writes instead (then without
  ``num_hidden_layers``) → Mamba-2 hybrid (Nemotron-H); ``mamba_n_heads`` with a ``layer_types`` list of
  ``mamba`` / ``attention`` (or ``linear_attention`` / ``full_attention``) → the same, the mixer spelled as
  Falcon-H1's (Granite-4);
* ``attn_layer_period`` / ``attn_layer_offset`` (with ``mamba_d_state`` …) → Mamba-1 hybrid (Jamba:
  attention where ``i % period == offset``, Mamba-1 elsewhere);
* ``linear_num_value_heads`` with ``layer_types`` or ``full_attention_interval`` →
  Gated-DeltaNet hybrid (linear attention, full attention every n-th layer);
* any other field of a hybrid (``mamba_*``, ``ssm_*``, ``attn_layer_indices`` …) → refused, the field
  named: kvlc cannot tell that model's layer kinds and writes no attention in their place;
* ``attention_chunk_size`` → chunked local attention on the RoPE layers (``no_rope_layers[i] == 1``,
  or ``layer_types`` ``chunked_attention``), full attention on the NoPE ones (Llama-4);
* ``layer_types`` or ``sliding_window_pattern`` with ``sliding_window`` → sliding/full mix
  (a ``layer_types`` value other than full / sliding / chunked attention is refused);
* otherwise dense GQA/MHA.

Where config.json leaves out a field that decides layer kinds, the model's transformers config
class fills in a default, which is what vLLM reads; init applies the same ones, by ``model_type``
(:func:`kvlc.engines.vllm.derive.offline.layer_types`: Gemma-2 alternates sliding and full layers,
Llama-4 chunks 8192 tokens and has a NoPE layer every 4th).

``head_dim`` is taken from the config when present (``attention_head_dim`` first for
Mamba hybrids); only when absent is it ``hidden_size / num_attention_heads``.

>>> m = read_model({"num_hidden_layers": 2, "hidden_size": 5120, "num_attention_heads": 64,
...                 "num_key_value_heads": 8, "head_dim": 128})
>>> m.head_dim, m.kinds
(128, (<LayerKind.FULL: 'full'>, <LayerKind.FULL: 'full'>))
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvlc.engines.vllm.derive.offline import KV_HEAD_KEYS, chunk_size, kv_heads, layer_types, sliding_window
from kvlc.engines.vllm.derive.state import mamba2_fields
from kvlc.engines.vllm.derive.view import ViewError
from kvlc.errors import KvlcError


class InitError(KvlcError):
    """A config.json or engine description ``kvlc init`` cannot turn into a spec."""


class LayerKind(str, Enum):
    """What one layer keeps between steps."""

    FULL = "full"            # paged K/V (or an MLA latent) over all tokens
    SLIDING = "sliding"      # paged K/V, a window of tokens
    CHUNKED = "chunked"      # paged K/V, the tokens of the current chunk (chunked local attention)
    MAMBA = "mamba"          # Mamba-2 (or Mamba-1) conv + SSM state, or a short convolution's taps, per request
    LINEAR = "linear"        # Gated DeltaNet conv + recurrent state per request
    NONE = "none"            # MLP / MoE only: no cache


class Family(str, Enum):
    DENSE = "dense"
    SLIDING = "sliding"
    CHUNKED = "chunked"
    MLA = "mla"
    MAMBA = "mamba-hybrid"
    MAMBA1 = "mamba1-hybrid"
    PARALLEL = "parallel-hybrid"     # attention and Mamba-2 side by side in every layer (Falcon-H1)
    LINEAR = "linear-hybrid"
    CONV = "conv-hybrid"             # short-convolution layers and attention (LFM2)


@dataclass(frozen=True)
class Mamba2:
    """Mamba-2 state sizes: conv over x | B | C channels, SSM heads x head_dim x state."""

    conv_kernel: int
    d_inner: int
    d_bc: int
    heads: int
    head_dim: int
    state: int

    @property
    def one_group(self) -> bool:
        """``n_groups`` is 1: engines give every TP rank the whole group's B and C (vLLM's ``MambaMixer2``)."""
        return self.d_bc == self.state


@dataclass(frozen=True)
class Mamba1:
    """Mamba-1 state sizes (vLLM's ``mamba1_state_shape``): conv over ``d_inner`` channels, SSM ``d_inner x state``."""

    conv_kernel: int
    d_inner: int
    state: int


@dataclass(frozen=True)
class ShortConv:
    """A short convolution's state (vLLM's ``short_conv_state_shape``): ``conv_kernel - 1`` taps over ``channels``."""

    conv_kernel: int
    channels: int


@dataclass(frozen=True)
class DeltaNet:
    """Gated DeltaNet state sizes: conv over q | k | v channels, recurrent v_heads x k_dim x v_dim."""

    conv_kernel: int
    key_dim: int
    value_dim: int
    v_heads: int
    k_dim: int
    v_dim: int


@dataclass(frozen=True)
class Model:
    """The cache-relevant facts of one model."""

    name: str
    family: Family
    num_layers: int                 # cache layers, as vLLM numbers them (parallel hybrid: twice the decoder layers)
    kinds: tuple[LayerKind, ...]
    num_kv_heads: int = 0
    head_dim: int = 0
    window: int = 0
    chunk: int = 0                  # chunked local attention: tokens per chunk
    latent: int = 0                 # MLA: kv_lora_rank + qk_rope_head_dim
    rope: int = 0                   # MLA: qk_rope_head_dim (the latent's last ``rope`` values)
    index_head_dim: int = 0         # sparse-attention indexer key size (0: none)
    draft_layers: int = 0           # MTP layers after the main ones
    mamba: Mamba2 | None = None
    mamba1: Mamba1 | None = None
    deltanet: DeltaNet | None = None
    short_conv: ShortConv | None = None
    sizes: dict = field(default_factory=dict)


def _int(c: Mapping, key: str, where: str = "config.json") -> int:
    value = c.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InitError(f"{where}: '{key}' must be a non-negative integer, found {value!r}; "
                        f"fix: give the model's {key} as in its HuggingFace config.json")
    return value


def _head_dim(c: Mapping, *keys: str) -> int:
    """The first of ``keys`` (default ``head_dim``) the config gives, else ``hidden_size / num_attention_heads``."""
    keys = keys or ("head_dim",)
    for key in keys:
        if c.get(key) is not None:
            return _int(c, key)
    heads = _int(c, "num_attention_heads")
    hidden = _int(c, "hidden_size")
    if not heads or hidden % heads:
        raise InitError(f"config.json has no '{keys[0]}' and hidden_size {hidden} is not a multiple of "
                        f"num_attention_heads {heads}; fix: add '{keys[0]}' to the config")
    return hidden // heads


def _kv_heads(c: Mapping) -> int:
    """vLLM's count (:func:`~kvlc.engines.vllm.derive.offline.kv_heads`), the key it reads checked first."""
    _int(c, next((k for k in KV_HEAD_KEYS if c.get(k) is not None), "num_attention_heads"))
    return kv_heads(c)


ATTENTION_TYPES = {"full_attention": LayerKind.FULL, "sliding_attention": LayerKind.SLIDING,
                   "chunked_attention": LayerKind.CHUNKED}


def _attention_kinds(c: Mapping, n: int) -> tuple[LayerKind, ...] | None:
    """Per layer full / sliding / chunked, from ``layer_types`` as transformers gives it (the config's own,
    or the model class's default: :func:`~kvlc.engines.vllm.derive.offline.layer_types`); None: not given."""
    try:
        types = layer_types({**c, "num_hidden_layers": n})
    except ViewError as exc:
        raise InitError(str(exc)) from None
    if types is None:
        return None
    if len(types) != n:
        raise InitError(f"config.json: layer_types has {len(types)} entries, num_hidden_layers is {n}; "
                        "fix: give one type per layer")
    unknown = sorted({str(t) for t in types} - set(ATTENTION_TYPES))
    if unknown:
        raise InitError(f"config.json: layer_types names {', '.join(map(repr, unknown))}, a layer kind kvlc init "
                        f"cannot tell (it knows {', '.join(ATTENTION_TYPES)} here and the hybrids' fields in "
                        "kvlc.init.model); it writes no attention in its place; fix: write the spec by hand")
    kinds = tuple(ATTENTION_TYPES[t] for t in types)
    if LayerKind.SLIDING in kinds and not sliding_window(c):
        kinds = tuple(LayerKind.FULL if k == LayerKind.SLIDING else k for k in kinds)  # no window: all tokens
    return kinds


def _mla(c: Mapping, name: str, n: int) -> Model:
    latent = _int(c, "kv_lora_rank") + _int(c, "qk_rope_head_dim")
    index = _int(c, "index_head_dim") if c.get("index_head_dim") or c.get("index_topk") else 0
    sizes = {"latent": latent, **({"index_head_dim": index} if index else {})}
    return Model(name, Family.MLA, n, (LayerKind.FULL,) * n, latent=latent, rope=_int(c, "qk_rope_head_dim"),
                 index_head_dim=index,
                 draft_layers=_int(c, "num_nextn_predict_layers") if c.get("num_nextn_predict_layers") else 0,
                 sizes=sizes)


_PATTERN = {"M": LayerKind.MAMBA, "*": LayerKind.FULL, "-": LayerKind.NONE, "E": LayerKind.NONE}
# transformers 5.x NemotronHConfig.layers_block_type (its "linear_attention" is a Mamba-2 layer), and the
# older "mamba" / "attention" spellings
BLOCK_TYPES = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-",
               "moe": "E"}


def _block_pattern(c: Mapping, n: int) -> str:
    """``hybrid_override_pattern``, or the ``layers_block_type`` list (Nemotron-H, transformers 5.x) or the
    ``layer_types`` list (Granite-4: ``mamba`` / ``attention``, transformers 5.x ``linear_attention`` /
    ``full_attention``) spelled as one."""
    if c.get("hybrid_override_pattern"):
        return str(c["hybrid_override_pattern"])
    key = "layers_block_type" if isinstance(c.get("layers_block_type"), list) else "layer_types"
    types = c[key]
    bad = sorted({str(t) for t in types} - set(BLOCK_TYPES))
    if bad:
        raise InitError(f"config.json: {key} names {', '.join(map(repr, bad))}; expected one of "
                        f"{', '.join(BLOCK_TYPES)} per layer (a Mamba-2 hybrid: transformers' NemotronHConfig, "
                        "GraniteMoeHybridConfig); fix: one of those per layer")
    return "".join(BLOCK_TYPES[t] for t in types)


def _mamba(c: Mapping, name: str, n: int) -> Model:
    pattern = _block_pattern(c, n)
    bad = sorted(set(pattern) - set(_PATTERN))
    if bad or len(pattern) != n:
        raise InitError(f"config.json: hybrid_override_pattern must have {n} letters of M, *, -, E, "
                        f"found {len(pattern)} letters{' with ' + repr(''.join(bad)) if bad else ''}; "
                        "fix: one letter per layer")
    try:
        m = _mamba2_sizes(mamba2_fields(c))  # Granite-4 spells its mixer as Falcon-H1 does
    except ViewError as exc:
        raise InitError(str(exc)) from None
    return Model(name, Family.MAMBA, n, tuple(_PATTERN[x] for x in pattern), _kv_heads(c),
                 _head_dim(c, "attention_head_dim", "head_dim"), mamba=m, sizes=_mamba2_dims(m))


def _mamba2_sizes(c: Mapping) -> Mamba2:
    """A Mamba-2 mixer's sizes from Nemotron-H's field names (Falcon-H1's translated by ``mamba2_fields``)."""
    return Mamba2(_int(c, "conv_kernel"), _int(c, "mamba_num_heads") * _int(c, "mamba_head_dim"),
                  _int(c, "n_groups") * _int(c, "ssm_state_size"), _int(c, "mamba_num_heads"),
                  _int(c, "mamba_head_dim"), _int(c, "ssm_state_size"))


def _mamba2_dims(m: Mamba2) -> dict:
    return {"conv_tap": m.conv_kernel - 1, "ssm_head": m.heads, "mamba_head_dim": m.head_dim, "ssm_state": m.state}


def jamba_kinds(period: int, offset: int, n: int) -> tuple[LayerKind, ...]:
    """Jamba's layers (transformers' ``JambaConfig.layers_block_type``): attention where
    ``i % period == offset``, Mamba-1 elsewhere.

    >>> "".join(k.value[0] for k in jamba_kinds(8, 4, 16))
    'mmmmfmmmmmmmfmmm'
    """
    return tuple(LayerKind.FULL if i % period == offset else LayerKind.MAMBA for i in range(n))


def _mamba1(c: Mapping, name: str, n: int) -> Model:
    """Jamba: Mamba-1 state as vLLM 0.32 keeps it (``mamba1_state_shape``: ``d_inner = mamba_expand *
    hidden_size`` channels, ``mamba_d_conv - 1`` conv taps, ``mamba_d_state`` SSM state per channel)."""
    period, offset = _int(c, "attn_layer_period"), _int(c, "attn_layer_offset")
    if not period or offset >= period:
        raise InitError(f"config.json: attn_layer_offset {offset} must be below attn_layer_period {period} (an "
                        "attention layer where i % period == offset); fix: give the model's values")
    m = Mamba1(_int(c, "mamba_d_conv"), _int(c, "mamba_expand") * _int(c, "hidden_size"), _int(c, "mamba_d_state"))
    sizes = {"conv_tap": m.conv_kernel - 1, "channel": m.d_inner, "ssm_state": m.state}
    return Model(name, Family.MAMBA1, n, jamba_kinds(period, offset, n), _kv_heads(c), _head_dim(c),
                 mamba1=m, sizes=sizes)


def _linear(c: Mapping, name: str, n: int) -> Model:
    types = c.get("layer_types")
    if isinstance(types, list) and len(types) == n:
        kinds = tuple(LayerKind.LINEAR if t == "linear_attention" else LayerKind.FULL for t in types)
    else:
        every = _int(c, "full_attention_interval")
        kinds = tuple(LayerKind.FULL if every and (i + 1) % every == 0 else LayerKind.LINEAR for i in range(n))
    d = DeltaNet(_int(c, "linear_conv_kernel_dim"), _int(c, "linear_num_key_heads") * _int(c, "linear_key_head_dim"),
                 _int(c, "linear_num_value_heads") * _int(c, "linear_value_head_dim"),
                 _int(c, "linear_num_value_heads"), _int(c, "linear_key_head_dim"), _int(c, "linear_value_head_dim"))
    sizes = {"conv_tap": d.conv_kernel - 1, "v_head": d.v_heads, "k_dim": d.k_dim, "v_dim": d.v_dim}
    return Model(name, Family.LINEAR, n, kinds, _kv_heads(c), _head_dim(c), deltanet=d, sizes=sizes)


def _parallel_hybrid(c: Mapping, name: str, n: int) -> Model:
    """Falcon-H1: attention and a Mamba-2 mixer side by side in every layer. vLLM gives the mixer of layer ``i``
    the index ``n + i`` (every cache layer needs its own), so the model has ``2n`` cache layers: attention
    ``0 .. n-1``, Mamba-2 state ``n .. 2n-1`` (vLLM's falcon_h1.py; the mixer's fields are read as
    :func:`~kvlc.engines.vllm.derive.state.mamba2_fields` translates them, for init and the live engine alike)."""
    try:
        m = _mamba2_sizes(mamba2_fields(c))
    except ViewError as exc:
        raise InitError(str(exc)) from None
    return Model(name, Family.PARALLEL, 2 * n, (LayerKind.FULL,) * n + (LayerKind.MAMBA,) * n, _kv_heads(c),
                 _head_dim(c), mamba=m, sizes=_mamba2_dims(m))


CONV_TYPES = {"conv": LayerKind.MAMBA, "full_attention": LayerKind.FULL}   # LFM2's layer_types


def _short_conv(c: Mapping, name: str, n: int) -> Model:
    """LFM2: short-convolution layers (``layer_types`` ``conv``) and attention (``full_attention``); older
    configs list the attention layers as ``full_attn_idxs`` instead."""
    types = c.get("layer_types")
    if isinstance(types, list):
        bad = sorted({str(t) for t in types} - set(CONV_TYPES))
        if bad or len(types) != n:
            raise InitError(f"config.json: layer_types must name {n} layers, each one of {', '.join(CONV_TYPES)} "
                            f"(an LFM2), found {len(types)}{' with ' + ', '.join(map(repr, bad)) if bad else ''}; "
                            "fix: one of those per layer")
        kinds = tuple(CONV_TYPES[t] for t in types)
    else:
        full = c.get("full_attn_idxs")
        if not isinstance(full, list) or not all(isinstance(i, int) and 0 <= i < n for i in full):
            raise InitError(f"config.json (LFM2) has neither layer_types nor full_attn_idxs as a list of layer "
                            f"indices below {n}, found {full!r}; fix: give the model's layer_types")
        kinds = tuple(LayerKind.FULL if i in full else LayerKind.MAMBA for i in range(n))
    s = ShortConv(_int(c, "conv_L_cache"), _int(c, "conv_dim"))
    return Model(name, Family.CONV, n, kinds, _kv_heads(c), _head_dim(c), short_conv=s,
                 sizes={"conv_tap": s.conv_kernel - 1, "channel": s.channels})


# config fields that mean layers of a kind init reads only with the fields it dispatches on
HYBRID_PREFIXES = ("mamba", "ssm_", "linear_", "attn_layer_", "hybrid_", "layers_block_type", "block_type",
                   "full_attention_interval", "conv_kernel", "time_step")


def _refuse_unknown_hybrid(c: Mapping) -> None:
    fields = sorted(k for k in c if isinstance(k, str) and k.startswith(HYBRID_PREFIXES))
    if fields:
        raise InitError(f"config.json (model_type {c.get('model_type')!r}) has {', '.join(map(repr, fields[:4]))}"
                        f"{' …' if len(fields) > 4 else ''}, fields of a model whose layers are not all attention, "
                        "but none of the layer patterns kvlc init reads (hybrid_override_pattern / layers_block_type, "
                        "attn_layer_period + attn_layer_offset, linear_num_value_heads, layer_types); it cannot tell "
                        "which layers keep K/V and writes no attention in their place; fix: write the spec by hand")


def _num_layers(c: Mapping) -> int:
    if "num_hidden_layers" in c:
        return _int(c, "num_hidden_layers")
    if isinstance(c.get("layers_block_type"), list):   # transformers 5.x NemotronHConfig drops num_hidden_layers
        return len(c["layers_block_type"])
    raise InitError("config.json has no 'num_hidden_layers'; expected a HuggingFace model config "
                    "(the model's config.json, not a tokenizer or generation config)")


def read_model(config: Mapping[str, Any], name: str = "") -> Model:
    """The model facts of ``config`` (a multimodal config's ``text_config`` is used when present)."""
    if not isinstance(config, Mapping):
        raise InitError(f"config.json must be a JSON object, found {type(config).__name__}")
    c = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else config
    name = name or str(config.get("_name_or_path") or c.get("model_type") or config.get("model_type") or "model")
    n = _num_layers(c)
    return _state_or_latent_model(c, name, n) or _attention_model(c, name, n)


def _state_or_latent_model(c: Mapping, name: str, n: int) -> Model | None:
    """An MLA model or a hybrid with state layers, by the fields that declare them; None: neither."""
    if c.get("kv_lora_rank"):
        return _mla(c, name, n)
    per_layer = c.get("layer_types") if c.get("mamba_n_heads") else None  # Granite-4: Mamba-2 or attention
    if "mamba_d_ssm" in c or (c.get("mamba_n_heads") and "attn_layer_indices" not in c and not per_layer):
        return _parallel_hybrid(c, name, n)
    if c.get("hybrid_override_pattern") or isinstance(c.get("layers_block_type"), list) or per_layer:
        return _mamba(c, name, n)
    if "attn_layer_period" in c or "attn_layer_offset" in c:
        return _mamba1(c, name, n)
    if c.get("linear_num_value_heads"):
        return _linear(c, name, n)
    if "conv_L_cache" in c:
        return _short_conv(c, name, n)
    return None


def _attention_model(c: Mapping, name: str, n: int) -> Model:
    """Dense, sliding/full or chunked/full attention; a config with other hybrid fields is refused."""
    _refuse_unknown_hybrid(c)
    kinds = _attention_kinds(c, n)
    if kinds is not None and LayerKind.CHUNKED in kinds:
        return Model(name, Family.CHUNKED, n, kinds, _kv_heads(c), _head_dim(c), chunk=chunk_size(c))
    if kinds is not None and LayerKind.SLIDING in kinds:
        return Model(name, Family.SLIDING, n, kinds, _kv_heads(c), _head_dim(c), window=sliding_window(c))
    return Model(name, Family.DENSE, n, (LayerKind.FULL,) * n, _kv_heads(c), _head_dim(c))
