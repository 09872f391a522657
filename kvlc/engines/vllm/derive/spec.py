"""The kvlc spec of a vLLM engine, derived from the engine itself.

* :func:`engine_view` reads vLLM's config, its ``KVCacheConfig`` and the tensors
  given to ``register_kv_caches`` into a frozen :class:`EngineView` (vLLM is
  imported there, lazily; importing this module imports neither vLLM nor torch).
* :func:`derive_spec` turns a view into a ``kvlc: 1`` spec mapping; :func:`spec_yaml`
  renders it as commented YAML to check in and diff.
* :func:`check_spec` checks a user's plan against the live tensors, every mismatch at once.
* :func:`~kvlc.engines.vllm.derive.storages.storage_tensors` gives the tensors to bind, one
  per plan storage: a uint8 tensor over each whole allocation (vLLM puts all layers in one).
* :func:`exact_plan` is the plan to bind for CPU_ATTN when the other engine may have
  another block size: the CPU kernels store K transposed inside each head's half of a
  block, which the spec language cannot state, so the spec holds each half as one opaque
  ``cell`` (exact bytes, pairs across TP, refuses other block sizes); ``exact_plan`` names
  tokens with the real byte strides of the engine's CPU attention ISA
  (:mod:`kvlc.engines.vllm.derive.cpu`). For every other layout it is :func:`derive_plan`.

Names are stable across engines: regions are ``layer.{i}`` (``i`` parsed from the
vLLM layer name), groups are named by kind, so a prefill and a decode engine that
differ in block size or TP pair.

>>> from kvlc.engines.vllm.derive.view import EngineView, EXAMPLE
>>> from kvlc.compiler import compile_spec
>>> plan = compile_spec(spec_yaml(EngineView.from_dict(EXAMPLE)))
>>> print(plan.regions[1].text())
layer.1 kv+131072 DRAM:0 blocks=8 bytes=16384 stride=16384 tokens=32 groups=full | kv@0:bf16(head@H=2/2:8192,kv=2:4096,cell=2048:2)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from kvlc.compiler import compile_spec
from kvlc.engines.vllm.derive.check import check_plan_against_view
from kvlc.engines.vllm.derive.cpu import cpu_exact_plan, tokens_per_entry
from kvlc.engines.vllm.derive.layout import LayerGeometry, layer_geometry
from kvlc.engines.vllm.derive.read import read_engine_view
from kvlc.engines.vllm.derive.render import render_spec
from kvlc.engines.vllm.derive.state import placements, state_region, storage_of_state
from kvlc.engines.vllm.derive.storages import allocations
from kvlc.engines.vllm.derive.view import (Axis, EngineView, GroupKind, GroupView, LayerTensor, ViewError,
                                           heads_per_rank)

__all__ = ["engine_view", "derive_spec", "spec_yaml", "check_spec", "derive_plan", "exact_plan", "group_names"]

_KVLC_GROUP_KIND = {GroupKind.FULL_ATTENTION: "full_attention", GroupKind.SLIDING_WINDOW: "sliding_window",
                    GroupKind.CHUNKED_LOCAL: "chunked_local", GroupKind.MLA: "full_attention"}


def engine_view(vllm_config: Any, kv_cache_config: Any, kv_caches: Mapping[str, Any]) -> EngineView:
    """Read a live vLLM engine's KV-cache facts (model, parallelism, groups, per layer tensors).

    Call it where a connector's ``register_kv_caches(kv_caches)`` runs, with the
    connector's ``vllm_config`` and ``kv_cache_config``.
    """
    return read_engine_view(vllm_config, kv_cache_config, kv_caches)


# ---------------------------------------------------------------- the spec
def _state_kind(view: EngineView) -> str | None:
    """``mamba`` (Mamba-2, Mamba-1 or a short convolution, as kvlc init names them: vLLM's MambaSpec groups) or
    ``linear`` (Gated DeltaNet): the kind of the view's state groups."""
    if view.state is None:
        return None
    return "linear" if view.state.name == "gdn_state" else "mamba"


def group_names(view: EngineView) -> tuple[str, ...]:
    """Stable group names by kind: ``full``, ``sliding.{window}``, ``chunked.{chunk}``, ``mla``, ``mamba``,
    ``linear`` (+ ``.N``)."""
    out: list[str] = []
    for g in view.groups:
        base = {GroupKind.FULL_ATTENTION: "full", GroupKind.SLIDING_WINDOW: f"sliding.{g.window}",
                GroupKind.CHUNKED_LOCAL: f"chunked.{g.chunk}", GroupKind.MLA: "mla",
                GroupKind.MAMBA: _state_kind(view)}.get(g.kind)
        if base is None:
            raise ViewError(f"KV-cache group of kind '{g.kind.value}' ({g.spec_type or 'unknown spec'}, layers "
                            f"{', '.join(g.layer_names[:3])}...) cannot be derived yet from live tensors, so "
                            "KvlcConnector cannot serve this engine (it serves full, sliding-window, chunked-local, "
                            "MLA, Mamba-1, Mamba-2 and Gated-DeltaNet groups, also under vLLM's hybrid manager); use vLLM's "
                            "NixlConnector for it. Its spec (for kvlc pair / explain) comes offline from the "
                            "model's config.json: `kvlc init CONFIG.json --engine vllm --backend B`")
        n = sum(1 for x in out if x == base or x.startswith(base + "."))
        out.append(base if n == 0 else f"{base}.{n}")
    return tuple(out)


def _group_entry(name: str, g: GroupView, view: EngineView) -> dict:
    if g.kind == GroupKind.MAMBA:   # per-request state: one block per request, no tokens
        return {"name": name, "kind": "mamba" if _state_kind(view) == "mamba" else "linear_attention"}
    entry: dict[str, Any] = {"name": name, "kind": _KVLC_GROUP_KIND[g.kind]}
    if g.kind == GroupKind.SLIDING_WINDOW:
        entry["window"] = g.window
    if g.kind == GroupKind.CHUNKED_LOCAL:
        entry["chunk"] = g.chunk
    if g.block_size != view.block_size:
        entry["block_size"] = g.block_size
    if tokens_per_entry(view) > 1:  # CPU_ATTN with ISA amx: tokens move in entries of 16 (derive.cpu)
        entry["tokens_per_entry"] = tokens_per_entry(view)
    return entry


def _field_dims(geo: LayerGeometry) -> list[dict]:
    out = []
    for d in geo.dims:
        if d.axis == Axis.HEAD:
            out.append({"name": "head", "role": "head"})
        elif d.axis == Axis.TOKEN:
            out.append({"name": "token", "role": "token"})
        elif d.axis == Axis.KV:
            out.append({"name": "kv", "size": 2})
        elif d.axis == Axis.CELL:
            out.append({"name": "cell", "size": d.size})
        else:
            out.append({"name": d.axis.value})
    return out


def _check_layer(t: LayerTensor, geo: LayerGeometry, view: EngineView) -> None:
    problems = []
    if t.dtype != view.model.dtype:
        problems.append(f"dtype {t.dtype}, the model's KV dtype is {view.model.dtype}")
    sizes = {d.axis: d.size for d in geo.dims}
    heads = heads_per_rank(view.model.num_kv_heads, view.parallel.tp_size)
    if Axis.HEAD in sizes and sizes[Axis.HEAD] != heads:
        problems.append(f"{sizes[Axis.HEAD]} heads, expected {heads} ({view.model.num_kv_heads} KV heads "
                        f"over tp_size {view.parallel.tp_size})")
    if Axis.TOKEN in sizes and sizes[Axis.TOKEN] != view.kernel_block_size:
        problems.append(f"{sizes[Axis.TOKEN]} tokens per block, expected kernel block size "
                        f"{view.kernel_block_size}")
    ratio = view.block_size // view.kernel_block_size
    if geo.num_blocks != view.num_blocks * ratio:
        problems.append(f"{geo.num_blocks} kernel blocks, expected {view.num_blocks} blocks x {ratio}")
    if problems:
        raise ViewError(f"tensor '{t.name}' disagrees with the engine config: " + "; ".join(problems))


def _aliases(view: EngineView) -> dict[str, str]:
    """Layer name -> the first layer whose tensor it shares (vLLM's hybrid KV-cache manager: the k-th
    layers of all groups lie over one page pool, page for page); sharing inside one group is refused."""
    first: dict[tuple[str, int], str] = {}
    out: dict[str, str] = {}
    for name, _, device, ptr in placements(view):   # attention and state layers, in layer order
        other = first.setdefault((device, ptr), name)
        if other == name:
            continue
        if view.group_of(other) == view.group_of(name):
            raise ViewError(f"layers '{other}' and '{name}' of one KV-cache group share one tensor at "
                            f"{ptr:#x}; vLLM's hybrid manager shares pages only between groups, so "
                            "kvlc cannot tell their blocks apart; fix: report this engine's KVCacheConfig")
        out[name] = other
    return out


def _model_entry(view: EngineView, latent: int | None) -> dict:
    m = view.model
    entry: dict[str, Any] = {"name": m.name, "num_layers": m.num_layers}
    if latent is None:
        entry.update(num_kv_heads=m.num_kv_heads, head_dim=m.head_dim)
    else:
        entry["sizes"] = {"latent": latent}
    return entry


def spec_name(view: EngineView) -> str:
    """``{model}-{backend}-tp{N}-b{block}``, lower case, safe for a kvlc name."""
    base = re.sub(r"[^A-Za-z0-9_.\-]+", "-", view.model.name.rstrip("/").rsplit("/", 1)[-1]).strip("-.")
    p = view.parallel
    pp = f"-pp{p.pp_rank}of{p.pp_size}" if p.pp_size > 1 else ""
    return f"{base or 'model'}-{view.backend}-tp{p.tp_size}{pp}-b{view.block_size}".lower()


def _regions(view: EngineView) -> tuple[dict, list[dict], int | None]:
    """The spec's layouts and regions (one per layer, or per K/V part), and the MLA latent size if any."""
    names = group_names(view)
    storage_of = {layer: a.name for a in allocations(view) for layer in a.layers}
    layouts: dict[str, dict] = {}
    regions: list[dict] = []
    latent = None
    aliases = _aliases(view)
    index = {name: i for name, i, _, _ in placements(view)}
    for t in sorted(view.layers, key=lambda t: t.layer_index):
        geo = layer_geometry(t, view)
        _check_layer(t, geo, view)
        latent = next((d.size for d in geo.dims if d.axis == Axis.LATENT), latent)
        for part in geo.parts:
            lname = f"{part.field}_{geo.code}"
            layouts.setdefault(lname, {"fields": [{"name": part.field, "dtype": t.dtype,
                                                   "dims": _field_dims(geo)}]})
            regions.append({"name": f"layer.{t.layer_index}{part.suffix}", "storage": storage_of[t.name],
                            "layout": lname, "num_blocks": geo.num_blocks, "offset": t.offset + part.offset,
                            "block_stride": geo.block_stride, "groups": [names[view.group_of(t.name)]]})
            if part.suffix:   # K and V in tensors of their own: parts of the layer's region (pairs with joint K/V)
                regions[-1]["part_of"] = f"layer.{t.layer_index}"
            if t.name in aliases:   # the hybrid manager's page pool: these pages serve another group too
                regions[-1]["aliases"] = [f"layer.{index[aliases[t.name]]}{part.suffix}"]
    if view.states:
        layouts[view.state.name] = view.state.layout()
        regions = sorted(regions + _state_regions(view, names, storage_of, aliases, index),
                         key=lambda r: int(r["name"].split(".")[1]))
    return layouts, regions, latent


def _state_regions(view: EngineView, names, storage_of, aliases, index) -> list[dict]:
    """One region per Mamba / linear-attention layer, in the page pool of the attention layers."""
    pools = {(t.device, t.storage_ptr): storage_of[t.name] for t in view.layers}
    out = []
    for s in view.states:
        out.append(state_region(s, view, storage_of_state(s, pools), names[view.group_of(s.name)]))
        if s.name in aliases:
            out[-1]["aliases"] = [f"layer.{index[aliases[s.name]]}"]
    return out


def _parallel_entry(view: EngineView) -> dict:
    p = view.parallel
    parallel: dict[str, Any] = {"tp_size": p.tp_size}
    if p.dcp_size > 1:
        parallel["dcp_size"] = p.dcp_size
    if p.dcp_interleave > 1:
        parallel["dcp_interleave"] = p.dcp_interleave
    if p.layers is not None and p.pp_size > 1:
        parallel["layers"] = list(p.layers)
    return parallel


def derive_spec(view: EngineView) -> dict:
    """A ``kvlc: 1`` spec mapping for the engine in ``view`` (compiles with :mod:`kvlc.compiler`).

    >>> from kvlc.engines.vllm.derive.view import EngineView, EXAMPLE
    >>> spec = derive_spec(EngineView.from_dict(EXAMPLE))
    >>> spec["storages"], [r["name"] for r in spec["regions"]]
    ([{'name': 'kv', 'mem': 'DRAM', 'device': 0, 'size': 262144}], ['layer.0', 'layer.1'])
    """
    if not view.layers:
        raise ViewError("the view has no layer tensors; derive after vLLM allocated the KV cache")
    layouts, regions, latent = _regions(view)
    spec: dict[str, Any] = {"kvlc": 1, "name": spec_name(view), "model": _model_entry(view, latent),
                            "parallel": _parallel_entry(view), "block_size": view.block_size}
    if view.kernel_block_size != view.block_size:
        spec["kernel_block_size"] = view.kernel_block_size
    spec["groups"] = [_group_entry(n, g, view) for n, g in zip(group_names(view), view.groups)]
    spec["storages"] = [{"name": a.name, "mem": a.mem, "device": a.device, "size": a.nbytes}
                        for a in allocations(view)]
    spec["layouts"] = layouts
    spec["regions"] = regions
    return spec


def spec_yaml(view: EngineView) -> str:
    """The derived spec as commented YAML (one line per region, group, storage and dim)."""
    return render_spec(derive_spec(view), view)


def derive_plan(view: EngineView):
    """The :class:`~kvlc.compiler.plan.model.Plan` of the derived spec (compiled from its YAML text)."""
    return compile_spec(spec_yaml(view))


def exact_plan(view: EngineView):
    """:func:`derive_plan`, with CPU_ATTN's K and V halves given their real dim orders (tokens addressable).

    The spec language lays out a field's dims row-major, which cannot say "per head, K[D][N]
    then V[N][D]"; the derived spec therefore holds each half as one opaque ``cell`` and
    engines of different block sizes do not pair. This plan names the tokens in the order of
    the view's CPU attention ISA (:mod:`kvlc.engines.vllm.derive.cpu`); it pairs across block
    sizes. Other layouts: the derived plan.
    """
    return cpu_exact_plan(view, derive_plan(view))


def check_spec(plan: Any, view: EngineView) -> None:
    """Raise :class:`SpecMismatchError` listing every way ``plan`` disagrees with the live tensors."""
    check_plan_against_view(plan, derive_plan(view), view)
