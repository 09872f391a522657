"""``kvlc init``: a spec from a HuggingFace ``config.json`` and an engine description.

Pure (no torch, no vLLM). :func:`init_spec` gives the spec as a mapping,
:func:`init_yaml` as commented YAML. The model is read by its config fields
(:mod:`kvlc.init.model`), the engine's cache shape comes from data
(:mod:`kvlc.init.engines`), and :mod:`kvlc.init.write` assembles the spec. Engine ``vllm``
takes its backend layouts from the vLLM adapter's offline views (:mod:`kvlc.init.vllm`).

>>> from kvlc.compiler import compile_spec
>>> cfg = {"num_hidden_layers": 4, "hidden_size": 5120, "num_attention_heads": 64,
...        "num_key_value_heads": 8, "head_dim": 128}
>>> plan = compile_spec(init_yaml(cfg, EngineOptions(tp_size=2, num_blocks=64)))
>>> plan.regions[0].text()
'layer.0 kv.0+0 VRAM:0 blocks=64 bytes=32768 stride=32768 tokens=16 groups=full | k@0:bf16(token@T=16:1024,head@H=4/8:256,head_dim=128:2) v@16384:bf16(token@T=16:1024,head@H=4/8:256,head_dim=128:2)'
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from kvlc.compiler import compile_spec
from kvlc.compiler.spec.dtypes import DTYPE_SIZES
from kvlc.errors import Problem, SpecError, did_you_mean, format_path
from kvlc.init.ds_mla import DS_MLA, ds_mla_record
from kvlc.init.engines import (ENGINES, MEMS, EngineOptions, backend_of, dcp_parallel, default_block_size,
                               stage_layers)
from kvlc.init.model import Family, InitError, LayerKind, Model, read_model
from kvlc.init.vllm import vllm_spec
from kvlc.init.write import GroupNames, Layer, groups, layouts, regions, storages

def _check(opts: EngineOptions, m: Model) -> None:
    if opts.kv_dtype == DS_MLA:
        ds_mla_record(m)  # refuses models without a latent it can pack
    elif opts.kv_dtype not in DTYPE_SIZES:
        raise InitError(f"--kv-dtype '{opts.kv_dtype}': unknown KV dtype; "
                        f"{did_you_mean(opts.kv_dtype, [*DTYPE_SIZES, DS_MLA])}")
    if opts.mem not in MEMS:
        raise InitError(f"--mem '{opts.mem}': unknown memory type; {did_you_mean(opts.mem, MEMS)}")
    for key in ("tp_size", "pcp_size", "dcp_size", "dcp_interleave", "block_size", "num_blocks"):
        if getattr(opts, key) < 1:
            raise InitError(f"--{key.replace('_', '-')} must be at least 1, found {getattr(opts, key)}")
    _check_dcp(opts, m)
    if m.family == Family.PARALLEL and (opts.layers is not None or opts.pp_size > 1):
        raise InitError(f"--layers / --pp-size with a {m.family.value} model: a pipeline stage of decoder layers "
                        f"[a, b) holds cache layers [a, b) and [{m.num_layers // 2} + a, {m.num_layers // 2} + b) "
                        "(attention and Mamba-2 mixers), which one parallel.layers window cannot state; fix: drop "
                        "--layers / --pp-size, or write the stage's spec by hand")


def _check_dcp(opts: EngineOptions, m: Model) -> None:
    """DCP ranks share a head's replicas (vLLM: dcp_size up to tp_size / num_kv_heads), or tokens are lost;
    with PCP, DCP is 1, along the PCP ranks or over all TP x PCP ranks (vLLM's ParallelConfig)."""
    heads = 1 if m.family == Family.MLA else m.num_kv_heads
    if opts.pcp_size > 1:
        _check_pcp_dcp(opts, heads)
        return
    replicas = opts.tp_size // heads if heads and opts.tp_size % heads == 0 else 1
    if opts.dcp_size > 1 and replicas % opts.dcp_size:
        raise InitError(f"--dcp-size {opts.dcp_size} with --tp-size {opts.tp_size} and {heads} KV heads: each "
                        f"head is held by {replicas} rank(s), and the DCP ranks of a head must be among them; "
                        f"fix: use a --dcp-size dividing {replicas}, or a larger --tp-size")


def _check_pcp_dcp(opts: EngineOptions, heads: int) -> None:
    p, t, d = opts.pcp_size, opts.tp_size, opts.dcp_size
    valid = sorted({1, p, t * p})
    if d not in valid:
        raise InitError(f"--dcp-size {d} with --pcp-size {p} and --tp-size {t}: vLLM allows DCP off, along the "
                        f"PCP ranks or over all TP x PCP ranks; fix: use a --dcp-size in {valid}")
    if d == t * p and d != p and heads != 1:
        raise InitError(f"--dcp-size {d} over all {t} x {p} ranks with {heads} KV heads: TP ranks hold other heads, "
                        f"so a DCP group would lose tokens of each head; fix: use --dcp-size {p} (along the PCP "
                        "ranks) or 1 (vLLM runs PCP for MLA models, where every rank holds the latent)")


def engine_layers(m: Model, opts: EngineOptions) -> tuple[tuple[int, int] | None, list[Layer]]:
    """The pipeline window (None: all layers) and the cache-holding layers in it (draft layers last)."""
    window = stage_layers(opts, m.num_layers)
    start, stop = window or (0, m.num_layers)
    held = [Layer(i, m.kinds[i]) for i in range(start, stop) if m.kinds[i] != LayerKind.NONE]
    if opts.draft_layers and stop == m.num_layers:
        held += [Layer(m.num_layers + j, LayerKind.FULL, optional=True) for j in range(m.draft_layers)]
    if not held:
        raise InitError(f"layers [{start}, {stop}) hold no KV-cache or state layer (every layer there is of a "
                        "kind that keeps no cache, e.g. an MLP-only layer of a hybrid), so this engine has "
                        "nothing to transfer; choose a --layers window that holds at least one attention or "
                        "state layer")
    return window, held


def _model_block(m: Model, opts: EngineOptions) -> dict:
    out: dict = {"name": opts.model_name or m.name, "num_layers": m.num_layers}
    if m.family != Family.MLA:
        out.update(num_kv_heads=m.num_kv_heads, head_dim=m.head_dim)
    sizes = dict(m.sizes)
    if opts.kv_dtype == DS_MLA:  # the record's parts replace the one latent
        sizes = {**ds_mla_record(m).sizes(), **{k: v for k, v in sizes.items() if k != "latent"}}
    return {**out, "sizes": sizes} if sizes else out


def init_spec(config: Mapping[str, Any], opts: EngineOptions = EngineOptions(),
              names: GroupNames = GroupNames()) -> dict:
    """The ``kvlc: 1`` spec mapping of ``config`` on the engine ``opts`` describes."""
    m = read_model(config)
    if opts.engine == "vllm":
        _check(opts, m)
        return vllm_spec(config, m, opts)
    if opts.cpu_isa != "auto":
        raise InitError(f"--cpu-isa {opts.cpu_isa}: only vLLM's CPU_ATTN backend has a CPU attention ISA "
                        "(--engine kvlc); fix: drop --cpu-isa, or --engine vllm --backend CPU_ATTN")
    b = backend_of(opts)
    _check(opts, m)
    window, held = engine_layers(m, opts)
    parallel: dict = {"tp_size": opts.tp_size, **dcp_parallel(opts)}
    if window is not None:
        parallel["layers"] = list(window)
    lays = layouts(m, b, opts)
    return {"kvlc": 1, "name": opts.name or default_name(m, opts, window), "model": _model_block(m, opts),
            "parallel": parallel, "block_size": opts.block_size, "groups": groups(m, opts, names),
            "storages": storages(held, b, opts, bool(m.index_head_dim)), "layouts": lays,
            "regions": regions(m, held, b, opts, names, lays)}


def default_name(m: Model, opts: EngineOptions, window: tuple[int, int] | None) -> str:
    """``<model>-tp<N>[-pcp<P>][-dcp<D>][-pp<start>-<stop>]-b<block>``, the model part from its name's last path
    part."""
    stem = m.name.rsplit("/", 1)[-1].lower().replace("_", "-")
    pp = f"-pp{window[0]}-{window[1]}" if window else ""
    dcp = f"-dcp{opts.dcp_size}" if opts.dcp_size > 1 else ""
    pcp = f"-pcp{opts.pcp_size}" if opts.pcp_size > 1 else ""
    return f"{stem}-tp{opts.tp_size}{pcp}{dcp}{pp}-b{opts.block_size}"


def _stage(spec: dict) -> str:
    window = spec["parallel"].get("layers")
    return f", pipeline stage holding layers [{window[0]}, {window[1]})" if window else ""


def _blocks(spec: dict, opts: EngineOptions) -> str:
    if spec["block_size"] == opts.block_size:
        return f"{opts.block_size}-token blocks"
    return f"--block-size {opts.block_size} raised to {spec['block_size']}-token blocks (a page holds a state)"


def _isa_text(spec: dict, opts: EngineOptions) -> str:
    """On vLLM's CPU_ATTN: the attention ISA the blocks are ordered for (what ``--cpu-isa auto`` found)."""
    if (opts.engine, opts.backend) != ("vllm", "CPU_ATTN"):
        return ""
    entry = max((g.get("tokens_per_entry", 1) for g in spec["groups"]), default=1)
    isa = "amx, tokens in entries of 16" if entry > 1 else "vec / vec16"
    how = " (--cpu-isa auto: as vLLM picks on this host)" if opts.cpu_isa == "auto" else ""
    return f", CPU attention ISA {isa}{how}"


def _dcp_text(opts: EngineOptions) -> str:
    pcp = f" PCP{opts.pcp_size}" if opts.pcp_size > 1 else ""
    if opts.dcp_size == 1:
        return pcp
    inter = f" (interleave {opts.dcp_interleave})" if opts.dcp_interleave > 1 else ""
    return f"{pcp} DCP{opts.dcp_size}{inter}"


def written(spec: Mapping[str, Any]) -> str:
    """What a spec holds, from its regions: layers per group kind, and whether pages are shared (aliases).

    >>> written({"groups": [{"name": "full", "kind": "full_attention"}],
    ...          "regions": [{"name": "layer.0", "groups": ["full"]}, {"name": "layer.1", "groups": ["full"]}]})
    'regions of 2 layers: 2 full_attention; no aliases (every region its own pages)'
    """
    kind = {g["name"]: g["kind"] for g in spec["groups"]}
    layers: dict[str, str] = {}
    for r in spec["regions"]:
        if not r.get("optional"):
            layers.setdefault(r.get("part_of", r["name"]), kind[r["groups"][0]])
    counts = ", ".join(f"{sum(1 for k in layers.values() if k == g)} {g}" for g in dict.fromkeys(layers.values()))
    shared = sum(1 for r in spec["regions"] if r.get("aliases"))
    pages = (f"{shared} of them declare aliases (the k-th layers of all groups share one page pool)" if shared
             else "no aliases (every region its own pages)")
    draft = sum(1 for r in spec["regions"] if r.get("optional"))
    return f"regions of {len(layers)} layers: {counts}{f' + {draft} optional draft' if draft else ''}; {pages}"


def _layers_text(m: Model) -> str:
    """The model's layers by kind (a parallel hybrid: its two cache layers per decoder layer, numbered as vLLM does)."""
    if m.family == Family.PARALLEL:
        n = m.num_layers // 2
        return (f"{n} layers, each attention beside a Mamba-2 mixer: cache layers 0-{n - 1} full, "
                f"{n}-{2 * n - 1} mamba, as vLLM numbers them")
    kinds = ", ".join(f"{sum(1 for k in m.kinds if k == kind)} {kind.value}" for kind in LayerKind if kind in m.kinds)
    return f"{m.num_layers} layers: {kinds}"


def init_yaml(config: Mapping[str, Any], opts: EngineOptions = EngineOptions(),
              names: GroupNames = GroupNames()) -> str:
    """:func:`init_spec` as YAML with a comment saying what it was made from and what it holds."""
    spec = init_spec(config, opts, names)
    m = read_model(config)
    head = (f"# {spec['model']['name']} ({_layers_text(m)}; {m.family.value}) on engine "
            f"{opts.engine}, backend {opts.backend}, TP{opts.tp_size}{_dcp_text(opts)}{_stage(spec)}, "
            f"{_blocks(spec, opts)}, "
            f"{opts.kv_dtype}{_isa_text(spec, opts)}.\n# Written: {written(spec)}.\n"
            "# Generated by kvlc init from the model's config.json.\n")
    return head + yaml.safe_dump(spec, sort_keys=False, default_flow_style=None, width=120)


# the option of ``kvlc init`` that each spec key it writes comes from
OPTIONS = {"tp_size": ("--tp-size", "tp_size"), "pcp_size": ("--pcp-size", "pcp_size"),
           "dcp_size": ("--dcp-size", "dcp_size"),
           "dcp_interleave": ("--dcp-interleave", "dcp_interleave"), "layers": ("--layers / --pp-size", "layers"),
           "block_size": ("--block-size", "block_size"), "kernel_block_size": ("--kernel-block-size",
                                                                                "kernel_block_size"),
           "num_blocks": ("--num-blocks", "num_blocks"), "mem": ("--mem", "mem"), "device": ("--device", "device"),
           "dtype": ("--kv-dtype", "kv_dtype"), "name": ("--name", "name")}


def _option_problem(p: Problem, opts: EngineOptions) -> Problem:
    """``p`` at the command-line option its spec key comes from (the spec text's line:col means nothing to
    someone who never saw that text)."""
    key = next((k for k in reversed(p.path) if isinstance(k, str) and k in OPTIONS), None)
    where = format_path(p.path)
    if key is None:
        return Problem((f"kvlc init's spec at {where}",), p.what, p.expected, p.found, p.fix)
    option, attr = OPTIONS[key]
    label = f"{option} {getattr(opts, attr)}"
    return Problem((f"{label} (the spec's {where})",), p.what, p.expected, p.found,
                   p.fix.replace(where, option) if p.fix else p.fix)


def init_checked(config: Mapping[str, Any], opts: EngineOptions = EngineOptions(),
                 names: GroupNames = GroupNames()) -> str:
    """:func:`init_yaml`, compiled: a combination the compiler refuses is a :class:`SpecError` whose problems
    name the ``kvlc init`` option they come from (``--tp-size 3 (the spec's parallel.tp_size): ...``)."""
    text = init_yaml(config, opts, names)
    try:
        compile_spec(text)
    except SpecError as exc:
        raise SpecError(_option_problem(p, opts) for p in exc.problems) from None
    return text


__all__ = ["init_spec", "init_yaml", "init_checked", "EngineOptions", "GroupNames", "InitError", "ENGINES", "read_model",
           "default_block_size"]
