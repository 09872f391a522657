"""``kvlc init``: the spec of a config.json on an engine; checked-in layouts are reproduced digest for digest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import kvlc
from kvlc.cli import main as cli
from kvlc.compiler import compile_spec
from kvlc.init import EngineOptions, GroupNames, InitError, init_spec, init_yaml, read_model
from kvlc.init.engines import stage_layers

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ROOT / "layouts"


def config(name: str) -> dict:
    for folder in ("templates", "configs"):
        path = LAYOUTS / folder / f"{name}.config.json"
        if path.exists():
            return json.loads(path.read_text())
    raise FileNotFoundError(name)


# checked-in layout -> (config, engine description, group names as the layout spells them)
LLAMA = dict(model_name="meta-llama/Llama-3.1-70B")
GEMMA = GroupNames(full="global", sliding="local")
MLA = GroupNames(full="mla")
CASES = {
    "llama-3.1-70b-tp4": ("llama-3.1-70b", EngineOptions(tp_size=4, **LLAMA), GroupNames()),
    "llama-3.1-70b-tp8": ("llama-3.1-70b", EngineOptions(tp_size=8, **LLAMA), GroupNames()),
    "llama-3.1-70b-hnd-tp4": ("llama-3.1-70b", EngineOptions(tp_size=4, backend="paged-hnd", **LLAMA), GroupNames()),
    "llama-3.1-70b-hnd-tp8": ("llama-3.1-70b", EngineOptions(tp_size=8, backend="paged-hnd", **LLAMA), GroupNames()),
    "qwen3-32b-tp2": ("qwen3-32b", EngineOptions(tp_size=2, backend="split-nhd", model_name="Qwen/Qwen3-32B"),
                      GroupNames()),
    "gemma-3-27b-tp2-b16": ("gemma-3-27b", EngineOptions(tp_size=2, block_size=16, num_blocks=4096,
                            sliding_blocks=1024, model_name="google/gemma-3-27b-it"), GEMMA),
    "gemma-3-27b-tp2-b32": ("gemma-3-27b", EngineOptions(tp_size=2, block_size=32, num_blocks=2048,
                            sliding_blocks=512, model_name="google/gemma-3-27b-it"), GEMMA),
    "gpt-oss-120b-tp4": ("gpt-oss-120b", EngineOptions(tp_size=4, backend="pooled-nhd", sliding_blocks=1024,
                         model_name="openai/gpt-oss-120b"), GroupNames()),
    "nemotron-h-8b-tp2": ("nemotron-h-8b", EngineOptions(tp_size=2, state_slots=256,
                          model_name="nvidia/Nemotron-H-8B-Base-8K"), GroupNames(full="attn", state="mamba")),
    "nemotron-h-8b-tp4": ("nemotron-h-8b", EngineOptions(tp_size=4, state_slots=256,
                          model_name="nvidia/Nemotron-H-8B-Base-8K"), GroupNames(full="attn", state="mamba")),
    "qwen3-next-80b-a3b-tp4": ("qwen3-next-80b-a3b", EngineOptions(
        tp_size=4, block_size=256, kernel_block_size=64, state_slots=256,
        model_name="Qwen/Qwen3-Next-80B-A3B-Instruct"), GroupNames(state="gdn")),
    "deepseek-v3-tp8": ("deepseek-v3", EngineOptions(tp_size=8, block_size=64, model_name="deepseek-ai/DeepSeek-V3"),
                        MLA),
    "deepseek-v3-tp1": ("deepseek-v3", EngineOptions(tp_size=1, block_size=64, model_name="deepseek-ai/DeepSeek-V3"),
                        MLA),
    "deepseek-v3.2-tp8": ("deepseek-v3.2", EngineOptions(tp_size=8, block_size=64, draft_layers=False,
                          model_name="deepseek-ai/DeepSeek-V3.2"), MLA),
}


@pytest.mark.parametrize("stem", sorted(CASES))
def test_init_reproduces_checked_in_layout(stem):
    """kvlc init on the layout's config.json gives a plan with the checked-in layout's digest."""
    cfg, opts, names = CASES[stem]
    want = compile_spec(LAYOUTS / f"{stem}.yaml")
    got = compile_spec(init_yaml(config(cfg), EngineOptions(**{**opts.__dict__, "name": want.name}), names))
    assert got.to_json() == want.to_json()
    assert got.digest == want.digest


# ---------------------------------------------------------------- head_dim and dispatch
def test_qwen3_32b_head_dim_comes_from_config():
    """Qwen3-32B: head_dim 128 though hidden/heads = 80; the hidden/heads template gets it wrong, init does not."""
    cfg = config("qwen3-32b")
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 80
    plan = compile_spec(init_yaml(cfg, EngineOptions(tp_size=2, num_blocks=8)))
    assert plan.model.sizes["head_dim"] == 128
    k = plan.region("layer.0").field("k")
    assert [(d.name, d.size) for d in k.dims] == [("token", 16), ("head", 4), ("head_dim", 128)]
    from kvlc.compiler.spec.template import render_template
    wrong = compile_spec(render_template(LAYOUTS / "templates/llama-3.1-70b.yaml.j2", cfg,
                                         {"tp_size": 2, "order": "nhd"}))
    assert wrong.model.sizes["head_dim"] == 80  # the template's hidden/heads, silently wrong


def test_head_dim_falls_back_to_hidden_over_heads():
    cfg = {**config("qwen3-32b")}
    del cfg["head_dim"]
    assert read_model(cfg).head_dim == 80


@pytest.mark.parametrize("cfg", ["llama-3.1-70b", "gemma-3-27b", "gpt-oss-120b", "nemotron-h-8b",
                                 "qwen3-next-80b-a3b", "deepseek-v3", "deepseek-v3.2", "qwen3-32b"])
def test_dispatch_ignores_model_names(cfg):
    """The same fields under other model names, types and architectures give the same spec."""
    c = config(cfg)
    renamed = json.loads(json.dumps(c).replace(c.get("model_type", "@"), "zz_other"))
    for part in (renamed, renamed.get("text_config", {})):
        part["architectures"] = ["SomethingElseForCausalLM"]
        part["model_type"] = "zz_other"
    opts = EngineOptions(tp_size=2, num_blocks=16, block_size=64, name="x", model_name="m")
    assert init_spec(renamed, opts) == init_spec(c, opts)


FAMILIES = {"llama-3.1-70b": "dense", "qwen3-32b": "dense", "gemma-3-27b": "sliding", "gpt-oss-120b": "sliding",
            "deepseek-v3": "mla", "deepseek-v3.2": "mla", "nemotron-h-8b": "mamba-hybrid",
            "qwen3-next-80b-a3b": "linear-hybrid"}


@pytest.mark.parametrize("cfg", sorted(FAMILIES))
def test_family_and_group_kinds(cfg):
    m = read_model(config(cfg))
    assert m.family.value == FAMILIES[cfg]
    plan = compile_spec(init_yaml(config(cfg), EngineOptions(tp_size=2, block_size=64, num_blocks=16)))
    kinds = {g.kind for g in plan.groups}
    want = {"dense": {"full_attention"}, "sliding": {"full_attention", "sliding_window"}, "mla": {"full_attention"},
            "mamba-hybrid": {"full_attention", "mamba"}, "linear-hybrid": {"full_attention", "linear_attention"}}
    assert kinds == want[FAMILIES[cfg]] | ({"indexer"} if cfg == "deepseek-v3.2" else set())


def test_sliding_window_pattern_and_layer_types_agree():
    """Gemma-style sliding_window_pattern and gpt-oss-style layer_types name the same layers sliding."""
    base = {"num_hidden_layers": 12, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
            "sliding_window": 512}
    by_pattern = read_model({**base, "sliding_window_pattern": 3})
    types = ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(12)]
    assert by_pattern.kinds == read_model({**base, "layer_types": types}).kinds
    assert [k.value for k in by_pattern.kinds[:3]] == ["sliding", "sliding", "full"]


# ---------------------------------------------------------------- pipeline stages
def test_pp_stages_split_layers_evenly():
    assert [stage_layers(EngineOptions(pp_size=4, pp_rank=r), 62) for r in range(4)] == \
        [(0, 16), (16, 32), (32, 47), (47, 62)]
    assert stage_layers(EngineOptions(layers=(0, 62)), 62) is None


@pytest.mark.parametrize("cfg", ["llama-3.1-70b", "gemma-3-27b", "nemotron-h-8b", "deepseek-v3.2"])
def test_pp_stage_holds_its_window(cfg):
    """A stage's spec holds exactly the cache layers of its window; the stages together hold every layer."""
    full = compile_spec(init_yaml(config(cfg), EngineOptions(tp_size=2, block_size=64, num_blocks=16,
                                                             draft_layers=False)))
    names = []
    for rank in range(3):
        stage = compile_spec(init_yaml(config(cfg), EngineOptions(tp_size=2, block_size=64, num_blocks=16,
                                                                  pp_size=3, pp_rank=rank, draft_layers=False)))
        start, stop = stage.parallel.layers
        assert {int(r.name.split(".")[1]) for r in stage.regions} <= set(range(start, stop))
        names += [r.name for r in stage.regions]
        for r in stage.regions:
            assert r == full.region(r.name)
    assert names == [r.name for r in full.regions]


def test_mtp_layer_only_on_last_stage():
    first = init_spec(config("deepseek-v3"), EngineOptions(block_size=64, pp_size=2, pp_rank=0))
    last = init_spec(config("deepseek-v3"), EngineOptions(block_size=64, pp_size=2, pp_rank=1))
    assert [r["name"] for r in last["regions"] if r.get("optional")] == ["layer.61"]
    assert not [r for r in first["regions"] if r.get("optional")]


# ---------------------------------------------------------------- refused inputs
@pytest.mark.parametrize("opts, message", [
    (EngineOptions(engine="sglang"), "--engine 'sglang': unknown engine; valid names: 'kvlc', 'vllm'"),
    (EngineOptions(backend="paged"), "--backend 'paged': engine 'kvlc' has no such backend; did you mean 'paged-hnd'?"),
    (EngineOptions(kv_dtype="bf61"), "--kv-dtype 'bf61': unknown KV dtype; did you mean 'bf16'?"),
    (EngineOptions(mem="HBM"), "--mem 'HBM': unknown memory type; valid names: 'DRAM', 'VRAM'"),
    (EngineOptions(num_blocks=0), "--num-blocks must be at least 1, found 0"),
    (EngineOptions(layers=(40, 90)), "--layers 40:90 is not a window of the model's 80 layers; "
                                     "expected 0 <= start < stop <= 80"),
    (EngineOptions(pp_size=4, pp_rank=4), "--pp-size 4 --pp-rank 4: expected 1 <= pp_size <= 80 layers and "
                                          "0 <= pp_rank < pp_size"),
])
def test_bad_engine_description(opts, message):
    with pytest.raises(InitError) as exc:
        init_spec(config("llama-3.1-70b"), opts)
    assert str(exc.value) == message


# ---------------------------------------------------------------- fp8_ds_mla: vLLM's packed MLA record
DS_MLA_OPTS = EngineOptions(tp_size=8, block_size=64, num_blocks=2048, kv_dtype="fp8_ds_mla", draft_layers=False,
                            model_name="deepseek-ai/DeepSeek-V3.2", name="deepseek-v3.2-fp8-ds-mla-tp8")


def test_fp8_ds_mla_reproduces_the_checked_in_record_layout():
    """V3.2 with --kv-dtype fp8_ds_mla: every MLA region equals the checked-in record layout's (656-byte
    records, explicit strides); the config without its indexer fields gives that file's digest exactly."""
    want = compile_spec(LAYOUTS / "deepseek-v3.2-fp8-ds-mla-tp8.yaml")
    got = compile_spec(init_yaml(config("deepseek-v3.2"), DS_MLA_OPTS, MLA))
    assert [got.region(r.name) for r in want.regions] == list(want.regions)
    assert [r.name for r in got.regions if r.groups == ("indexer",)] == [f"layer.{i}.indexer" for i in range(61)]
    mla_only = {k: v for k, v in config("deepseek-v3.2").items() if not k.startswith("index_")}
    assert compile_spec(init_yaml(mla_only, DS_MLA_OPTS, MLA)).digest == want.digest
    f = {x.name: x for x in got.region("layer.0").fields}
    assert [(n, f[n].offset, f[n].dtype) for n in ("nope", "scale", "rope")] == \
        [("nope", 0, "fp8_e4m3"), ("scale", 512, "fp32"), ("rope", 528, "bf16")]
    assert got.region("layer.0").block_bytes == 64 * 656


def test_fp8_ds_mla_record_comes_from_config_fields():
    """A smaller MLA model gets its own record: rank 256 → 2 scales, rope 32 → 256 + 8 + 64 = 328 bytes."""
    cfg = {**config("deepseek-v3"), "kv_lora_rank": 256, "qk_rope_head_dim": 32, "num_hidden_layers": 2}
    plan = compile_spec(init_yaml(cfg, EngineOptions(kv_dtype="fp8_ds_mla", block_size=16, num_blocks=4)))
    r = plan.region("layer.0")
    assert r.block_bytes == 16 * 328 and plan.model.sizes["nope"] == 256 and plan.model.sizes["scale"] == 2
    assert {x.name: x.offset for x in r.fields} == {"nope": 0, "scale": 256, "rope": 264}


def test_cli_fp8_ds_mla(tmp_path):
    out = tmp_path / "r.yaml"
    res = CliRunner().invoke(cli, ["init", str(LAYOUTS / "configs/deepseek-v3.2.config.json"), "--tp-size", "8",
                                   "--block-size", "64", "--num-blocks", "2048", "--kv-dtype", "fp8_ds_mla",
                                   "--no-mtp", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert compile_spec(out).region("layer.60").text().startswith("layer.60 kv.60+0 VRAM:0 blocks=2048 bytes=41984")


@pytest.mark.parametrize("cfg, change, message", [
    ("llama-3.1-70b", {}, "--kv-dtype fp8_ds_mla is vLLM's packed MLA cache (fp8 latent, fp32 scales, bf16 rope "
     "per token), but this is a dense model (config.json has no 'kv_lora_rank'); fix: use a plain KV dtype such "
     "as bf16 or fp8_e4m3"),
    ("nemotron-h-8b", {}, "--kv-dtype fp8_ds_mla is vLLM's packed MLA cache (fp8 latent, fp32 scales, bf16 rope "
     "per token), but this is a mamba-hybrid model (config.json has no 'kv_lora_rank'); fix: use a plain KV "
     "dtype such as bf16 or fp8_e4m3"),
    ("deepseek-v3", {"kv_lora_rank": 500}, "--kv-dtype fp8_ds_mla quantizes the latent in tiles of 128 values "
     "with one fp32 scale each; config.json's kv_lora_rank 500 is not a multiple of 128; fix: use bf16 for the "
     "MLA latent"),
])
def test_fp8_ds_mla_refused_without_a_packable_latent(cfg, change, message):
    with pytest.raises(InitError) as exc:
        init_spec({**config(cfg), **change}, EngineOptions(kv_dtype="fp8_ds_mla", block_size=64))
    assert str(exc.value) == message


@pytest.mark.parametrize("cfg, message", [
    ([], "config.json must be a JSON object, found list"),
    ({"hidden_size": 1}, "config.json has no 'num_hidden_layers'; expected a HuggingFace model config (the "
                         "model's config.json, not a tokenizer or generation config)"),
    ({"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 100},
     "config.json has no 'head_dim' and hidden_size 100 is not a multiple of num_attention_heads 3; "
     "fix: add 'head_dim' to the config"),
    ({"num_hidden_layers": "2"}, "config.json: 'num_hidden_layers' must be a non-negative integer, found '2'; "
                                 "fix: give the model's num_hidden_layers as in its HuggingFace config.json"),
    ({"num_hidden_layers": 3, "hybrid_override_pattern": "M*"},
     "config.json: hybrid_override_pattern must have 3 letters of M, *, -, E, found 2 letters; "
     "fix: one letter per layer"),
    ({"num_hidden_layers": 3, "num_attention_heads": 2, "head_dim": 8, "sliding_window": 4,
      "layer_types": ["sliding_attention"]},
     "config.json: layer_types has 1 entries, num_hidden_layers is 3; fix: give one type per layer"),
])
def test_bad_config(cfg, message):
    with pytest.raises(InitError) as exc:
        init_spec(cfg)
    assert str(exc.value) == message


# ---------------------------------------------------------------- command line
def test_cli_writes_the_spec(tmp_path):
    out = tmp_path / "q.yaml"
    args = ["init", str(LAYOUTS / "configs/qwen3-32b.config.json"), "--engine", "kvlc", "--backend", "split-nhd",
            "--tp-size", "2", "--block-size", "16", "--kv-dtype", "bf16", "--mem", "VRAM", "--num-blocks", "4096",
            "--model-name", "Qwen/Qwen3-32B", "--name", "qwen3-32b-tp2", "-o", str(out)]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    assert compile_spec(out).digest == compile_spec(LAYOUTS / "qwen3-32b-tp2.yaml").digest
    res = CliRunner().invoke(cli, args[:-2] + ["--json"])
    assert json.loads(res.output) == init_spec(config("qwen3-32b"), EngineOptions(
        backend="split-nhd", tp_size=2, model_name="Qwen/Qwen3-32B", name="qwen3-32b-tp2"))


def test_cli_pp_stage_and_dcp():
    # 8 KV heads at TP16: each head on 2 ranks, which DCP2 shards by token (TP8 DCP2 would lose tokens)
    res = CliRunner().invoke(cli, ["init", str(LAYOUTS / "templates/llama-3.1-70b.config.json"), "--tp-size", "16",
                                   "--layers", "40:80", "--dcp-size", "2", "--num-blocks", "64", "--json"])
    assert res.exit_code == 0, res.output
    spec = json.loads(res.output)
    assert spec["parallel"] == {"tp_size": 16, "dcp_size": 2, "layers": [40, 80]}
    assert [r["name"] for r in spec["regions"]] == [f"layer.{i}" for i in range(40, 80)]


@pytest.mark.parametrize("args, message", [
    (["--backend", "FLASH_ATTN"], "--backend 'FLASH_ATTN': engine 'kvlc' has no such backend; valid names: "
                                  "'paged-hnd', 'paged-nhd', 'pooled-hnd', 'pooled-nhd', 'split-hnd', 'split-nhd'\n"
                                  "kvlc: 1 problem\n"),
    (["--engine", "vllm"], "--backend 'paged-nhd': engine 'vllm' has no such backend; valid names: 'CPU_ATTN', "
                           "'CPU_MLA', 'CUTLASS_MLA', 'FLASHINFER', 'FLASHINFER_MLA', 'FLASHMLA', 'FLASHMLA_SPARSE', "
                           "'FLASH_ATTN', 'FLASH_ATTN_MLA', 'FLEX_ATTENTION', 'ROCM_AITER_MLA', 'TRITON_ATTN' and 1 "
                           "more\nkvlc: 1 problem\n"),
    (["--layers", "3"], "--layers '3': expected START:STOP, e.g. --layers 0:40 (layers [0, 40))\nkvlc: 1 problem\n"),
])
def test_cli_refuses(args, message):
    res = CliRunner().invoke(cli, ["init", str(LAYOUTS / "templates/llama-3.1-70b.config.json"), *args])
    assert res.exit_code == 2 and res.output == message


@pytest.mark.parametrize("args, start", [
    (["--tp-size", "3"], "--tp-size 3 (the spec's parallel.tp_size): tp_size 3 cannot split 'head' of size 8"),
    (["--kernel-block-size", "5"], "--kernel-block-size 5 (the spec's groups[0].kernel_block_size): kernel block "
                                   "size 5 does not divide block size 16"),
    (["--tp-size", "16", "--dcp-size", "2", "--dcp-interleave", "3"],
     "--dcp-interleave 3 (the spec's parallel.dcp_interleave): dcp_interleave 3 does not divide"),
])
def test_cli_refuses_uncompilable_combination(args, start):
    """A combination the compiler refuses is its error at the option it comes from, not at <string>:line:col."""
    res = CliRunner().invoke(cli, ["init", str(LAYOUTS / "templates/llama-3.1-70b.config.json"), *args])
    assert res.exit_code == 2 and res.output.startswith(start), res.output
    assert "<string>" not in res.output and "Traceback" not in res.output


def test_cli_help_lists_the_choices():
    """`kvlc init --help` lists the engines, every backend and every KV dtype; a value outside them is click's
    error naming the option and the closest choice."""
    from kvlc.compiler.spec.dtypes import DTYPE_SIZES
    from kvlc.engines.vllm.derive.offline import ATTENTION_BACKENDS, MLA_BACKENDS
    from kvlc.init.engines import ENGINES
    res = CliRunner(env={"COLUMNS": "4000"}).invoke(cli, ["init", "--help"])
    text = " ".join(res.output.split())
    assert "--engine [kvlc|vllm]" in text
    for choice in [*ENGINES["kvlc"], *ATTENTION_BACKENDS, *MLA_BACKENDS, *DTYPE_SIZES, "fp8_ds_mla"]:
        assert f"|{choice}|" in text or f"[{choice}|" in text or f"|{choice}]" in text, choice
    bad = CliRunner().invoke(cli, ["init", str(LAYOUTS / "templates/llama-3.1-70b.config.json"), "--kv-dtype", "bf61"])
    assert bad.exit_code == 2 and "Invalid value for '--kv-dtype': 'bf61' is not a choice; did you mean 'bf16'?" \
        in bad.output


def test_generated_yaml_is_self_describing():
    text = init_yaml(config("nemotron-h-8b"), EngineOptions(tp_size=2))
    assert text.splitlines()[0].startswith("# nemotron_h (52 layers: 4 full, 24 mamba, 24 none; mamba-hybrid)")
    assert kvlc.compile_spec(text).regions


@pytest.mark.parametrize("name", ["kvlc.init", "kvlc.init.model", "kvlc.init.engines", "kvlc.init.ds_mla"])
def test_docstring_examples(name):
    import doctest
    import importlib
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted and result.failed == 0


def test_every_rendered_layout_is_reproduced():
    """Each checked-in template's rendered layouts are also kvlc init outputs (CASES covers them all)."""
    from tests.test_layouts import RENDERED
    assert {out.removesuffix(".yaml") for out in RENDERED} <= set(CASES)


@pytest.mark.parametrize("window", [(0, 40), (40, 80)])
def test_checked_in_pp_stages_are_init_output(window):
    """layouts/llama-3.1-70b-tp4-pp*.yaml are byte for byte what kvlc init writes for those stages."""
    name = f"llama-3.1-70b-tp4-pp{window[0]}-{window[1]}"
    text = init_yaml(config("llama-3.1-70b"), EngineOptions(tp_size=4, layers=window, name=name, **LLAMA))
    assert (LAYOUTS / f"{name}.yaml").read_text() == text


# ---------------------------------------------------------------- engine vllm: the vLLM adapter's offline views
def test_vllm_engine_is_the_adapters_view():
    """--engine vllm gives exactly the spec the vLLM adapter derives offline (reuse, not a second copy)."""
    from kvlc.engines.vllm.derive.spec import derive_spec
    from kvlc.engines.vllm.derive.offline import published_view
    cfg = config("qwen3-32b")
    for backend in ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"):
        got = init_spec(cfg, EngineOptions(engine="vllm", backend=backend, tp_size=2, num_blocks=64,
                                           model_name="Qwen/Qwen3-32B"))
        view = published_view(cfg, "Qwen/Qwen3-32B", backend=backend, block_size=16, num_blocks=64, tp_size=2,
                              device="cuda:0")
        assert got == derive_spec(view)
        plan = compile_spec(init_yaml(cfg, EngineOptions(engine="vllm", backend=backend, tp_size=2, num_blocks=64)))
        assert plan.model.sizes["head_dim"] == 128


def test_vllm_engine_mla():
    plan = compile_spec(init_yaml(config("deepseek-v3"), EngineOptions(engine="vllm", backend="FLASHMLA",
                                                                        block_size=64, num_blocks=16, tp_size=8)))
    assert {f.dims[-1].size for r in plan.regions for f in r.fields} == {576}


def test_vllm_engine_sliding_pattern_reaches_the_adapter():
    """A Gemma-style sliding_window_pattern (no layer_types) still gives vLLM a sliding group."""
    plan = compile_spec(init_yaml(config("gemma-3-27b"), EngineOptions(engine="vllm", backend="FLASH_ATTN",
                                                                        tp_size=2, num_blocks=16)))
    kinds = {g.name: g.kind for g in plan.groups}
    assert plan.region("layer.5").groups == ("full",) and kinds[plan.region("layer.4").groups[0]] == "sliding_window"


def test_vllm_engine_pp_stage():
    """A vLLM stage allocates its layers only; regions keep the model's layer numbers and pair with the whole."""
    whole = compile_spec(init_yaml(config("qwen3-32b"), EngineOptions(engine="vllm", backend="FLASH_ATTN",
                                                                       tp_size=2, num_blocks=16)))
    stage = compile_spec(init_yaml(config("qwen3-32b"), EngineOptions(engine="vllm", backend="FLASH_ATTN",
                                                                       tp_size=2, num_blocks=16, layers=(32, 64))))
    assert stage.parallel.layers == (32, 64) and stage.name.endswith("-pp32-64")
    assert [r.name for r in stage.regions] == [f"layer.{i}" for i in range(32, 64)]
    assert stage.region("layer.32").offset == 0 and stage.storages[0].size * 2 == whole.storages[0].size
    from kvlc.compiler.pairing.pair import pair
    assert {e.region for e in pair(whole, stage, local_rank=1).entries} == {f"layer.{i}" for i in range(32, 64)}


@pytest.mark.parametrize("cfg, opts, message", [
    ("qwen3-32b", EngineOptions(engine="vllm", backend="FLASH_ATN"),
     "--backend 'FLASH_ATN': engine 'vllm' has no such backend; did you mean 'FLASH_ATTN' or 'FLASH_ATTN_MLA' or "
     "'FLASHMLA'?"),
    ("qwen3-32b", EngineOptions(engine="vllm", backend="CPU_ATTN"),
     "--mem VRAM: backend CPU_ATTN keeps its cache in host memory (DRAM); fix: --mem DRAM"),
    ("deepseek-v3", EngineOptions(engine="vllm", backend="CPU_MLA", block_size=16),
     "--mem VRAM: backend CPU_MLA keeps its cache in host memory (DRAM); fix: --mem DRAM"),
    ("gemma-3-27b", EngineOptions(engine="vllm", backend="FLASH_ATTN", sliding_blocks=8),
     "engine 'vllm' gives every KV-cache group the same block count; fix: drop --sliding-blocks / "
     "--state-slots and set --num-blocks"),
])
def test_vllm_engine_refusals(cfg, opts, message):
    with pytest.raises(InitError) as exc:
        init_spec(config(cfg), opts)
    assert str(exc.value) == message
