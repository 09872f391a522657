"""Model facts + engine description → a ``kvlc: 1`` spec mapping (see :mod:`kvlc.init`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvlc.init.ds_mla import DS_MLA, ds_mla_record
from kvlc.init.engines import Backend, EngineOptions, KvPlacement
from kvlc.init.model import Family, LayerKind, Model

STATE_KINDS = (LayerKind.MAMBA, LayerKind.LINEAR)


@dataclass(frozen=True)
class GroupNames:
    """The group names of one spec; each layer kind maps to one group."""

    full: str = "full"
    sliding: str = "sliding"
    chunked: str = "chunked"
    state: str = "state"
    indexer: str = "indexer"


def _field(name: str, dtype: str, dims: list[dict], kind: str | None = None) -> dict:
    out = {"name": name}
    if kind:
        out["kind"] = kind
    return {**out, "dtype": dtype, "dims": dims}


def _kv_fields(names: tuple[str, ...], b: Backend, dtype: str) -> dict:
    dims = [{"name": b.order[0], "role": b.order[0]}, {"name": b.order[1], "role": b.order[1]}, {"name": "head_dim"}]
    return {"fields": [_field(n, dtype, [dict(d) for d in dims]) for n in names]}


def _state_layout(m: Model) -> tuple[str, dict]:
    if m.short_conv is not None:   # vLLM's short_conv_state_shape: conv taps (taps, channels) alone
        conv = _field("conv", "bf16", [{"name": "conv_tap"}, {"name": "channel", "role": "head"}])
        return "short_conv_state", {"fields": [conv]}
    if m.mamba1 is not None:   # vLLM's mamba1_state_shape: conv (taps, channels), SSM (channels, state)
        conv = _field("conv", "bf16", [{"name": "conv_tap"}, {"name": "channel", "role": "head"}])
        ssm = _field("ssm", "fp32", [{"name": "channel", "role": "head"}, {"name": "ssm_state"}])
        return "mamba1_state", {"fields": [conv, ssm]}
    replicated: dict = {}
    if m.mamba is not None:
        s = m.mamba
        conv = {"name": "channel", "role": "head", "sections": {"x": s.d_inner, "B": s.d_bc, "C": s.d_bc}}
        rec = _field("ssm", "fp32", [{"name": "ssm_head", "role": "head"}, {"name": "mamba_head_dim"},
                                     {"name": "ssm_state"}])
        name = "mamba2_state"
        replicated = {"replicated": ["B", "C"]} if s.one_group else {}
    else:
        d = m.deltanet
        conv = {"name": "channel", "role": "head", "sections": {"q": d.key_dim, "k": d.key_dim, "v": d.value_dim}}
        rec = _field("recurrent", "fp32", [{"name": "v_head", "role": "head"}, {"name": "k_dim"}, {"name": "v_dim"}])
        name = "gdn_state"
    conv_field = {**_field("conv", "bf16", [{"name": "conv_tap"}, conv], kind="sections"), **replicated}
    return name, {"fields": [conv_field, rec]}


def layouts(m: Model, b: Backend, opts: EngineOptions) -> dict:
    """The named layouts the spec declares."""
    out: dict = {}
    if m.family == Family.MLA:
        if opts.kv_dtype == DS_MLA:
            out[DS_MLA] = ds_mla_record(m).layout(opts.kernel_block_size or opts.block_size)
        else:
            out["mla_latent"] = {"fields": [_field("latent", opts.kv_dtype, [{"name": "token", "role": "token"},
                                                                             {"name": "latent"}])]}
        if m.index_head_dim:
            out["indexer_fp8"] = {"fields": [
                _field("k", "fp8_e4m3", [{"name": "token", "role": "token"}, {"name": "index_head_dim"}]),
                _field("scale", "fp32", [{"name": "token", "role": "token"}])]}
        return out
    order = "nhd" if b.order[0] == "token" else "hnd"
    if b.placement == KvPlacement.BLOCK:
        out[f"kv_{order}"] = _kv_fields(("k", "v"), b, opts.kv_dtype)
    else:
        out[f"k_{order}"] = _kv_fields(("k",), b, opts.kv_dtype)
        out[f"v_{order}"] = _kv_fields(("v",), b, opts.kv_dtype)
    if any(k in STATE_KINDS for k in m.kinds):
        name, layout = _state_layout(m)
        out[name] = layout
    return out


def groups(m: Model, opts: EngineOptions, names: GroupNames) -> list[dict]:
    """One group per layer kind present (plus the indexer's), full attention first unless sliding or
    chunked attention leads."""
    kernel = {"kernel_block_size": opts.kernel_block_size} if opts.kernel_block_size else {}
    present = set(m.kinds)
    out = []
    if LayerKind.SLIDING in present:
        out.append({"name": names.sliding, "kind": "sliding_window", "window": m.window, **kernel})
    if LayerKind.CHUNKED in present:
        out.append({"name": names.chunked, "kind": "chunked_local", "chunk": m.chunk, **kernel})
    if LayerKind.FULL in present:
        out.append({"name": names.full, "kind": "full_attention", **kernel})
    if m.index_head_dim:
        out.append({"name": names.indexer, "kind": "indexer"})
    if LayerKind.MAMBA in present:
        out.append({"name": names.state, "kind": "mamba"})
    if LayerKind.LINEAR in present:
        out.append({"name": names.state, "kind": "linear_attention"})
    return out


def _storage(name: str, opts: EngineOptions) -> dict:
    return {"name": name, "mem": opts.mem, "device": opts.device}


@dataclass(frozen=True)
class Layer:
    """One layer of the engine's window: index, kind, and whether it is an optional draft (MTP) layer."""

    index: int
    kind: LayerKind
    optional: bool = False


def _pool(kind: LayerKind) -> str:
    return {LayerKind.SLIDING: "swa_pool", LayerKind.CHUNKED: "chunked_pool"}.get(kind, "full_pool")


def storages(layers: list[Layer], b: Backend, opts: EngineOptions, indexer: bool) -> list[dict]:
    """Per-layer tensors (``kv.{i}`` / ``state.{i}`` / ``idx.{i}``), or per-kind pools."""
    out: list[dict] = []
    for layer in layers:
        if layer.kind in STATE_KINDS:
            out.append(_storage(f"state.{layer.index}", opts))
        elif b.placement == KvPlacement.POOL:
            pool = _storage(_pool(layer.kind), opts)
            if pool not in out:
                out.append(pool)
        else:
            out.append(_storage(f"kv.{layer.index}", opts))
            if indexer and not layer.optional:
                out.append(_storage(f"idx.{layer.index}", opts))
    return out


def _blocks(kind: LayerKind, opts: EngineOptions) -> int:
    if kind == LayerKind.SLIDING:
        return opts.sliding_blocks or opts.num_blocks
    if kind in STATE_KINDS:
        return opts.state_slots or opts.num_blocks
    return opts.num_blocks


def _region(name: str, storage: str, layout: str, blocks: int, group: str, optional: bool) -> dict:
    out = {"name": name, "storage": storage, "layout": layout, "num_blocks": blocks, "groups": [group]}
    return {**out, "optional": True} if optional else out


def regions(m: Model, layers: list[Layer], b: Backend, opts: EngineOptions, names: GroupNames,
            lays: dict) -> list[dict]:
    """The regions of every layer in the window, in layer order."""
    out: list[dict] = []
    for layer in layers:
        out.extend(_layer_regions(m, layer, b, opts, names, lays))
    return out


def _layer_regions(m: Model, layer: Layer, b: Backend, opts: EngineOptions, names: GroupNames,
                   lays: dict) -> list[dict]:
    """The regions of one layer: its state, its MLA latent (and indexer), or its K and V caches."""
    i, kind, opt = layer.index, layer.kind, layer.optional
    blocks = _blocks(kind, opts)
    group = {LayerKind.FULL: names.full, LayerKind.SLIDING: names.sliding,
             LayerKind.CHUNKED: names.chunked}.get(kind, names.state)
    if kind in STATE_KINDS:
        state_layout = next((n for n in lays if n.endswith("_state")), "")
        return [_region(f"layer.{i}", f"state.{i}", state_layout, blocks, group, opt)]
    if m.family == Family.MLA:
        return _mla_regions(m, layer, blocks, group, names, lays)
    order = "nhd" if b.order[0] == "token" else "hnd"
    if b.placement == KvPlacement.BLOCK:
        return [_region(f"layer.{i}", f"kv.{i}", f"kv_{order}", blocks, group, opt)]
    storage = _pool(kind) if b.placement == KvPlacement.POOL else f"kv.{i}"
    # K and V apart, each part of the layer's region: pairs field by field with joint-KV engines
    return [{**_region(f"layer.{i}.{f}", storage, f"{f}_{order}", blocks, group, opt), "part_of": f"layer.{i}"}
            for f in "kv"]


def _mla_regions(m: Model, layer: Layer, blocks: int, group: str, names: GroupNames,
                 lays: dict) -> list[dict]:
    """An MLA layer's latent cache, and its indexer cache where the model has one (not on optional layers)."""
    i, opt = layer.index, layer.optional
    latent = DS_MLA if DS_MLA in lays else "mla_latent"
    out = [_region(f"layer.{i}", f"kv.{i}", latent, blocks, group, opt)]
    if m.index_head_dim and not opt:
        out.append(_region(f"layer.{i}.indexer", f"idx.{i}", "indexer_fp8", blocks, names.indexer, opt))
    return out
