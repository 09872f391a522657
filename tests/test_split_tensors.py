"""Split and joint tensors (``part_of``): a region's fields in several runs of blocks on one engine and
in one on the other pair field by field, move every destination byte right, and are refused, naming
both layouts, where the bytes cannot correspond.

The property reuses the generator of ``test_pair_properties`` (random models, TP, block and kernel
block sizes, dim orders, offsets, memory types) and then splits regions on either engine: each field
of a split region goes to one of its parts (K and V apart, or several fields together), the parts in
one new storage (vLLM's ``(2, num_blocks, ...)`` tensor) or each in its own (``key_cache`` /
``value_cache``). Every request is executed READ from every consumer rank and WRITE from every
producer rank on the content-coded memory model and checked byte for byte, against a reference map
built from content coordinates, with descriptor counts at the coalesced minimum; the same with the
generator of ``test_dcp_properties`` (decode context parallelism on either engine).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlc
from kvlc import bind, instantiate
from kvlc.cli import main
from kvlc.compiler.pairing.pair import check_pair, pair
from kvlc.compiler.plan.model import Plan
from kvlc.demo.run import cpu_plan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_model import Engine, execute, verify  # noqa: E402
from test_dcp_properties import dcp_case  # noqa: E402
from test_dcp_properties import run_case as run_dcp_case  # noqa: E402
from test_pair_properties import PROPS, pair_case, run_case  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ROOT / "layouts"


# ============================================================================ split a generated engine
@st.composite
def split_spec(draw, text: str, label: str, mode: str) -> str:
    """``text`` with regions split into parts (``part_of``): all (``split``), some (``some``) or none."""
    spec = yaml.safe_load(text)
    layouts, storages, regions = dict(spec["layouts"]), list(spec["storages"]), []
    for r in spec["regions"]:
        if mode == "joint" or (mode == "some" and not draw(st.booleans())):
            regions.append(r)
            continue
        fields = layouts[r["layout"]]["fields"]
        where = [draw(st.integers(0, len(fields) - 1)) for _ in fields]   # the part each field goes to
        one_storage = draw(st.booleans())
        parts = []
        for i, p in enumerate(sorted(set(where))):
            layout = f"{r['layout']}.{r['name']}.p{i}"
            layouts[layout] = {"fields": [{k: v for k, v in f.items() if k != "offset"}
                                          for f, w in zip(fields, where) if w == p]}
            storage = f"{label}.{r['name']}" + ("" if one_storage else f".p{i}")
            if not one_storage or i == 0:
                storages.append({"name": storage, "mem": draw(st.sampled_from(("VRAM", "DRAM"))),
                                 "device": draw(st.integers(0, 1))})
            parts.append({"name": f"{r['name']}.p{i}", "part_of": r["name"], "storage": storage,
                          "layout": layout, "num_blocks": r["num_blocks"], "groups": r["groups"]})
        regions.extend(draw(st.permutations(parts)))
    spec.update(layouts=layouts, storages=storages, regions=regions)
    return yaml.safe_dump(spec, sort_keys=False)


SIDES = (("split", "joint"), ("joint", "split"), ("split", "split"), ("some", "joint"), ("joint", "some"),
         ("some", "some"))


@settings(PROPS, max_examples=40)
@given(data=st.data())
def test_split_and_joint_engines_move_exact_bytes(data):
    """Split K/V (any fields, one or several storages) on either or both engines, any TP, block sizes and
    dim orders: READ and WRITE copy every requested byte once, nothing else, in the fewest descriptors."""
    case = data.draw(pair_case(tps=data.draw(st.sampled_from(((1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (3, 1),
                                                                 (1, 3), (2, 2)))), max_tokens=24))
    cmode, pmode = data.draw(st.sampled_from(SIDES))
    case.cons.text = data.draw(split_spec(case.cons.text, "c", cmode))
    case.prod.text = data.draw(split_spec(case.prod.text, "p", pmode))
    run_case(case)


@settings(PROPS, max_examples=15)
@given(data=st.data())
def test_split_and_joint_under_dcp(data):
    """The same under decode context parallelism (DCP on either or both engines, any interleave): a split
    engine's parts are token-sharded like its joint peer's region, every byte exact, fewest descriptors."""
    case = data.draw(dcp_case(max_tokens=40))
    cmode, pmode = data.draw(st.sampled_from(SIDES))
    case.cons.text = data.draw(split_spec(case.cons.text, "c", cmode))
    case.prod.text = data.draw(split_spec(case.prod.text, "p", pmode))
    run_dcp_case(case)


# ============================================================================ the checked-in Llama pair
def _plans(*names: str) -> list[Plan]:
    return [kvlc.compile_spec(LAYOUTS / n) for n in names]


def _descriptors(cons: Plan, prod: Plan, tokens: int, scattered: bool) -> tuple[int, int]:
    """Descriptors and bytes of one pull of ``tokens`` tokens (consumer rank 0; ids 0, 2, 4, ... or 0, 1, ...)."""
    prog = pair(cons, prod, local_rank=0, direction="READ")
    n = -(-tokens // 16)
    ids = {"full": [2 * i if scattered else i for i in range(n)]}
    bases = lambda p: {s.name: ((i + 1) << 40, 0) for i, s in enumerate(p.storages)}  # noqa: E731
    parts = instantiate(bind(prog, bases(cons), {0: bases(prod)}), ids, ids, tokens)
    return sum(len(p) for p in parts.values()), sum(p.nbytes for p in parts.values())


@pytest.mark.parametrize("producer, consumer, scattered, contiguous", [
    ("llama-3.1-8b-split.yaml", "llama-3.1-8b.yaml", 16384, 16384),
    ("llama-3.1-8b.yaml", "llama-3.1-8b-split.yaml", 16384, 16384),
    ("llama-3.1-8b-split.yaml", "llama-3.1-8b-split.yaml", 16384, 64),
    ("llama-3.1-8b.yaml", "llama-3.1-8b.yaml", 8192, 32),
])
def test_llama_descriptors_per_4096_token_request(producer, consumer, scattered, contiguous):
    """A 4,096-token Llama-3.1-8B request: split <-> joint moves one descriptor per layer, block and field
    (K of a joint block does not continue into K of the next block: the minimum), joint <-> joint one per
    layer and block (one per layer for contiguous ids); 512 MiB each way."""
    cons, prod = _plans(consumer, producer)
    assert _descriptors(cons, prod, 4096, True) == (scattered, 4096 * 32 * 2 * 8 * 128 * 2)
    assert _descriptors(cons, prod, 4096, False) == (contiguous, 4096 * 32 * 2 * 8 * 128 * 2)


@pytest.mark.parametrize("producer, consumer", [("llama-3.1-8b-split.yaml", "llama-3.1-8b.yaml"),
                                                ("llama-3.1-8b.yaml", "llama-3.1-8b-split.yaml")])
@pytest.mark.parametrize("direction", ["READ", "WRITE"])
def test_llama_split_joint_bytes_exact(producer, consumer, direction):
    """The checked-in pair (scaled down to DRAM pools) moves every byte of 40 tokens right, both ways."""
    cons, prod = (cpu_plan(LAYOUTS / n, 16 << 20) for n in (consumer, producer))   # 8 blocks a layer
    C, P = Engine(cons, 0, False), Engine(prod, 1, True)
    cids, pids = {"full": [5, 2, 7]}, {"full": [1, 6, 3]}
    before = {k: v.copy() for k, v in C.buffers[0].items()}
    if direction == "READ":
        prog = pair(cons, prod, local_rank=0, direction="READ")
        parts = instantiate(bind(prog, C.rank_bases(0), {0: P.rank_bases(0)}), cids, pids, 40)
        local, remote = C, P
    else:
        prog = pair(prod, cons, local_rank=0, direction="WRITE")
        parts = instantiate(bind(prog, P.rank_bases(0), {0: C.rank_bases(0)}), pids, cids, 40)
        local, remote = P, C
    assert execute(parts, local, 0, remote, direction) == 2 * 32 * 3   # K and V of 3 blocks of 32 layers
    assert verify(C, 0, P, cids, pids, 40, before) == 40 * 32 * 2 * 8 * 128 * 2


def test_kvlc_pair_on_the_llama_split_joint_pair():
    """`kvlc pair` prints a compatible report and the program (text, --json with both region names)."""
    split, joint = str(LAYOUTS / "llama-3.1-8b-split.yaml"), str(LAYOUTS / "llama-3.1-8b.yaml")
    out = CliRunner().invoke(main, ["pair", split, joint])
    assert out.exit_code == 0, out.output
    assert "compatible, 0 error(s)" in out.output
    doc = CliRunner().invoke(main, ["pair", joint, split, "--json"])
    assert doc.exit_code == 0, doc.output
    heads = json.loads(doc.output)["heads"]
    assert heads[0]["region"] == "layer.0.k" and heads[0]["remote_region"] == "layer.0"


def test_plan_records_part_of():
    """The plan text and JSON record part_of; a plan without it serializes without the key."""
    split, joint = _plans("llama-3.1-8b-split.yaml", "llama-3.1-8b.yaml")
    line = next(x for x in split.text().splitlines() if x.startswith("region layer.0.k "))
    assert " groups=full part_of=layer.0 | k@0:bf16(" in line
    assert Plan.from_json(split.to_json()) == split and '"part_of":"layer.0"' in split.to_json()
    assert "part_of" not in joint.to_json()


# ============================================================================ refusals name both layouts
SMALL = """
kvlc: 1
name: {name}
model: {{name: m, num_layers: 1, num_kv_heads: 2, head_dim: 4}}
block_size: {block}
groups: [{{name: full, kind: full_attention}}, {{name: swa, kind: sliding_window, window: 8}}]
storages: [{{name: a, mem: VRAM}}, {{name: b, mem: VRAM}}]
layouts:
  kv: {{fields: [{k}, {v}]}}
  kvs: {{fields: [{k}, {v}, {{name: s, dtype: fp32, dims: [{{name: head, role: head}}]}}]}}
  k: {{fields: [{k}]}}
  v: {{fields: [{v}]}}
  v8: {{fields: [{v8}]}}
  s: {{fields: [{{name: s, dtype: fp32, dims: [{{name: head, role: head}}]}}]}}
regions:
{regions}
"""
F = "{{name: {n}, dtype: {d}, dims: [{{name: token, role: token}}, {{name: head, role: head}}, {{name: head_dim}}]}}"
JOINT = "  - {name: layer.0, storage: a, layout: kv, num_blocks: 8, groups: [full]}"
SPLIT = ("  - {name: layer.0.k, part_of: layer.0, storage: a, layout: k, num_blocks: 8, groups: [full]}\n"
         "  - {name: layer.0.v, part_of: layer.0, storage: b, layout: v, num_blocks: 8, groups: [full]}")


def small(regions: str, name: str = "e", block: int = 4) -> Plan:
    return kvlc.compile_spec(SMALL.format(name=name, block=block, regions=regions, k=F.format(n="k", d="bf16"),
                                          v=F.format(n="v", d="bf16"), v8=F.format(n="v", d="fp8_e4m3")))


def findings(a: Plan, b: Plan) -> list[tuple]:
    rep = check_pair(a, b, local_rank=0, direction="READ")
    return [(f.code, f.region, f.field, f.local, f.remote) for f in rep.errors]


def test_split_pairs_with_joint_cleanly():
    """Split on one side, joint on the other (both ways): compatible, two entries named local>remote."""
    s, j = small(SPLIT), small(JOINT)
    assert findings(s, j) == [] and findings(j, s) == []
    assert [e.regions_text for e in pair(s, j, local_rank=0).entries] == ["layer.0.k>layer.0", "layer.0.v>layer.0"]


@pytest.mark.parametrize("direction", ["READ", "WRITE"])
def test_two_halves_of_one_tensor_pair_with_joint(direction):
    """vLLM FlashAttention's (2, num_blocks, ...) tensor: K blocks, then V blocks, in one storage; pairs with a
    joint block (K then V) at another block size, bytes exact."""
    halves = small(SPLIT.replace("storage: b", "storage: a"), name="halves", block=8)
    assert halves.region("layer.0.v").offset == 8 * halves.region("layer.0.k").block_bytes
    joint = small(JOINT)
    src, dst = (halves, joint) if direction == "READ" else (joint, halves)
    S, D = Engine(src, 1, True), Engine(dst, 0, False)
    sids, dids = ({"full": [3, 0]}, {"full": [6, 1, 4]}) if src is halves else ({"full": [6, 1, 4]}, {"full": [3, 0]})
    before = {k: v.copy() for k, v in D.buffers[0].items()}
    local, remote, lids, rids = (D, S, dids, sids) if direction == "READ" else (S, D, sids, dids)
    prog = pair(local.plan, remote.plan, local_rank=0, direction=direction)
    parts = instantiate(bind(prog, local.rank_bases(0), {0: remote.rank_bases(0)}), lids, rids, 11)
    execute(parts, local, 0, remote, direction)
    assert verify(D, 0, S, dids, sids, 11, before) == 11 * 2 * 2 * 4 * 2


def test_field_missing_names_both_layouts():
    """A field held on one engine only: field-set, with both engines' regions and fields."""
    s, j = small(SPLIT), small(JOINT.replace("layout: kv", "layout: kvs"))
    assert findings(s, j) == [("field-set", "layer.0", "", "layer.0.k[k] + layer.0.v[v]", "k,v,s")]
    s1 = small(SPLIT.splitlines()[0])
    assert findings(j, s1) == [("field-set", "layer.0", "", "k,v,s", "layer.0.k[k]")]


def test_part_dtype_differs_is_located_at_the_part():
    """A field of a part that does not match: the finding names the local part and the field."""
    s, j = small(SPLIT.replace("layout: v,", "layout: v8,")), small(JOINT)
    assert findings(s, j) == [("field-dtype", "layer.0.v", "v", "fp8_e4m3", "bf16")]


def test_part_groups_differ_from_joint_region():
    """Parts serving another group than the joint region link the groups (tests/test_group_links.py): a
    consumer's sliding window takes its tokens from the joint region's full group, per part; the joint
    region's full cache cannot come from the parts' window (group-kind at the first region, both layouts)."""
    s, j = small(SPLIT.replace("[full]", "[swa]")), small(JOINT)
    assert findings(s, j) == []
    assert [(e.regions_text, e.link) for e in pair(s, j, local_rank=0).entries] == [
        ("layer.0.k>layer.0", "swa>full"), ("layer.0.v>layer.0", "swa>full")]
    assert [f[:2] + f[3:] for f in findings(j, s)] == [
        ("group-kind", "layer.0", "e group 'full' full_attention", "e group 'swa' sliding_window window=8")]


def test_split_region_missing_on_the_peer():
    """A split region whose name the peer does not hold at all: region-missing, per part, saying so."""
    s, other = small(SPLIT), small(JOINT.replace("layer.0", "attn.0"))
    rep = check_pair(s, other, local_rank=0, direction="READ")
    assert ("region-missing", "layer.0.k") in [(f.code, f.region) for f in rep.errors]
    assert "part of 'layer.0'" in rep.render()


def test_split_joint_across_block_sizes_and_per_block_field():
    """Split vs joint at 8- and 4-token blocks pairs; a per-block field (no token dim) in a part is refused
    there (token-tiling, at the part), and pairs at equal block sizes."""
    assert findings(small(SPLIT, block=8), small(JOINT)) == []
    scale = "\n  - {name: layer.0.s, part_of: layer.0, storage: b, layout: s, num_blocks: 8, groups: [full]}"
    s8, s4, j = small(SPLIT + scale, block=8), small(SPLIT + scale), small(JOINT.replace("layout: kv", "layout: kvs"))
    assert findings(s4, j) == []
    assert findings(s8, j) == [("token-tiling", "layer.0.s", "s", "8 tokens/block", "4 tokens/block")]


def test_pairs_register_the_split_case():
    """layouts/pairs/pairs.yaml names the split <-> joint Llama pair both ways (golden programs exist)."""
    pairs = {p["name"]: p for p in yaml.safe_load((LAYOUTS / "pairs" / "pairs.yaml").read_text())["pairs"]}
    assert pairs["llama8b-split-to-joint"]["producer"] == "llama-3.1-8b-split.yaml"
    assert pairs["llama8b-joint-to-split"]["consumer"] == "llama-3.1-8b-split.yaml"
    assert np.all([(ROOT / "tests" / "golden" / "programs" / f"llama8b-{n}.{m}.txt").exists()
                   for n in ("split-to-joint", "joint-to-split") for m in ("pull", "push")])
