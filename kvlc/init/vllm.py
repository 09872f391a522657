"""``kvlc init --engine vllm``: vLLM's backend layouts, from the vLLM adapter's offline views.

The adapter (:mod:`kvlc.engines.vllm.derive_offline`) knows how vLLM lays out each attention
and MLA backend; this module only turns an engine description into its arguments and
adjusts the spec it derives:

* layer kinds come from :func:`kvlc.init.model.read_model`, so a Gemma-style
  ``sliding_window_pattern`` reaches the adapter as ``layer_types``;
* a pipeline stage is an engine whose allocation holds its layers only: the adapter sees
  a model of ``stop - start`` layers, and its regions are renamed to the model's layer
  numbers and put under ``parallel.layers``;
* Mamba / linear-attention states and the sparse-attention indexer are not in the
  adapter's offline views: refused (use ``--engine kvlc``, or derive from a running engine).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from kvlc.errors import did_you_mean
from kvlc.init.engines import EngineOptions, stage_layers
from kvlc.init.model import Family, InitError, LayerKind, Model

_LAYER = re.compile(r"^layer\.(\d+)")


def _refuse(m: Model, opts: EngineOptions) -> None:
    if m.family in (Family.MAMBA, Family.LINEAR) or m.index_head_dim:
        what = "the sparse-attention indexer" if m.index_head_dim else f"{m.family.value} state layers"
        raise InitError(f"engine 'vllm': the offline vLLM views cover attention and MLA layers, not {what}; "
                        "fix: use --engine kvlc, or derive the spec from a running engine (kvlc from-vllm)")
    if opts.sliding_blocks is not None or opts.state_slots is not None:
        raise InitError("engine 'vllm' gives every KV-cache group the same block count; "
                        "fix: drop --sliding-blocks / --state-slots and set --num-blocks")
    if opts.backend == "CPU_ATTN" and opts.mem != "DRAM":
        raise InitError(f"backend CPU_ATTN keeps its cache in host memory, not {opts.mem}; fix: --mem DRAM")


def _stage_config(config: Mapping[str, Any], m: Model, window: tuple[int, int]) -> dict:
    """The config of a model of the stage's layers only, with its layer kinds spelled as ``layer_types``."""
    text = dict(config.get("text_config", config))
    start, stop = window
    text["num_hidden_layers"] = stop - start
    if m.family == Family.SLIDING:
        text["layer_types"] = ["sliding_attention" if k == LayerKind.SLIDING else "full_attention"
                               for k in m.kinds[start:stop]]
    return text


def _renumber(name: str, start: int) -> str:
    return _LAYER.sub(lambda x: f"layer.{int(x.group(1)) + start}", name, count=1)


def vllm_spec(config: Mapping[str, Any], m: Model, opts: EngineOptions) -> dict:
    """The spec of ``config`` on a vLLM engine with backend ``opts.backend`` (see the module docstring)."""
    from kvlc.engines.vllm.derive import derive_spec
    from kvlc.engines.vllm.derive_offline import ATTENTION_BACKENDS, MLA_BACKENDS, published_view
    if opts.backend not in ATTENTION_BACKENDS | MLA_BACKENDS:
        raise InitError(f"engine 'vllm' has no backend '{opts.backend}'; "
                        f"{did_you_mean(opts.backend, ATTENTION_BACKENDS | MLA_BACKENDS)}")
    _refuse(m, opts)
    window = stage_layers(opts, m.num_layers)
    start, stop = window or (0, m.num_layers)
    device = "cpu" if opts.mem == "DRAM" else f"cuda:{opts.device}"
    view = published_view(_stage_config(config, m, (start, stop)), opts.model_name or m.name,
                          backend=opts.backend, block_size=opts.block_size, num_blocks=opts.num_blocks,
                          tp_size=opts.tp_size, kv_dtype=opts.kv_dtype, kernel_block_size=opts.kernel_block_size,
                          device=device)
    spec = derive_spec(view)
    spec["model"]["num_layers"] = m.num_layers
    if opts.name:
        spec["name"] = opts.name
    from kvlc.init import dcp_parallel
    spec["parallel"].update(dcp_parallel(opts))
    if window is not None:
        spec["parallel"]["layers"] = [start, stop]
        spec["name"] = opts.name or f"{spec['name']}-pp{start}-{stop}"
        spec["regions"] = [{**r, "name": _renumber(r["name"], start)} for r in spec["regions"]]
    return spec
