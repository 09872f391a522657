"""Per-token records (fields with explicit byte strides) on the content-coded memory model.

Random records — fields of different dtypes interleaved inside one per-token record, in a
random order with padding — pair with an engine that stores the same content as separate
row-major arrays, or as a record of another order, at another block size and TP. READ and
WRITE copy each requested byte exactly once (content codes checked on every destination
byte, nothing else written) in exactly the independent minimum of descriptors, and the
compiled geometry is the record's (offsets and strides as declared).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import event, given, settings
from hypothesis import strategies as st

import kvlc
from kvlc.errors import SpecError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_pair_properties import PROPS, Case, Model, Side, run_case  # noqa: E402

ITEM = {"fp8_e4m3": 1, "bf16": 2, "fp32": 4}


def record_fields(draw, names: list[str], dtypes: dict, counts: dict) -> tuple[list[dict], int, dict]:
    """A record of the fields in a random order with random aligned gaps: (fields, record bytes, geometry)."""
    order = draw(st.permutations(names))
    at, out, geo = 0, [], {}
    for n in order:
        item = ITEM[dtypes[n]]
        at += draw(st.integers(0, 2)) * item
        at = -(-at // item) * item
        out.append((n, at))
        at += counts[n] * item
    size = -(-at // 4) * 4 + 4 * draw(st.integers(0, 2))
    fields = []
    for n, off in sorted(out, key=lambda x: names.index(x[0])):   # spec order = the model's order
        item = ITEM[dtypes[n]]
        fields.append({"name": n, "dtype": dtypes[n], "offset": off,
                       "dims": [{"name": "token", "role": "token", "stride": size},
                                {"name": n, "stride": item}]})
        geo[n] = (off, size, item)
    return fields, size, geo


def split_fields(names: list[str], dtypes: dict) -> list[dict]:
    return [{"name": n, "dtype": dtypes[n], "dims": [{"name": "token", "role": "token"}, {"name": n}]}
            for n in names]


def spec_text(name: str, tp: int, block: int, blocks: int, counts: dict, fields: list[dict],
              size: int | None) -> str:
    layout = {"fields": fields} | ({"size": size * block} if size else {})
    return yaml.safe_dump({
        "kvlc": 1, "name": name, "model": {"name": "m", "num_layers": 1, "sizes": counts},
        "parallel": {"tp_size": tp}, "block_size": block,
        "groups": [{"name": "full", "kind": "full_attention"}],
        "storages": [{"name": "kv", "mem": "VRAM"}], "layouts": {"rec": layout},
        "regions": [{"name": "layer.0", "storage": "kv", "layout": "rec", "num_blocks": blocks,
                     "groups": ["full"]}]}, sort_keys=False)


@st.composite
def record_case(draw) -> tuple[Case, dict]:
    k = draw(st.integers(1, 4))
    names = [f"f{i}" for i in range(k)]
    dtypes = {n: draw(st.sampled_from(sorted(ITEM))) for n in names}
    counts = {n: draw(st.integers(1, 6)) for n in names}
    tokens = draw(st.integers(1, 24))
    sides, geos = [], []
    for label in ("c", "p"):
        tp, block = draw(st.sampled_from((1, 2, 3))), draw(st.sampled_from((1, 2, 4, 8)))
        kind = draw(st.sampled_from(("record", "split"))) if label == "p" else "record"
        if kind == "record":
            fields, size, geo = record_fields(draw, names, dtypes, counts)
        else:
            fields, size, geo = split_fields(names, dtypes), None, None
        need = -(-tokens // block)
        blocks = need + draw(st.integers(0, 3))
        side = Side(tp, {"full": (block, block)}, spec_text(f"rec-{label}", tp, block, blocks, counts, fields, size))
        side.capacity = {"layer.0": blocks}
        sides.append(side)
        geos.append(geo)
    ids = []
    for s in sides:
        cap, need = s.capacity["layer.0"], -(-tokens // s.blocks["full"][0])
        ids.append({"full": sorted(draw(st.permutations(range(cap)))[:need])})
    model = Model(heads=1, head_dim=1, groups=(("full", "full_attention"),), layouts=(), regions=(), swa="none")
    case = Case(model, sides[0], sides[1], {"full": tokens}, ids[0], ids[1], "ascending", tokens)
    return case, {"cons": geos[0], "prod": geos[1]}


def _check_record_geometry(text: str, geo: dict | None) -> None:
    region = kvlc.compile_spec(text).regions[0]
    if geo is None:
        return
    for f in region.fields:
        off, size, item = geo[f.name]
        assert (f.offset, f.dims[0].stride, f.dims[1].stride) == (off, size, item)


@settings(PROPS, max_examples=60)
@given(record_case())
def test_records_pair_with_arrays_and_other_records(arg):
    """Record ↔ arrays and record ↔ record: exact bytes, nothing else written, minimum descriptors."""
    case, geos = arg
    _check_record_geometry(case.cons.text, geos["cons"])
    _check_record_geometry(case.prod.text, geos["prod"])
    stats = run_case(case)
    assert stats["bytes"] > 0


@settings(PROPS, max_examples=60)
@given(st.data())
def test_exact_overlap_check_agrees_with_a_byte_map(data):
    """The compiler calls a strided layout overlapping exactly when two elements share a byte."""
    k = data.draw(st.integers(1, 3))
    fields, owners = [], []
    tokens = 4
    for i in range(k):
        dt = data.draw(st.sampled_from(sorted(ITEM)))
        item = ITEM[dt]
        n = data.draw(st.integers(1, 4))
        off = data.draw(st.integers(0, 12)) * item
        ts = data.draw(st.integers(1, 8)) * 4
        es = data.draw(st.integers(1, 3)) * item
        fields.append({"name": f"f{i}", "dtype": dt, "offset": off,
                       "dims": [{"name": "token", "role": "token", "stride": ts}, {"name": f"f{i}", "stride": es}]})
        starts = off + (np.arange(tokens)[:, None] * ts + np.arange(n)[None, :] * es).ravel()
        owners.append((starts[:, None] + np.arange(item)).ravel())
    allbytes = np.concatenate(owners)
    clash = len(np.unique(allbytes)) != len(allbytes)
    event("overlapping" if clash else "disjoint")
    size = int(allbytes.max()) + 1
    counts = {f["name"]: len(owners[i]) // (tokens * ITEM[f["dtype"]]) for i, f in enumerate(fields)}
    text = spec_text("ov", 1, tokens, 1, counts, fields, None).replace("layouts:\n  rec:\n",
                                                                         f"layouts:\n  rec:\n    size: {size}\n")
    if clash:
        with pytest.raises(SpecError) as info:
            kvlc.compile_spec(text)
        assert "overlaps" in info.value.render()
    else:
        kvlc.compile_spec(text)


def test_checked_in_record_layout_is_vllms_656_byte_row():
    """fp8_ds_mla: 512 fp8 NoPE at 0, 4 fp32 scales at 512, 64 bf16 RoPE at 528, 656 bytes a token."""
    root = Path(__file__).resolve().parents[1] / "layouts"
    r = kvlc.compile_spec(root / "deepseek-v3.2-fp8-ds-mla-tp8.yaml").regions[0]
    got = [(f.name, f.dtype, f.offset, str(f.layout)) for f in r.fields]
    assert got == [("nope", "fp8_e4m3", 0, "(64,512):(656,1)"), ("scale", "fp32", 512, "(64,4):(656,4)"),
                   ("rope", "bf16", 528, "(64,64):(656,2)")]
    assert r.block_bytes == 64 * 656 == sum(f.nbytes for f in r.fields)


def cpu_kv_spec(name: str, tp: int, block: int, heads: int, dim: int, cpu: bool, blocks: int = 6) -> str:
    """vLLM's CPU cache: per block [heads][block_size][2 * head_dim] bf16, K of a head stored
    [head_dim][token] in the first half of the head's slab, V [token][head_dim] in the second."""
    item, local = 2, heads // tp
    slab = block * 2 * dim * item                      # one head's bytes in a block
    if cpu:
        k_dims = [{"name": "token", "role": "token", "stride": item},
                  {"name": "head", "role": "head", "stride": slab},
                  {"name": "head_dim", "stride": block * item}]
        v_dims = [{"name": "token", "role": "token", "stride": dim * item},
                  {"name": "head", "role": "head", "stride": slab},
                  {"name": "head_dim", "stride": item}]
        fields = [{"name": "k", "dtype": "bf16", "offset": 0, "dims": k_dims},
                  {"name": "v", "dtype": "bf16", "offset": block * dim * item, "dims": v_dims}]
        layout = {"size": local * slab, "fields": fields}
    else:
        dims = [{"name": "token", "role": "token"}, {"name": "head", "role": "head"}, {"name": "head_dim"}]
        layout = {"fields": [{"name": "k", "dtype": "bf16", "dims": dims}, {"name": "v", "dtype": "bf16", "dims": dims}]}
    return yaml.safe_dump({
        "kvlc": 1, "name": name, "model": {"name": "m", "num_layers": 1, "num_kv_heads": heads, "head_dim": dim},
        "parallel": {"tp_size": tp}, "block_size": block, "groups": [{"name": "full", "kind": "full_attention"}],
        "storages": [{"name": "kv", "mem": "DRAM"}], "layouts": {"kv": layout},
        "regions": [{"name": "layer.0", "storage": "kv", "layout": "kv", "num_blocks": blocks, "groups": ["full"]}]},
        sort_keys=False)


@pytest.mark.parametrize("cpu_side,tps,blocks", [("cons", (1, 2), (4, 8)), ("prod", (2, 1), (8, 4)),
                                                 ("cons", (2, 2), (16, 4))])
def test_vllm_cpu_transposed_k_pairs_with_nhd(cpu_side, tps, blocks):
    """Strides express vLLM's CPU cache (K [head_dim][token], V [token][head_dim] per head): it pairs
    with a plain NHD engine across TP and block sizes, every byte exact, in the minimum of descriptors."""
    heads, dim, tokens = 4, 4, 13
    texts = {}
    for side, tp, block in (("cons", tps[0], blocks[0]), ("prod", tps[1], blocks[1])):
        texts[side] = cpu_kv_spec(f"cpu-{side}", tp, block, heads, dim, cpu=(side == cpu_side))
    sides = [Side(tps[0], {"full": (blocks[0], blocks[0])}, texts["cons"]),
             Side(tps[1], {"full": (blocks[1], blocks[1])}, texts["prod"])]
    ids = [{"full": list(range(-(-tokens // b)))[::-1]} for b in blocks]   # descending ids
    model = Model(heads=heads, head_dim=dim, groups=(("full", "full_attention"),), layouts=(), regions=(), swa="none")
    k = kvlc.compile_spec(texts[cpu_side]).regions[0].field("k")
    assert [d.stride for d in k.dims] == [2, 2 * blocks[0 if cpu_side == "cons" else 1] * dim * 2,
                                          blocks[0 if cpu_side == "cons" else 1] * 2]
    stats = run_case(Case(model, sides[0], sides[1], {"full": tokens}, ids[0], ids[1], "arbitrary", tokens))
    assert stats["bytes"] > 0
