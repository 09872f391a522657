"""Hypothesis properties of the compiler over random valid specs.

The strategy draws whole specs — model sizes, TP sizes that divide the heads or are
multiples of them, block and kernel block sizes, groups (full, sliding window with its own
block size, a Mamba group with a sections field and an SSM state), several DRAM/VRAM
storages, fields with random dtypes and random dim orders, auto or explicit field offsets,
repeated and single regions with auto or explicit (non-overlapping, sometimes interleaved)
offsets and strides — and writes them as YAML text, so every property runs the whole
pipeline. The generator places things with its own small arithmetic; the properties then
check the plan by enumerating bytes, not by trusting the compiler's arithmetic.
"""

from __future__ import annotations

import math

from collections import defaultdict
from math import prod

import numpy as np
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvlc
from kvlc.compiler.plan.model import Plan

DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1, "uint8": 1}
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _shard(size: int, tp: int) -> int:
    """Per-rank size of a head dim: size/tp, or one replica when tp is a multiple of size."""
    return size // tp if size % tp == 0 else 1


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


@st.composite
def _field_offsets(draw, extents: list[int]) -> tuple[list[int | None], int]:
    """Auto or explicit (gapped, never overlapping) offsets for fields of these byte extents."""
    offsets, cursor = [], 0
    for extent in extents:
        if draw(st.booleans()):
            offsets.append(None)
            start = cursor
        else:
            start = _align(cursor, 4) + 4 * draw(st.integers(0, 6))  # explicit offsets: dtype-aligned
            offsets.append(start)
        cursor = start + extent
    return offsets, cursor


@st.composite
def _attention_layout(draw, m: dict, tokens: int) -> tuple[dict, int]:
    """Fields over token/head/head_dim/other dims in random orders; returns (layout, block bytes)."""
    fields, extents = [], []
    for fi in range(draw(st.integers(1, 3))):
        dims = [{"name": "token", "role": "token"}]
        replicated = draw(st.booleans()) and fi > 0  # an MLA-latent-like field: no head dim
        if not replicated:
            head = {"name": "head", "role": "head"}
            if draw(st.booleans()):
                head["size"] = m["heads"]
            dims.append(head)
        dims.append({"name": "head_dim"} if draw(st.booleans()) else {"name": "head_dim", "size": m["head_dim"]})
        other = draw(st.sampled_from([None, "kv", "rope", "rope_by_name"]))
        size = 1
        if other == "kv":
            size = draw(st.integers(1, 2))
            dims.append({"name": "kv", "size": size})
        elif other == "rope":
            size = m["rope"]
            dims.append({"name": "rope"})  # size from model.sizes
        elif other == "rope_by_name":
            size = m["rope"]
            dims.append({"name": "pe", "size": "rope"})
        dims = draw(st.permutations(dims))
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        heads = 1 if replicated else _shard(m["heads"], m["tp"])
        extents.append(DTYPES[dtype] * tokens * heads * m["head_dim"] * size)
        fields.append({"name": f"f{fi}", "dtype": dtype, "dims": list(dims)})
    return _finish_layout(draw, fields, extents)


@st.composite
def _mamba_layout(draw, m: dict) -> tuple[dict, int]:
    """Mamba state: a sections field (x|B|C, each TP-sharded) and an SSM state, no token dim."""
    tp = m["tp"]
    sections = {s: tp * draw(st.integers(1, 3)) for s in ("x", "B", "C")}
    width = draw(st.integers(1, 4))
    conv_dims = draw(st.permutations([{"name": "conv_dim", "role": "head", "sections": sections},
                                      {"name": "width", "size": width}]))
    conv_dtype = draw(st.sampled_from(sorted(DTYPES)))
    ssm_heads = draw(st.sampled_from(sorted({tp, 2 * tp} | set(_divisors(tp)))))
    state = draw(st.integers(1, 4))
    ssm_dims = draw(st.permutations([{"name": "ssm_head", "role": "head", "size": ssm_heads},
                                     {"name": "head_dim"}, {"name": "state", "size": state}]))
    ssm_dtype = draw(st.sampled_from(sorted(DTYPES)))
    fields = [{"name": "conv", "kind": "sections", "dtype": conv_dtype, "dims": list(conv_dims)},
              {"name": "ssm", "dtype": ssm_dtype, "dims": list(ssm_dims)}]
    extents = [DTYPES[conv_dtype] * sum(sections.values()) // tp * width,
               DTYPES[ssm_dtype] * _shard(ssm_heads, tp) * m["head_dim"] * state]
    if draw(st.booleans()):
        fields.reverse()
        extents.reverse()
    return _finish_layout(draw, fields, extents)


def _finish_layout(draw, fields: list, extents: list) -> tuple[dict, int]:
    offsets, end = draw(_field_offsets(extents))
    for f, off in zip(fields, offsets):
        if off is not None:
            f["offset"] = off
    layout: dict = {"fields": fields}
    if draw(st.booleans()):
        end += draw(st.integers(0, 40))
        layout["size"] = end
    return layout, end


@st.composite
def specs(draw) -> dict:
    """A random valid ``kvlc: 1`` spec as plain data."""
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    tp = draw(st.sampled_from([t for t in range(1, 13) if heads % t == 0 or t % heads == 0]))
    m = {"heads": heads, "tp": tp, "head_dim": draw(st.sampled_from([1, 2, 4, 8])),
         "rope": draw(st.integers(1, 3))}
    num_layers = draw(st.integers(1, 3))
    block = draw(st.sampled_from([1, 2, 4, 8, 16]))
    kernel = draw(st.sampled_from([None, *_divisors(block)]))
    spec: dict = {
        "kvlc": 1, "name": "random",
        "model": {"name": "random-model", "num_layers": num_layers, "num_kv_heads": heads,
                  "head_dim": m["head_dim"], "sizes": {"rope": m["rope"]}},
        "parallel": {"tp_size": tp},
        "block_size": block,
    }
    if kernel is not None:
        spec["kernel_block_size"] = kernel
    if num_layers > 1 and draw(st.booleans()):
        start = draw(st.integers(0, num_layers - 1))
        spec["parallel"]["layers"] = [start, draw(st.integers(start + 1, num_layers))]
    layer_range = spec["parallel"].get("layers", [0, num_layers])

    groups = [{"name": "full", "kind": "full_attention"}]
    tokens = {"full": kernel or block}
    shareable = []
    if draw(st.booleans()):
        swa = {"name": "swa", "kind": "sliding_window", "window": draw(st.integers(1, 64))}
        if draw(st.booleans()):
            own = draw(st.sampled_from([1, 2, 4, 8, 16, 32]))
            swa.update(block_size=own, kernel_block_size=draw(st.sampled_from(_divisors(own))))
            tokens["swa"] = swa["kernel_block_size"]
        else:
            tokens["swa"] = tokens["full"]
            shareable = [["full", "swa"]]
        groups.append(swa)
    if draw(st.booleans()):
        groups.append({"name": "ssm", "kind": "mamba"})
    spec["groups"] = groups
    ratio = {g["name"]: (g.get("block_size", block) // g.get("kernel_block_size", g.get("block_size", kernel or block))
                         if g["kind"] != "mamba" else 1) for g in groups}

    layouts, block_bytes, layout_group = {}, {}, {}
    for g in groups:
        for li in range(draw(st.integers(1, 2))):
            if g["kind"] == "mamba":
                layout, nbytes = draw(_mamba_layout(m))
            else:
                layout, nbytes = draw(_attention_layout(m, tokens[g["name"]]))
            name = f"{g['name']}_{li}"
            layouts[name], block_bytes[name], layout_group[name] = layout, nbytes, g["name"]
    spec["layouts"] = layouts

    storages = [{"name": f"s{i}", "mem": draw(st.sampled_from(["DRAM", "VRAM"])),
                 "device": draw(st.integers(0, 1)), "align": draw(st.sampled_from([1, 1, 64, 256]))}
                for i in range(draw(st.integers(1, 3)))]
    align = {s["name"]: s["align"] for s in storages}
    storage_entries: list = list(storages)
    if draw(st.booleans()):
        storage_entries.append({"repeat": {"var": "layer", "range": "layers"},
                                "storages": [{"name": "per_layer.{layer}", "mem": "VRAM"}]})
        align["per_layer"] = 1
    spec["storages"] = storage_entries

    cursor: dict[str, int] = defaultdict(int)  # end of the last byte used, per concrete storage

    def place(storage: str, offset, n: int, stride: int, nbytes: int) -> None:
        base = storage.split(".")[0]
        start = _align(cursor[storage], align[base]) if offset == "auto" else offset
        cursor[storage] = max(cursor[storage], start + (n - 1) * stride + nbytes)

    def region(name: str, storage: str, layout: str) -> dict:
        r = {"name": name, "storage": storage, "layout": layout,
             "num_blocks": ratio[layout_group[layout]] * draw(st.integers(1, 5)),  # whole logical blocks
             "groups": draw(st.sampled_from([[layout_group[layout]]]
                                            + [s for s in shareable if layout_group[layout] in s]))}
        if draw(st.booleans()):
            r["block_stride"] = block_bytes[layout] + draw(st.integers(0, 32))
        if draw(st.integers(0, 5)) == 0:
            r["optional"] = True
        return r

    entries: list = []
    for ri in range(draw(st.integers(1, 4))):
        layout = draw(st.sampled_from(sorted(layouts)))
        shape = draw(st.sampled_from(["repeat", "single", "interleaved"]))
        if shape == "repeat":
            per_layer = "per_layer" in align and draw(st.booleans())
            storage = "per_layer.{layer}" if per_layer else draw(st.sampled_from(sorted(s["name"] for s in storages)))
            r = region(f"r{ri}.{{layer}}", storage, layout)
            entries.append({"repeat": {"var": "layer", "range": "layers"}, "regions": [r]})
            for layer in range(*layer_range):
                place(storage.format(layer=layer), "auto", r["num_blocks"],
                      r.get("block_stride", block_bytes[layout]), block_bytes[layout])
        elif shape == "single":
            storage = draw(st.sampled_from(sorted(s["name"] for s in storages)))
            r = region(f"r{ri}", storage, layout)
            if draw(st.booleans()):
                r["offset"] = _align(cursor[storage] + draw(st.integers(0, 100)), math.lcm(align[storage], 4))
            place(storage, r.get("offset", "auto"), r["num_blocks"],
                  r.get("block_stride", block_bytes[layout]), block_bytes[layout])
            entries.append(r)
        else:  # two regions whose blocks alternate in one stride (K blocks, V blocks)
            storage = draw(st.sampled_from(sorted(s["name"] for s in storages)))
            other = draw(st.sampled_from(sorted(layouts)))
            a, b = region(f"r{ri}.a", storage, layout), region(f"r{ri}.b", storage, other)
            spare = draw(st.integers(0, 16))
            step = math.lcm(align[storage], 4)  # explicit offsets: aligned to the storage and dtypes
            a["offset"] = _align(cursor[storage] + draw(st.integers(0, 64)), step)
            b["offset"] = _align(a["offset"] + block_bytes[layout] + draw(st.integers(0, spare)), step)
            stride = _align(b["offset"] - a["offset"] + block_bytes[other] + spare, step)
            a["block_stride"] = b["block_stride"] = stride
            for r, lay in ((a, layout), (b, other)):
                place(storage, r["offset"], r["num_blocks"], stride, block_bytes[lay])
            entries.extend([a, b])
    spec["regions"] = entries
    return spec


def compile_text(spec: dict) -> Plan:
    return kvlc.compile_spec(yaml.safe_dump(spec, sort_keys=False))


def element_bytes(field) -> np.ndarray:
    """Every byte offset (in its block) that a field's elements occupy, one entry per byte."""
    addr = np.array([field.offset], dtype=np.int64)
    for d in field.dims:
        addr = (addr[:, None] + np.arange(d.size, dtype=np.int64)[None, :] * d.stride).ravel()
    return (addr[:, None] + np.arange(field.itemsize, dtype=np.int64)[None, :]).ravel()


# ---------------------------------------------------------------- properties
@FAST
@given(specs())
def test_compiles_deterministically(spec):
    """A random valid spec compiles; twice gives byte-identical JSON and digest, from text or model."""
    text = yaml.safe_dump(spec, sort_keys=False)
    a, b = kvlc.compile_spec(text), kvlc.compile_spec(text)
    c = kvlc.compile_spec(kvlc.load_spec(text))
    assert a.to_json() == b.to_json() == c.to_json()
    assert a.digest == b.digest == c.digest
    assert len(a.regions) >= 1


@FAST
@given(specs())
def test_json_round_trip(spec):
    """Plan.from_json(plan.to_json()) equals the plan, re-serializes identically and keeps its digest."""
    plan = compile_text(spec)
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.to_json() == plan.to_json() and again.digest == plan.digest
    assert again.text() == plan.text()


@FAST
@given(specs())
def test_regions_of_a_storage_share_no_byte(spec):
    """Counting every byte of every block: no byte of a storage belongs to two blocks, all lie inside it."""
    plan = compile_text(spec)
    for s in plan.storages:
        cover = np.zeros(s.size + 1, dtype=np.int64)
        for r in plan.regions:
            if r.storage != s.name:
                continue
            starts = r.offset + np.arange(r.num_blocks, dtype=np.int64) * r.block_stride
            assert starts.min() >= 0 and starts.max() + r.block_bytes <= s.size
            np.add.at(cover, starts, 1)
            np.add.at(cover, starts + r.block_bytes, -1)
        assert np.cumsum(cover).max(initial=0) <= 1, f"storage {s.name}: a byte is in two blocks"


@FAST
@given(specs())
def test_fields_lie_inside_their_block_and_apart(spec):
    """Every element byte of every field is inside the block, and no byte belongs to two elements."""
    plan = compile_text(spec)
    for r in plan.regions:
        assert r.block_bytes <= r.block_stride
        owner = np.zeros(r.block_bytes, dtype=np.int64)
        for f in r.fields:
            b = element_bytes(f)
            assert b.min() >= 0 and b.max() < r.block_bytes, f"{r.name}.{f.name} leaves its block"
            assert len(b) == f.nbytes
            owner += np.bincount(b, minlength=r.block_bytes)
            if "." not in f.name:  # a plain array is dense: row-major over its own dims
                assert f.extent == f.nbytes
        assert owner.max(initial=0) <= 1, f"{r.name}: fields share a byte"
        if r.is_state:
            assert all(f.dim("token") is None for f in r.fields)
        else:
            assert all(f.dim("token") is None or f.dim("token").size == r.block_tokens for f in r.fields)


@FAST
@given(specs())
def test_head_dims_are_sharded_by_tp(spec):
    """A head dim holds global/tp heads per rank, or one replica when tp is a multiple of it."""
    plan = compile_text(spec)
    tp = plan.parallel.tp_size
    for r in plan.regions:
        for f in r.fields:
            h = f.dim("head")
            if h is not None:
                assert h.size == _shard(h.global_size, tp)


@FAST
@given(specs(), st.data())
def test_local_descriptors_follow_the_geometry(spec, data):
    """Row i of a region is (base + offset + i*stride, block_bytes, device), regions in plan order."""
    plan = compile_text(spec)
    bases = {s.name: data.draw(st.integers(0, 2**40)) * 4096 for s in plan.storages}
    desc = plan.local_descriptors(bases)
    assert desc.dtype == np.uint64 and desc.shape == (sum(r.num_blocks for r in plan.regions), 3)
    row = 0
    for r in plan.regions:
        for i in range(r.num_blocks):
            assert tuple(int(x) for x in desc[row]) == (
                bases[r.storage] + r.offset + i * r.block_stride, r.block_bytes, r.device)
            row += 1


@FAST
@given(specs())
def test_declared_storage_sizes(spec):
    """Declaring each storage's compiled size changes nothing; one byte short of the last block is refused.

    A derived size covers every block at its full stride (a tensor of num_blocks x stride);
    the bound that is checked is the last byte of the last block.
    """
    plan = compile_text(spec)
    sizes = {s.name: s.size for s in plan.storages}
    ends: dict = {}
    for r in plan.regions:
        ends[r.storage] = max(ends.get(r.storage, 0), r.end)
        assert sizes[r.storage] >= r.offset + r.num_blocks * r.block_stride
    sized = dict(spec, storages=[dict(e, size=sizes[e["name"]]) if "name" in e else e
                                 for e in spec["storages"]])
    assert compile_text(sized) == plan
    tight = next((e for e in spec["storages"] if ends.get(e.get("name"), 0) > 1), None)
    if tight is not None:
        short = dict(spec, storages=[dict(e, size=ends[e["name"]] - 1) if e is tight else e
                                     for e in spec["storages"]])
        try:
            compile_text(short)
        except kvlc.CompileError as exc:
            assert any(f"ends past storage '{tight['name']}'" in p.what for p in exc.problems)
        else:
            raise AssertionError("a storage one byte short compiled")


# ---------------------------------------------------------------- the overlap check is exact
TWO_REGIONS = {
    "kvlc": 1, "name": "two", "block_size": 4,
    "model": {"name": "m", "num_layers": 1, "head_dim": 2},
    "groups": [{"name": "full", "kind": "full_attention"}],
    "storages": [{"name": "s", "mem": "DRAM"}],
}


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 24), st.integers(0, 200), st.integers(1, 6), st.integers(0, 24)),
                min_size=2, max_size=3),
       st.booleans())
def test_overlap_check_is_exact(regions, same_stride):
    """Regions placed anywhere compile only if their blocks are byte-disjoint, and always do when they
    are disjoint and either share one stride or have disjoint spans."""
    stride0 = regions[0][0] + regions[0][3]
    spec = dict(TWO_REGIONS, layouts={}, regions=[])
    placed = []
    for i, (nbytes, offset, n, spare) in enumerate(regions):
        stride = stride0 if same_stride and nbytes <= stride0 else nbytes + spare
        spec["layouts"][f"l{i}"] = {"fields": [{"name": "x", "dtype": "uint8", "dims": [
            {"name": "token", "role": "token"}, {"name": "b", "size": 1}]}], "size": max(nbytes, 4)}
        nbytes = max(nbytes, 4)
        stride = max(stride, nbytes)
        spec["regions"].append({"name": f"r{i}", "storage": "s", "layout": f"l{i}", "num_blocks": n,
                                "groups": ["full"], "offset": offset, "block_stride": stride})
        placed.append((offset, n, stride, nbytes))
    end = max(o + (n - 1) * s + b for o, n, s, b in placed)
    cover = np.zeros(end + 1, dtype=np.int64)
    for o, n, s, b in placed:
        starts = o + np.arange(n) * s
        np.add.at(cover, starts, 1)
        np.add.at(cover, starts + b, -1)
    disjoint = np.cumsum(cover).max() <= 1
    try:
        compile_text(spec)
        ok = True
    except kvlc.CompileError as exc:
        assert all("overlaps region" in p.what for p in exc.problems)
        ok = False
    if ok:
        assert disjoint, "the compiler accepted regions that share a byte"
    spans = sorted((o, o + (n - 1) * s + b, s) for o, n, s, b in placed)
    pairwise_exact = all(a[2] == b[2] or a[1] <= b[0]
                         for i, a in enumerate(spans) for b in spans[i + 1:])
    if disjoint and pairwise_exact:
        assert ok, "the compiler refused byte-disjoint regions"
