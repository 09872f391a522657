"""``kvlc init --engine vllm``: vLLM's backend layouts, from the vLLM adapter's offline views.

The adapter (:mod:`kvlc.engines.vllm.derive.offline`) knows how vLLM lays out each attention
and MLA backend; this module only turns an engine description into its arguments and
adjusts the spec it derives:

* layer kinds come from :func:`kvlc.init.model.read_model`, so a Gemma-style
  ``sliding_window_pattern`` reaches the adapter as ``layer_types``;
* a pipeline stage is an engine whose allocation holds its layers only: the adapter sees
  a model of ``stop - start`` layers, and its regions are renamed to the model's layer
  numbers and put under ``parallel.layers``;
* a Llama-4-style ``attention_chunk_size`` reaches it as ``chunked_attention`` layer types;
* Mamba-2, Mamba-1 and Gated-DeltaNet hybrids take vLLM's hybrid page pool
  (:mod:`kvlc.engines.vllm.derive.hybrid`): one allocation whose layers of different groups
  lie over the same pages, declared as ``aliases``; the attention block grows so a page
  holds a state;
* the sparse-attention indexer is refused (see :func:`_refuse`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from kvlc.engines.vllm.derive.cpu import backend_isa, host_flags, resolve_isa
from kvlc.engines.vllm.derive.hybrid import hybrid_spec
from kvlc.engines.vllm.derive.offline import (ATTENTION_BACKENDS, CPU_BACKENDS, MLA_BACKENDS, check_engine_block,
                                               published_view)
from kvlc.engines.vllm.derive.spec import derive_spec
from kvlc.engines.vllm.derive.state import mamba2_fields
from kvlc.engines.vllm.derive.view import ViewError
from kvlc.errors import did_you_mean
from kvlc.init.ds_mla import DS_MLA
from kvlc.init.engines import EngineOptions, dcp_parallel, stage_layers
from kvlc.init.model import Family, InitError, LayerKind, Model

_LAYER = re.compile(r"^layer\.(\d+)")


HYBRID = {LayerKind.FULL: "attention", LayerKind.MAMBA: "mamba", LayerKind.LINEAR: "linear"}
HYBRID_FAMILIES = {Family.MAMBA: "mamba", Family.MAMBA1: "mamba1", Family.LINEAR: "linear",
                   Family.PARALLEL: "mamba2", Family.CONV: "short_conv"}  # -> kvlc.engines.vllm.derive.hybrid's kind
_TYPES = {LayerKind.SLIDING: "sliding_attention", LayerKind.CHUNKED: "chunked_attention"}


def vllm_config(config: Mapping[str, Any], m: Model, window: tuple[int, int] | None = None) -> dict:
    """The text config vLLM's offline view reads: the layers of ``window`` only (default all), their
    kinds spelled as ``layer_types`` (transformers' defaults and Gemma's pattern made explicit)."""
    text = dict(config.get("text_config", config))
    start, stop = window or (0, m.num_layers)
    text["num_hidden_layers"] = stop - start
    if m.family in (Family.SLIDING, Family.CHUNKED):
        text["layer_types"] = [_TYPES.get(k, "full_attention") for k in m.kinds[start:stop]]
    if m.family == Family.CHUNKED:
        text["attention_chunk_size"] = m.chunk
    return text


def _refuse(m: Model, opts: EngineOptions) -> None:
    if m.index_head_dim or opts.kv_dtype == DS_MLA:
        raise InitError("engine 'vllm': vLLM 0.32 keeps the sparse-attention indexer's keys (and the fp8_ds_mla "
                        "cache its sparse MLA backends read) as a second MLA-type layer per attention layer, in the "
                        "MLA layers' KV-cache group and allocation; the offsets and the byte order inside an "
                        "indexer page (keys, then scales) were not checked against a running engine (the sparse "
                        "backends need a GPU), so kvlc does not state them; fix: use --engine kvlc (its indexer "
                        "is a region per layer in a group of its own) or write the spec by hand")
    if m.family in HYBRID_FAMILIES and opts.kernel_block_size not in (None, opts.block_size):
        raise InitError(f"engine 'vllm', {m.family.value} model: --kernel-block-size {opts.kernel_block_size} "
                        "would split the attention pages that state pages alias; the language states such pools (an alias "
                        "compares pages of kernel blocks) but kvlc init does not write them for vLLM yet; fix: drop "
                        "--kernel-block-size, or write the attention regions' kernel blocks by hand")
    if opts.sliding_blocks is not None or opts.state_slots is not None:
        raise InitError("engine 'vllm' gives every KV-cache group the same block count; "
                        "fix: drop --sliding-blocks / --state-slots and set --num-blocks")
    if opts.backend in CPU_BACKENDS and opts.mem != "DRAM":
        raise InitError(f"--mem {opts.mem}: backend {opts.backend} keeps its cache in host memory (DRAM); "
                        "fix: --mem DRAM")


def _renumber(name: str, start: int) -> str:
    return _LAYER.sub(lambda x: f"layer.{int(x.group(1)) + start}", name, count=1)


def _renumbered(region: dict, start: int) -> dict:
    """A region of a stage's view under the model's layer numbers (its name, and the regions it aliases)."""
    out = {**region, "name": _renumber(region["name"], start)}
    if region.get("aliases"):
        out["aliases"] = [_renumber(a, start) for a in region["aliases"]]
    return out


def vllm_spec(config: Mapping[str, Any], m: Model, opts: EngineOptions) -> dict:
    """The spec of ``config`` on a vLLM engine with backend ``opts.backend`` (see the module docstring)."""
    if opts.backend not in ATTENTION_BACKENDS | MLA_BACKENDS:
        raise InitError(f"--backend '{opts.backend}': engine 'vllm' has no such backend; "
                        f"{did_you_mean(opts.backend, ATTENTION_BACKENDS | MLA_BACKENDS)}")
    _refuse(m, opts)
    window = stage_layers(opts, m.num_layers)
    start, stop = window or (0, m.num_layers)
    device = "cpu" if opts.mem == "DRAM" else f"cuda:{opts.device}"
    if m.family in HYBRID_FAMILIES:
        spec = _hybrid(config, m, opts, (start, stop), device)
        _check_isa(spec, opts)
        return _finish(spec, opts, window, renumber=False)
    try:
        check_engine_block(opts.backend, opts.block_size, opts.kernel_block_size)
        view = published_view(vllm_config(config, m, (start, stop)), opts.model_name or m.name,
                              backend=opts.backend, block_size=opts.block_size, num_blocks=opts.num_blocks,
                              tp_size=opts.tp_size, kv_dtype=opts.kv_dtype, kernel_block_size=opts.kernel_block_size,
                              device=device, cpu_isa=_cpu_isa(opts))
    except ViewError as exc:
        raise InitError(f"engine 'vllm': {exc}") from None
    spec = derive_spec(view)
    _check_isa(spec, opts)
    spec["model"]["num_layers"] = m.num_layers
    return _finish(spec, opts, window, renumber=True)


def _hybrid(config: Mapping[str, Any], m: Model, opts: EngineOptions, window: tuple[int, int],
            device: str) -> dict:
    layers = [(i, HYBRID[m.kinds[i]]) for i in range(*window) if m.kinds[i] in HYBRID]
    cpu_avx512_bf16 = opts.backend == "CPU_ATTN" and _avx512_bf16(opts)   # vLLM's CPU platform only
    try:
        return hybrid_spec(mamba2_fields(config.get("text_config", config)), opts.model_name or m.name, layers,
                           state_kind=HYBRID_FAMILIES[m.family], backend=opts.backend,
                           block_size=opts.block_size, num_blocks=opts.num_blocks, tp_size=opts.tp_size,
                           kv_dtype=opts.kv_dtype, device=device, num_layers=m.num_layers,
                           ssm_cache_dtype=opts.mamba_ssm_cache_dtype, cpu_avx512_bf16=cpu_avx512_bf16,
                           cpu_isa=_cpu_isa(opts))
    except ViewError as exc:
        raise InitError(f"engine 'vllm': {exc}") from None


def _check_isa(spec: dict, opts: EngineOptions) -> None:
    """A ``--cpu-isa`` asked for is one vLLM 0.32 picks for the spec's dtype, block and head size on some host."""
    if opts.backend == "CPU_ATTN" and opts.cpu_isa != "auto":
        try:
            resolve_isa(opts.cpu_isa, kv_dtype=opts.kv_dtype, block_size=opts.kernel_block_size or spec["block_size"],
                        head_size=spec["model"]["head_dim"])
        except ViewError as exc:
            raise InitError(f"engine 'vllm': {exc}") from None


def _avx512_bf16(opts: EngineOptions) -> bool:
    """Whether the engine's CPU has AVX-512 BF16: as told, else this host's ``/proc/cpuinfo`` flags."""
    if opts.cpu_avx512_bf16 is not None:
        return opts.cpu_avx512_bf16
    return "avx512_bf16" in host_flags()


def _cpu_isa(opts: EngineOptions) -> str:
    """The attention ISA a CPU_ATTN engine is described with (``auto``: picked as vLLM does on this host, by the
    adapter); ``--cpu-isa`` on another backend is refused."""
    try:
        return backend_isa(opts.cpu_isa, opts.backend)
    except ViewError as exc:
        raise InitError(str(exc)) from None


def _finish(spec: dict, opts: EngineOptions, window: tuple[int, int] | None, renumber: bool) -> dict:
    """Name, DCP and pipeline window on a derived spec (regions renumbered when the adapter numbered from 0)."""
    if opts.name:
        spec["name"] = opts.name
    spec["parallel"].update(dcp_parallel(opts))
    if window is not None:
        start, stop = window
        spec["parallel"]["layers"] = [start, stop]
        spec["name"] = opts.name or f"{spec['name']}-pp{start}-{stop}"
        if renumber:
            spec["regions"] = [_renumbered(r, start) for r in spec["regions"]]
    return spec
