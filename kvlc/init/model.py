"""What a HuggingFace ``config.json`` says about a model's KV cache, read by its fields.

:func:`read_model` dispatches on config fields, never on a model name:

* ``kv_lora_rank`` → MLA (one latent of ``kv_lora_rank + qk_rope_head_dim`` per token);
  ``index_head_dim`` / ``index_topk`` besides it → the sparse-attention indexer;
* ``hybrid_override_pattern`` → Mamba-2 hybrid (``M`` Mamba, ``*`` attention, ``-`` MLP);
* ``linear_num_value_heads`` with ``layer_types`` or ``full_attention_interval`` →
  Gated-DeltaNet hybrid (linear attention, full attention every n-th layer);
* ``layer_types`` or ``sliding_window_pattern`` with ``sliding_window`` → sliding/full mix;
* otherwise dense GQA/MHA.

``head_dim`` is taken from the config when present (``attention_head_dim`` for
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

from kvlc.errors import KvlcError


class InitError(KvlcError):
    """A config.json or engine description ``kvlc init`` cannot turn into a spec."""


class LayerKind(str, Enum):
    """What one layer keeps between steps."""

    FULL = "full"            # paged K/V (or an MLA latent) over all tokens
    SLIDING = "sliding"      # paged K/V, a window of tokens
    MAMBA = "mamba"          # Mamba-2 conv + SSM state per request
    LINEAR = "linear"        # Gated DeltaNet conv + recurrent state per request
    NONE = "none"            # MLP / MoE only: no cache


class Family(str, Enum):
    DENSE = "dense"
    SLIDING = "sliding"
    MLA = "mla"
    MAMBA = "mamba-hybrid"
    LINEAR = "linear-hybrid"


@dataclass(frozen=True)
class Mamba2:
    """Mamba-2 state sizes: conv over x | B | C channels, SSM heads x head_dim x state."""

    conv_kernel: int
    d_inner: int
    d_bc: int
    heads: int
    head_dim: int
    state: int


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
    num_layers: int
    kinds: tuple[LayerKind, ...]
    num_kv_heads: int = 0
    head_dim: int = 0
    window: int = 0
    latent: int = 0                 # MLA: kv_lora_rank + qk_rope_head_dim
    rope: int = 0                   # MLA: qk_rope_head_dim (the latent's last ``rope`` values)
    index_head_dim: int = 0         # sparse-attention indexer key size (0: none)
    draft_layers: int = 0           # MTP layers after the main ones
    mamba: Mamba2 | None = None
    deltanet: DeltaNet | None = None
    sizes: dict = field(default_factory=dict)


def _int(c: Mapping, key: str, where: str = "config.json") -> int:
    value = c.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InitError(f"{where}: '{key}' must be a non-negative integer, found {value!r}; "
                        f"fix: give the model's {key} as in its HuggingFace config.json")
    return value


def _head_dim(c: Mapping, key: str = "head_dim") -> int:
    if c.get(key) is not None:
        return _int(c, key)
    heads = _int(c, "num_attention_heads")
    hidden = _int(c, "hidden_size")
    if not heads or hidden % heads:
        raise InitError(f"config.json has no '{key}' and hidden_size {hidden} is not a multiple of "
                        f"num_attention_heads {heads}; fix: add '{key}' to the config")
    return hidden // heads


def _kv_heads(c: Mapping) -> int:
    return _int(c, "num_key_value_heads") if c.get("num_key_value_heads") is not None \
        else _int(c, "num_attention_heads")


def _sliding_kinds(c: Mapping, n: int) -> tuple[LayerKind, ...] | None:
    types = c.get("layer_types")
    if isinstance(types, list) and c.get("sliding_window"):
        if len(types) != n:
            raise InitError(f"config.json: layer_types has {len(types)} entries, num_hidden_layers is {n}; "
                            "fix: give one type per layer")
        return tuple(LayerKind.SLIDING if t == "sliding_attention" else LayerKind.FULL for t in types)
    pattern = c.get("sliding_window_pattern")
    if pattern and c.get("sliding_window"):
        p = _int(c, "sliding_window_pattern")
        return tuple(LayerKind.FULL if (i + 1) % p == 0 else LayerKind.SLIDING for i in range(n))
    return None


def _mla(c: Mapping, name: str, n: int) -> Model:
    latent = _int(c, "kv_lora_rank") + _int(c, "qk_rope_head_dim")
    index = _int(c, "index_head_dim") if c.get("index_head_dim") or c.get("index_topk") else 0
    sizes = {"latent": latent, **({"index_head_dim": index} if index else {})}
    return Model(name, Family.MLA, n, (LayerKind.FULL,) * n, latent=latent, rope=_int(c, "qk_rope_head_dim"),
                 index_head_dim=index,
                 draft_layers=_int(c, "num_nextn_predict_layers") if c.get("num_nextn_predict_layers") else 0,
                 sizes=sizes)


_PATTERN = {"M": LayerKind.MAMBA, "*": LayerKind.FULL, "-": LayerKind.NONE, "E": LayerKind.NONE}


def _mamba(c: Mapping, name: str, n: int) -> Model:
    pattern = str(c["hybrid_override_pattern"])
    bad = sorted(set(pattern) - set(_PATTERN))
    if bad or len(pattern) != n:
        raise InitError(f"config.json: hybrid_override_pattern must have {n} letters of M, *, -, E, "
                        f"found {len(pattern)} letters{' with ' + repr(''.join(bad)) if bad else ''}; "
                        "fix: one letter per layer")
    m = Mamba2(_int(c, "conv_kernel"), _int(c, "mamba_num_heads") * _int(c, "mamba_head_dim"),
               _int(c, "n_groups") * _int(c, "ssm_state_size"), _int(c, "mamba_num_heads"),
               _int(c, "mamba_head_dim"), _int(c, "ssm_state_size"))
    sizes = {"conv_tap": m.conv_kernel - 1, "ssm_head": m.heads, "mamba_head_dim": m.head_dim,
             "ssm_state": m.state}
    return Model(name, Family.MAMBA, n, tuple(_PATTERN[x] for x in pattern), _kv_heads(c),
                 _head_dim(c, "attention_head_dim"), mamba=m, sizes=sizes)


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


def read_model(config: Mapping[str, Any], name: str = "") -> Model:
    """The model facts of ``config`` (a multimodal config's ``text_config`` is used when present)."""
    if not isinstance(config, Mapping):
        raise InitError(f"config.json must be a JSON object, found {type(config).__name__}")
    c = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else config
    name = name or str(config.get("_name_or_path") or c.get("model_type") or config.get("model_type") or "model")
    if "num_hidden_layers" not in c:
        raise InitError("config.json has no 'num_hidden_layers'; expected a HuggingFace model config "
                        "(the model's config.json, not a tokenizer or generation config)")
    n = _int(c, "num_hidden_layers")
    if c.get("kv_lora_rank"):
        return _mla(c, name, n)
    if c.get("hybrid_override_pattern"):
        return _mamba(c, name, n)
    if c.get("linear_num_value_heads"):
        return _linear(c, name, n)
    kinds = _sliding_kinds(c, n)
    if kinds is not None and LayerKind.SLIDING in kinds:
        return Model(name, Family.SLIDING, n, kinds, _kv_heads(c), _head_dim(c), window=_int(c, "sliding_window"))
    return Model(name, Family.DENSE, n, (LayerKind.FULL,) * n, _kv_heads(c), _head_dim(c))
