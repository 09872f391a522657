"""Spec derivation from plain-data engine views: views, pairing, checking a given spec, binding, the CLI."""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner

import kvlc
from kvlc.cli import main
from kvlc.compiler import compile_spec
from kvlc.engines.vllm.derive.check import SpecMismatchError
from kvlc.engines.vllm.derive.spec import check_spec, derive_plan, derive_spec, exact_plan, spec_yaml
from kvlc.engines.vllm.derive.storages import storage_tensors
from kvlc.engines.vllm.derive.view import EngineView
from kvlc.engines.vllm.derive.offline import published_view
from kvlc.engines.vllm.derive.read import layer_tensor
from kvlc.engines.vllm.derive.view import EXAMPLE, GroupKind, GroupView, ViewError
from kvlc.runtime.binding import bind
from kvlc.runtime.errors import BindingError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from memory_model import Engine, execute, verify  # noqa: E402

LLAMA = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32}


def view(backend="CPU_ATTN", block=32, tp=1, **kw):
    return published_view(LLAMA, "tiny-llama", backend=backend, block_size=block, num_blocks=kw.pop("blocks", 64),
                          tp_size=tp, **kw)


# ---------------------------------------------------------------- views
def test_view_round_trips_through_json():
    """to_dict → JSON → from_dict gives an equal view, for live-shaped and published views."""
    for v in (EngineView.from_dict(EXAMPLE), view("FLASH_ATTN", layout="split-HND"), view("CPU_ATTN", tp=2)):
        assert EngineView.from_dict(json.loads(json.dumps(v.to_dict()))) == v


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.update(blocksize=1), "unknown key 'blocksize' for EngineView; did you mean 'block_size'"),
    (lambda d: d.pop("backend"), "missing key 'backend'"),
    (lambda d: d["layers"][0].update(shape="big"), "view.layers[0].shape: expected a list"),
    (lambda d: d["layers"][1].update(data_ptr="0x10"), "view.layers[1].data_ptr: expected an integer"),
    (lambda d: d.update(kv_packing="per_tok"), "unknown KvPacking 'per_tok'; did you mean 'per_token'"),
])
def test_bad_view_data_names_the_key(mutate, message):
    """A malformed view is refused with a ViewError naming the key and a fix."""
    data = json.loads(json.dumps(EXAMPLE))
    mutate(data)
    with pytest.raises(ViewError, match=message.replace("[", r"\[").replace("]", r"\]")):
        EngineView.from_dict(data)


# ---------------------------------------------------------------- the derived spec
def test_one_allocation_is_one_storage_with_layers_at_their_offsets():
    """All layers are slabs of one allocation: one storage, region i at tensor i's byte offset."""
    v = view("CPU_ATTN", block=32, blocks=16)
    plan = derive_plan(v)
    assert [s.name for s in plan.storages] == ["kv"] and plan.storages[0].size == v.layers[0].storage_nbytes
    assert [r.name for r in plan.regions] == [f"layer.{i}" for i in range(4)]
    assert [r.offset for r in plan.regions] == [t.offset for t in v.layers]
    layer_bytes = 16 * 4 * 32 * 2 * 32 * 2
    assert [t.offset for t in v.layers] == [i * layer_bytes for i in range(4)]
    assert {(r.num_blocks, r.block_stride, r.block_bytes) for r in plan.regions} == {
        (16, layer_bytes // 16, layer_bytes // 16)}


def test_spec_yaml_is_the_spec_with_comments():
    """The YAML text loads to exactly derive_spec's mapping, compiles, and says where it came from."""
    for v, words in ((view("CPU_ATTN"), "CPU backend"), (view("FLASHINFER", layout="LBHNC"), "NOT RUN ON A GPU")):
        text = spec_yaml(v)
        assert yaml.safe_load(text) == derive_spec(v)
        assert words in text and text.startswith("# kvlc spec derived from vLLM")
        assert compile_spec(text).regions[0].name == "layer.0"


def test_groups_and_regions_named_by_kind_and_layer():
    """Sliding-window and full groups get kind names; an MLA model gets one latent field and no head dim."""
    gemma = dict(LLAMA, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=512)
    plan = derive_plan(published_view(gemma, "g", backend="FLASH_ATTN", block_size=16, num_blocks=8))
    assert [(g.name, g.kind, g.window) for g in plan.groups] == [("sliding.512", "sliding_window", 512),
                                                                ("full", "full_attention", 0)]
    assert [r.groups for r in plan.regions] == [("sliding.512",), ("full",)] * 2
    mla = {"num_hidden_layers": 2, "num_attention_heads": 16, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
           "hidden_size": 2048}
    plan = derive_plan(published_view(mla, "ds", backend="FLASHMLA", block_size=64, num_blocks=8, tp_size=8))
    f = plan.regions[0].fields[0]
    assert (plan.groups[0].name, f.name, [d.name for d in f.dims]) == ("mla", "latent", ["token", "latent"])
    assert plan.model.sizes == {"latent": 576}


@pytest.mark.parametrize("make,message", [
    (lambda: view("CPU_ATTN", layout="LBNHC"), "CPU backend supports only layout LBHNC"),
    (lambda: view("FLASH_ATTN", layout="LHBNC"), "dim 'head' has element stride"),
    (lambda: view("FLASH_ATN"), "unknown backend 'FLASH_ATN'; did you mean 'FLASH_ATTN'"),
    (lambda: view("FLASHMLA"), "is an MLA backend but the model does not use MLA"),
    (lambda: view("CPU_ATTN", tp=3), "4 KV heads cannot be split over tp_size 3"),
    (lambda: view("FLASH_ATTN", layout="blockkv-NHD"), "split-\\* is FLASH_ATTN's"),
])
def test_layouts_kvlc_cannot_derive_are_refused(make, message):
    """Layouts or options that cannot be a kvlc spec raise ViewError saying why and what to use."""
    with pytest.raises(ViewError, match=message):
        derive_spec(make())


def test_mamba_group_shared_tensors_and_inconsistent_tensors_are_refused():
    """A Mamba group whose state layers the view lacks, two layers sharing one tensor, or heads that
    disagree with the model over TP: a ViewError saying what to do."""
    v = view("CPU_ATTN")
    mamba = dataclasses.replace(v, groups=v.groups + (GroupView(GroupKind.MAMBA, 32, ("model.layers.9.mixer",),
                                                                spec_type="MambaSpec"),))
    with pytest.raises(ViewError, match="kind 'mamba' .* cannot be derived yet"):
        derive_spec(mamba)
    shared = dataclasses.replace(v, layers=(v.layers[0], dataclasses.replace(v.layers[1],
                                                                             data_ptr=v.layers[0].data_ptr)))
    with pytest.raises(ViewError, match="of one KV-cache group share one tensor"):
        derive_spec(shared)
    wrong_tp = dataclasses.replace(v, parallel=dataclasses.replace(v.parallel, tp_size=2))
    with pytest.raises(ViewError, match="model.layers.0.self_attn.attn.*4 heads, expected 2"):
        derive_spec(wrong_tp)


def hybrid_view(block=32, window=64, **kw):
    """vLLM's hybrid manager on a sliding-window model: layers 0, 1 sliding, 2, 3 full; the k-th layer of
    each group over one page pool (layer 2 over layer 0's pages, 3 over 1's), as vLLM 0.32 allocates."""
    v = view("CPU_ATTN", block=block, **kw)
    names = [t.name for t in v.layers]
    size = v.layers[1].data_ptr - v.layers[0].data_ptr
    layers = tuple(t if i < 2 else dataclasses.replace(t, data_ptr=v.layers[i - 2].data_ptr)
                   for i, t in enumerate(v.layers))
    layers = tuple(dataclasses.replace(t, storage_nbytes=2 * size) for t in layers)
    groups = (GroupView(GroupKind.SLIDING_WINDOW, block, tuple(names[:2]), window=window,
                        spec_type="SlidingWindowSpec"), GroupView(GroupKind.FULL_ATTENTION, block, tuple(names[2:])))
    return dataclasses.replace(v, layers=layers, groups=groups)


def test_hybrid_manager_page_pool_is_derived_with_aliases():
    """Layers of different groups over one tensor (vLLM's hybrid manager) become regions that alias each other,
    page for page; the plan compiles, one storage of two layers, groups sliding.64 then full."""
    spec = derive_spec(hybrid_view())
    assert [g["name"] for g in spec["groups"]] == ["sliding.64", "full"]
    assert [(r["name"], r.get("aliases"), r["offset"]) for r in spec["regions"]] == [
        ("layer.0", None, 0), ("layer.1", None, spec["regions"][1]["offset"]),
        ("layer.2", ["layer.0"], 0), ("layer.3", ["layer.1"], spec["regions"][1]["offset"])]
    assert spec["storages"][0]["size"] == 2 * spec["regions"][1]["offset"]
    plan = exact_plan(hybrid_view(cpu_isa="vec"))
    assert [r.aliases for r in plan.regions] == [(), (), ("layer.0",), ("layer.1",)]


def test_hybrid_engines_pair_across_block_sizes_and_the_window_moves_only_its_blocks():
    """Hybrid-manager plans of a 128-token-block prefill and a 32-token-block decode engine pair; for 300
    tokens the full layers move all 300, the sliding layers (window 64) only the 76 tokens of the decode
    engine's blocks the window keeps (7..9); the ids before them are vLLM's null block 0, never read."""
    prod = exact_plan(hybrid_view(block=128, cpu_isa="vec", blocks=24))
    cons = exact_plan(hybrid_view(block=32, cpu_isa="vec", blocks=24))
    assert kvlc.check_pair(cons, prod, local_rank=0, direction="READ").ok
    prog = kvlc.pair(cons, prod, local_rank=0, direction="READ")
    bound = kvlc.bind(prog, {s.name: 0 for s in cons.storages}, {0: {s.name: 1 << 40 for s in prod.storages}})
    cids = {"sliding.64": [0] * 7 + [20, 21, 22], "full": list(range(10))}
    pids = {"sliding.64": [0, 5, 6], "full": [1, 2, 3]}
    parts = kvlc.instantiate(bound, cids, pids, 300)
    token_bytes = 4 * 2 * 32 * 2   # 4 KV heads, K and V, head_dim 32, bf16
    assert sum(p.nbytes for p in parts.values()) == token_bytes * (2 * 300 + 2 * 76)


# ---------------------------------------------------------------- pairing
PAIRS = [  # (prefill view, decode view): block sizes either way, non-divisible, TP 2 <-> 1
    (dict(block=128, tp=2), dict(block=32, tp=1)),
    (dict(block=32, tp=1), dict(block=64, tp=1)),
    (dict(block=32, tp=1), dict(block=128, tp=2)),
    (dict(block=64, tp=2), dict(block=96, tp=4)),
]


def _request(cons, prod, rng, tokens):
    ids = {}
    for plan in (cons, prod):
        g = plan.groups[0]
        n = plan.blocks_for(g.name, tokens)
        ids[plan.name] = {g.name: rng.choice(plan.group_capacity(g.name), n, replace=False).tolist()}
    return ids[cons.name], ids[prod.name]


@pytest.mark.parametrize("backend", ["CPU_ATTN", "CPU_ATTN-amx", "FLASH_ATTN"])
@pytest.mark.parametrize("p,d", PAIRS, ids=[f"b{p['block']}tp{p['tp']}-b{d['block']}tp{d['tp']}" for p, d in PAIRS])
def test_prefill_and_decode_specs_pair_and_move_every_byte(backend, p, d):
    """Derived specs of engines with other block sizes and TP pair both ways; pulls by every decode rank
    and pushes by every prefill rank land every requested byte with its content code, nothing else."""
    backend, _, isa = backend.partition("-")
    derive = exact_plan if backend == "CPU_ATTN" else derive_plan  # CPU: tokens addressable in exact_plan only
    prod = derive(view(backend, blocks=24, cpu_isa=isa or "vec", **p))
    cons = derive(view(backend, blocks=24, cpu_isa=isa or "vec", **d))
    rng = np.random.default_rng(p["block"] * 7 + d["block"])
    P = Engine(prod, 1, True)
    tokens = 300  # not a multiple of any block size here
    cids, pids = _request(cons, prod, rng, tokens)
    C = Engine(cons, 2, False)
    for c in range(cons.parallel.tp_size):
        prog = kvlc.pair(cons, prod, local_rank=c, direction="READ")
        before = {k: v.copy() for k, v in C.buffers[c].items()}
        bound = kvlc.bind(prog, C.rank_bases(c), {r: P.rank_bases(r) for r in prog.peer_ranks})
        execute(kvlc.instantiate(bound, cids, pids, tokens), C, c, P, "READ")
        assert verify(C, c, P, cids, pids, tokens, before) > 0
    C2 = Engine(cons, 3, False)
    befores = {c: {k: v.copy() for k, v in C2.buffers[c].items()} for c in range(cons.parallel.tp_size)}
    for r in range(prod.parallel.tp_size):
        prog = kvlc.pair(prod, cons, local_rank=r, direction="WRITE")
        bound = kvlc.bind(prog, P.rank_bases(r), {c: C2.rank_bases(c) for c in prog.peer_ranks})
        execute(kvlc.instantiate(bound, pids, cids, tokens), P, r, C2, "WRITE")
    for c in range(cons.parallel.tp_size):
        assert verify(C2, c, P, cids, pids, tokens, befores[c]) > 0


def test_cpu_spec_pairs_across_tp_and_refuses_other_block_sizes():
    """The CPU spec (opaque K/V halves) pairs engines of one block size at any TP, and refuses other
    block sizes at pairing with the token-tiling finding; exact_plan needs an ISA whose order kvlc knows."""
    tp1, tp2 = derive_plan(view("CPU_ATTN", block=32)), derive_plan(view("CPU_ATTN", block=32, tp=2))
    for rank in (0, 1):
        assert kvlc.check_pair(tp2, tp1, local_rank=rank, direction="READ").ok
    report = kvlc.check_pair(tp1, derive_plan(view("CPU_ATTN", block=128)), local_rank=0, direction="READ")
    assert "token-tiling" in report.codes() and not report.ok
    with pytest.raises(ViewError, match="ISA 'neon' .*Arm.*has not established.*fix: "):
        exact_plan(view("CPU_ATTN", cpu_isa="neon"))


def test_different_kv_heads_or_dtype_do_not_pair():
    """Engines of different KV dtype or head count are refused at pairing, with both values."""
    a = derive_plan(view("CPU_ATTN"))
    b = derive_plan(view("CPU_ATTN", kv_dtype="fp16"))
    report = kvlc.check_pair(a, b, local_rank=0, direction="READ")
    assert not report.ok and "field-dtype" in report.codes()
    other = derive_plan(published_view(dict(LLAMA, num_key_value_heads=8), "tiny-llama", backend="CPU_ATTN",
                                       block_size=32, num_blocks=64))
    report = kvlc.check_pair(a, other, local_rank=0, direction="READ")
    assert "model-size" in report.codes() or "dim-size" in report.codes()


# ---------------------------------------------------------------- a given spec against the engine
def test_derived_spec_checks_clean_and_every_mismatch_is_listed():
    """check_spec accepts the derived plan; a wrong spec is refused with every mismatch, each naming the
    tensor, the field and both values."""
    v = view("CPU_ATTN", blocks=16)
    check_spec(derive_plan(v), v)
    spec = derive_spec(v)
    spec["regions"][1]["num_blocks"] = 8
    spec["regions"][1]["block_stride"] *= 2                      # the same slab, every other block
    spec["regions"][2]["offset"] = spec["regions"][3]["offset"]  # layer 3's slab
    spec["regions"][3]["storage"] = "kv"
    spec["layouts"]["kv_h2c"]["fields"][0]["dtype"] = "fp16"
    spec["storages"][0]["mem"] = "VRAM"
    spec["parallel"]["tp_size"] = 2
    spec["regions"] = [r for r in spec["regions"] if r["name"] != "layer.3"]
    with pytest.raises(SpecMismatchError) as err:
        check_spec(compile_spec(yaml.safe_dump(spec)), v)
    text = str(err.value)
    for want in ("parallel: tp_size: spec has 2, engine has 1",
                 "storage 'kv': mem:device: spec has VRAM:0, engine has DRAM:0",
                 "model.layers.1.self_attn.attn: layer.1.num_blocks: spec has 8, engine has 16",
                 "model.layers.2.self_attn.attn: layer.2.offset: spec has 786432, engine has 524288",
                 "model.layers.1.self_attn.attn: layer.1.block_stride: spec has 32768, engine has 16384",
                 "model.layers.0.self_attn.attn: layer.0.kv.dtype: spec has fp16, engine has bf16",
                 "model.layers.3.self_attn.attn: region: spec has nothing, engine has region 'layer.3'"):
        assert want in text, text
    assert len(err.value.mismatches) >= 8
    assert isinstance(err.value, BindingError) and isinstance(err.value, kvlc.KvlcError)


# ---------------------------------------------------------------- binding real tensors
def _cpu_engine_tensors(layers=3, blocks=8, heads=4, block=32, head_dim=32):
    """One allocation and per-layer [B, H, N, 2D] views, as vLLM's CPU worker makes them."""
    raw = torch.zeros(layers * blocks * heads * block * 2 * head_dim * 2, dtype=torch.uint8)
    logical = raw.view(torch.bfloat16).view(layers, blocks, heads, block, 2 * head_dim)
    kv = {f"model.layers.{i}.self_attn.attn": logical[i] for i in range(layers)}
    cfg = {"num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": heads, "head_dim": head_dim}
    v = published_view(cfg, "m", backend="CPU_ATTN", block_size=block, num_blocks=blocks)
    return raw, kv, dataclasses.replace(v, layers=tuple(layer_tensor(n, t) for n, t in kv.items()))


def test_storage_tensors_bind_the_whole_allocation_and_read_what_the_kernel_wrote():
    """storage_tensors gives one uint8 tensor over the allocation; bind accepts it; the plan's descriptors
    of block b of layer i hold the bytes the CPU kernel's K and V views of that block hold."""
    raw, kv, v = _cpu_engine_tensors()
    plan = derive_plan(v)
    tensors = storage_tensors(plan, v, kv)
    bound = bind(plan, tensors)
    assert bound["kv"].addr == raw.data_ptr() and bound["kv"].nbytes == raw.numel()
    gen = torch.Generator().manual_seed(5)
    for t in kv.values():
        B, H, N, C = t.shape
        k, val = t.view(B, H, 2 * N, C // 2).chunk(2, dim=2)
        k.view(torch.int16).copy_(torch.randint(-2**15, 2**15, k.shape, generator=gen, dtype=torch.int16))
        val.view(torch.int16).copy_(torch.randint(-2**15, 2**15, val.shape, generator=gen, dtype=torch.int16))
    rows = plan.local_descriptors({"kv": bound["kv"].addr})
    flat = tensors["kv"].numpy()
    for i, (name, t) in enumerate(kv.items()):
        B, H, N, C = t.shape
        k, val = t.view(B, H, 2 * N, C // 2).chunk(2, dim=2)
        for b in (0, 3, B - 1):
            addr, length, _ = rows[i * B + b].tolist()
            block = flat[addr - raw.data_ptr():addr - raw.data_ptr() + length]
            want = torch.stack([k[b], val[b]], dim=1).contiguous().view(torch.uint8).numpy().ravel()
            np.testing.assert_array_equal(block, want)


def test_storage_tensors_refuse_unknown_storages_and_foreign_tensors():
    """A plan storage the engine lacks, or kv_caches from another allocation, is a BindingError."""
    _, kv, v = _cpu_engine_tensors()
    spec = derive_spec(v)
    spec["storages"][0]["name"] = "kvv"
    for r in spec["regions"]:
        r["storage"] = "kvv"
    with pytest.raises(BindingError, match="storage 'kvv': the engine has no such allocation.*'kv'"):
        storage_tensors(compile_spec(yaml.safe_dump(spec)), v, kv)
    _, other, _ = _cpu_engine_tensors()
    with pytest.raises(BindingError, match="build the view from these kv_caches"):
        storage_tensors(derive_plan(v), v, other)


# ---------------------------------------------------------------- the command
@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(LLAMA, architectures=["LlamaForCausalLM"])))
    return tmp_path


@pytest.mark.parametrize("args", [["--block-size", "32"], ["--backend", "FLASH_ATTN", "--tp-size", "2"],
                                  ["--backend", "FLASHINFER", "--layout", "blockkv-HND", "--kv-dtype", "fp16"]])
def test_from_vllm_prints_a_spec_that_compiles(model_dir, args):
    """`kvlc from-vllm DIR ...` prints YAML equal to the derived spec of the same options."""
    res = CliRunner().invoke(main, ["from-vllm", str(model_dir), "--num-blocks", "40", *args])
    assert res.exit_code == 0, res.output
    plan = compile_spec(res.output)
    assert plan.regions[0].num_blocks == 40 and plan.model.num_layers == 4


def test_from_vllm_json_is_the_same_spec_as_the_yaml(model_dir):
    """`--json` prints the derived spec as JSON; it compiles to the plan the YAML compiles to."""
    yaml_out = CliRunner().invoke(main, ["from-vllm", str(model_dir), "--num-blocks", "40"])
    json_out = CliRunner().invoke(main, ["from-vllm", str(model_dir), "--num-blocks", "40", "--json"])
    assert yaml_out.exit_code == 0 and json_out.exit_code == 0, json_out.output
    assert json.loads(json_out.output)["kvlc"] == 1
    assert compile_spec(json_out.output).digest == compile_spec(yaml_out.output).digest


def test_from_vllm_writes_file_and_view(model_dir, tmp_path):
    """-o writes the YAML, --save-view the view JSON that rebuilds the same spec."""
    out, saved = tmp_path / "spec.yaml", tmp_path / "view.json"
    res = CliRunner().invoke(main, ["from-vllm", str(model_dir), "-o", str(out), "--save-view", str(saved)])
    assert res.exit_code == 0, res.output
    assert out.read_text() == spec_yaml(EngineView.from_dict(json.loads(saved.read_text())))


@pytest.mark.parametrize("args,message", [(["--backend", "FLASHINFR"], "did you mean 'FLASHINFER'"),
                                          (["--kv-dtype", "bf61"], "did you mean 'bf16'"),
                                          (["--layout", "NHD"], "unknown KV-cache layout 'NHD'"),
                                          (["--from-engine", "--num-blocks", "8"], "drop --num-blocks")])
def test_from_vllm_bad_options_exit_2_with_a_hint(model_dir, args, message):
    """Bad options are one clear message and exit code 2, no traceback."""
    res = CliRunner().invoke(main, ["from-vllm", str(model_dir), *args])
    assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output


def test_from_vllm_without_config_json(tmp_path):
    res = CliRunner().invoke(main, ["from-vllm", str(tmp_path)])
    assert res.exit_code == 2 and "config.json: cannot read the model config" in res.output


@pytest.mark.parametrize("name", ["kvlc.engines.vllm.derive.spec", "kvlc.engines.vllm.derive.view",
                                  "kvlc.engines.vllm.derive.layout", "kvlc.engines.vllm.derive.offline",
                                  "kvlc.engines.vllm.derive.storages"])
def test_docstring_examples(name):
    """The runnable examples in the derive modules' docstrings hold."""
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_import_needs_no_vllm():
    """import kvlc and kvlc.engines.vllm.derive.spec import neither vLLM nor torch."""
    import subprocess
    code = ("import sys, kvlc, kvlc.engines.vllm.derive.spec, kvlc.engines.vllm.derive.offline\n"
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
