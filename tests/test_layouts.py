"""Checked-in layouts: every spec compiles, rendered specs equal their templates, model facts hold."""

from __future__ import annotations

import shlex
from functools import lru_cache
from pathlib import Path

import pytest
from click.testing import CliRunner

import kvlc
from kvlc.cli import main as cli
from kvlc.compiler.plan.model import Plan
from kvlc.compiler.spec.source import load_config, parse_set
from kvlc.compiler.spec.template import render_template

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ROOT / "layouts"
TEMPLATES = LAYOUTS / "templates"
SPECS = sorted(LAYOUTS.glob("*.yaml"))

# output file -> (template, config, --set pairs in the order the header's command gives them)
RENDERED: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "llama-3.1-70b-tp8.yaml": ("llama-3.1-70b.yaml.j2", "llama-3.1-70b.config.json", ("tp_size=8", "order=nhd")),
    "llama-3.1-70b-tp4.yaml": ("llama-3.1-70b.yaml.j2", "llama-3.1-70b.config.json", ("tp_size=4", "order=nhd")),
    "llama-3.1-70b-hnd-tp4.yaml": ("llama-3.1-70b.yaml.j2", "llama-3.1-70b.config.json", ("tp_size=4", "order=hnd")),
    "llama-3.1-70b-hnd-tp8.yaml": ("llama-3.1-70b.yaml.j2", "llama-3.1-70b.config.json", ("tp_size=8", "order=hnd")),
    "gemma-3-27b-tp2-b16.yaml": ("gemma-3-27b.yaml.j2", "gemma-3-27b.config.json", ("tp_size=2", "block_size=16")),
    "gemma-3-27b-tp2-b32.yaml": ("gemma-3-27b.yaml.j2", "gemma-3-27b.config.json", ("tp_size=2", "block_size=32")),
    "gpt-oss-120b-tp4.yaml": ("gpt-oss-120b.yaml.j2", "gpt-oss-120b.config.json", ("tp_size=4",)),
    "nemotron-h-8b-tp4.yaml": ("nemotron-h-8b.yaml.j2", "nemotron-h-8b.config.json", ("tp_size=4",)),
    "nemotron-h-8b-tp2.yaml": ("nemotron-h-8b.yaml.j2", "nemotron-h-8b.config.json", ("tp_size=2",)),
    "qwen3-next-80b-a3b-tp4.yaml": ("qwen3-next-80b-a3b.yaml.j2", "qwen3-next-80b-a3b.config.json",
                                    ("tp_size=4",)),
}


@lru_cache(maxsize=None)
def plan(stem: str) -> Plan:
    return kvlc.compile_spec(LAYOUTS / f"{stem}.yaml")


def command(out: str) -> str:
    template, config, sets = RENDERED[out]
    return " ".join(["kvlc render", f"layouts/templates/{template}", "--config", f"layouts/templates/{config}",
                     *(f"--set {s}" for s in sets), "-o", f"layouts/{out}"])


def dims(field) -> list[tuple[str, str, int, int]]:
    return [(d.name, d.role, d.size, d.global_size) for d in field.dims]


def layers_in(p: Plan, group: str) -> list[int]:
    return [int(r.name.split(".")[1]) for r in p.regions if r.groups == (group,)]


# ---------------------------------------------------------------- every layout
@pytest.mark.parametrize("spec", SPECS, ids=lambda p: p.stem)
def test_layout_compiles(spec):
    """Every layouts/*.yaml compiles to a plan whose JSON round-trips."""
    p = kvlc.compile_spec(spec)
    assert p.regions and Plan.from_json(p.to_json()) == p


@pytest.mark.parametrize("spec", SPECS, ids=lambda p: p.stem)
def test_layout_starts_with_comment(spec):
    """Every layouts/*.yaml opens with a comment saying what model and where the numbers come from."""
    head = spec.read_text().splitlines()[0]
    assert head.startswith("# ") and len(head) > 10


# ---------------------------------------------------------------- rendered layouts
@pytest.mark.parametrize("out", sorted(RENDERED))
def test_rendered_layout_equals_template(out):
    """A rendered layout is byte for byte its template rendered with its config and --set values."""
    template, config, sets = RENDERED[out]
    text = render_template(TEMPLATES / template, load_config(TEMPLATES / config), parse_set(sets))
    assert text == (LAYOUTS / out).read_text()


@pytest.mark.parametrize("out", sorted(RENDERED))
def test_rendered_header_command_reproduces_file(out, tmp_path, monkeypatch):
    """The header's `kvlc render ...` command, run from the repo root, writes exactly the checked-in file."""
    text = (LAYOUTS / out).read_text()
    cmd = command(out)
    assert f"#   {cmd}\n" in text
    args = shlex.split(cmd)[1:]
    args[-1] = str(tmp_path / out)
    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert (tmp_path / out).read_text() == text


def test_render_table_is_complete():
    """Every generated layout is in the render table, and every template and config is used."""
    generated = {p.name for p in SPECS if "Rendered with:" in p.read_text()}
    assert generated == set(RENDERED)
    assert {t for t, _, _ in RENDERED.values()} == {p.name for p in TEMPLATES.glob("*.yaml.j2")}
    assert {c for _, c, _ in RENDERED.values()} == {p.name for p in TEMPLATES.glob("*.config.json")}


# ---------------------------------------------------------------- Llama-3.1-70B: TP and dim order
def test_llama_70b_tp8_tp4_pair_by_name():
    """Llama-3.1-70B at TP8 and TP4: same region names, 1 vs 2 of 8 KV heads per rank."""
    tp8, tp4 = plan("llama-3.1-70b-tp8"), plan("llama-3.1-70b-tp4")
    assert [r.name for r in tp8.regions] == [r.name for r in tp4.regions] == [f"layer.{i}" for i in range(80)]
    for p, heads in ((tp8, 1), (tp4, 2)):
        r = p.region("layer.0")
        assert r.field("k").dim("head").size == heads and r.field("k").dim("head").global_size == 8
        assert r.block_bytes == 2 * 16 * heads * 128 * 2


@pytest.mark.parametrize("tp,heads", [(4, 2), (8, 1)])
def test_llama_70b_hnd_vs_nhd(tp, heads):
    """HND and NHD hold the same bytes per block and region names; only dim order and strides differ."""
    nhd, hnd = plan(f"llama-3.1-70b-tp{tp}"), plan(f"llama-3.1-70b-hnd-tp{tp}")
    assert [r.name for r in nhd.regions] == [r.name for r in hnd.regions]
    a, b = nhd.region("layer.3").field("v"), hnd.region("layer.3").field("v")
    assert [d.name for d in a.dims] == ["token", "head", "head_dim"]
    assert [d.name for d in b.dims] == ["head", "token", "head_dim"]
    assert a.offset == b.offset and a.nbytes == b.nbytes
    assert a.dim("token").stride == heads * 128 * 2 and b.dim("token").stride == 128 * 2
    assert b.dim("head").stride == 16 * 128 * 2


# ---------------------------------------------------------------- Qwen3-32B
def test_qwen3_32b_k_and_v_outermost():
    """Qwen3-32B: K and V of a layer are separate regions of one tensor, V after all K blocks."""
    p = plan("qwen3-32b-tp2")
    k, v = p.region("layer.63.k"), p.region("layer.63.v")
    assert k.storage == v.storage == "kv.63"
    assert v.offset == k.offset + k.num_blocks * k.block_stride
    assert dims(k.field("k")) == [("token", "token", 16, 16), ("head", "head", 4, 8), ("head_dim", "", 128, 128)]


# ---------------------------------------------------------------- DeepSeek MLA
@pytest.mark.parametrize("tp", [8, 1])
def test_deepseek_v3_latent_replicated(tp):
    """DeepSeek-V3: 576 bf16 latent values per token, no head dim, same bytes at TP8 and TP1."""
    p = plan(f"deepseek-v3-tp{tp}")
    assert p.parallel.tp_size == tp
    r = p.region("layer.60")
    (latent,) = r.fields
    assert latent.dtype == "bf16" and latent.dim("head") is None
    assert dims(latent) == [("token", "token", 64, 64), ("latent", "", 576, 576)]
    assert r.block_bytes == 64 * 576 * 2


def test_deepseek_v3_mtp_layer_optional():
    """DeepSeek-V3: 61 required layer regions; the MTP draft layer 61 is the one optional region."""
    p = plan("deepseek-v3-tp8")
    assert [r.name for r in p.regions if r.optional] == ["layer.61"]
    assert sum(not r.optional for r in p.regions) == 61


def test_deepseek_v32_indexer_region():
    """DeepSeek-V3.2: per layer an FP8 indexer region (128 e4m3 + one fp32 scale per token) in its own group."""
    p = plan("deepseek-v3.2-tp8")
    assert {g.name: g.kind for g in p.groups} == {"mla": "full_attention", "indexer": "indexer"}
    idx = p.region("layer.17.indexer")
    assert idx.groups == ("indexer",) and idx.storage == "idx.17" and idx.block_tokens == 64
    k, scale = idx.field("k"), idx.field("scale")
    assert k.dtype == "fp8_e4m3" and dims(k) == [("token", "token", 64, 64), ("index_head_dim", "", 128, 128)]
    assert scale.dtype == "fp32" and dims(scale) == [("token", "token", 64, 64)]
    assert scale.offset == 64 * 128 and idx.block_bytes == 64 * (128 + 4)
    assert p.region("layer.17").field("latent").dim("head") is None


def test_hisparse_mixed_memory_unequal_blocks():
    """HiSparse DeepSeek-V3.2: latent regions in DRAM, indexer in VRAM, unequal block counts, equal tokens."""
    p = plan("deepseek-v3.2-hisparse-tp8")
    assert p.mem_types == ("DRAM", "VRAM")
    latent, idx = p.region("layer.30"), p.region("layer.30.indexer")
    assert (latent.mem, idx.mem) == ("DRAM", "VRAM")
    assert {r.mem for r in p.regions if r.groups == ("mla",)} == {"DRAM"}
    assert {r.mem for r in p.regions if r.groups == ("indexer",)} == {"VRAM"}
    assert latent.num_blocks != idx.num_blocks
    assert latent.num_blocks * latent.block_tokens == idx.num_blocks * idx.block_tokens
    assert p.storage("host_latent").mem == "DRAM" and latent.offset % 2097152 == 0
    assert [r.name for r in p.regions] == [r.name for r in plan("deepseek-v3.2-tp8").regions]


# ---------------------------------------------------------------- sliding-window models
@pytest.mark.parametrize("block", [16, 32])
def test_gemma3_groups_and_pattern(block):
    """Gemma-3-27B: sliding window 1024 and full groups; 5 local : 1 global, global at (i+1) % 6 == 0."""
    p = plan(f"gemma-3-27b-tp2-b{block}")
    assert {(g.name, g.kind, g.window, g.block_size) for g in p.groups} == {
        ("local", "sliding_window", 1024, block), ("global", "full_attention", 0, block)}
    assert layers_in(p, "global") == [i for i in range(62) if (i + 1) % 6 == 0] == [5, 11, 17, 23, 29, 35, 41,
                                                                                   47, 53, 59]
    assert len(layers_in(p, "local")) == 52
    assert p.region("layer.0").field("k").dim("head").size == 8


def test_gemma3_block_16_vs_32():
    """Gemma-3-27B block 16 vs 32: same names, twice the bytes per block, half the blocks."""
    b16, b32 = plan("gemma-3-27b-tp2-b16"), plan("gemma-3-27b-tp2-b32")
    assert [r.name for r in b16.regions] == [r.name for r in b32.regions]
    for a, b in zip(b16.regions, b32.regions):
        assert (a.block_tokens, b.block_tokens) == (16, 32)
        assert b.block_bytes == 2 * a.block_bytes and a.num_blocks == 2 * b.num_blocks
    assert b16.region("layer.0").num_blocks < b16.region("layer.5").num_blocks


def test_gpt_oss_alternates():
    """gpt-oss-120b: even layers sliding (window 128), odd layers full; each kind in its own pool."""
    p = plan("gpt-oss-120b-tp4")
    assert p.group("sliding").window == 128
    for i in range(36):
        group, pool = ("sliding", "swa_pool") if i % 2 == 0 else ("full", "full_pool")
        for half in ("k", "v"):
            r = p.region(f"layer.{i}.{half}")
            assert r.groups == (group,) and r.storage == pool
            assert [f.name for f in r.fields] == [half]
            assert dims(r.fields[0])[1:] == [("head", "head", 2, 8), ("head_dim", "", 64, 64)]
    assert [s.name for s in p.storages] == ["swa_pool", "full_pool"]


# ---------------------------------------------------------------- hybrid state models
@pytest.mark.parametrize("tp", [4, 2])
def test_nemotron_h_sections_per_rank(tp):
    """Nemotron-H-8B: conv x|B|C = 8192|1024|1024 split by TP section by section; fp32 SSM state; no token dim."""
    p = plan(f"nemotron-h-8b-tp{tp}")
    r = p.region("layer.0")
    assert r.is_state and r.groups == ("mamba",)
    conv = {f.name: f for f in r.fields if f.name.startswith("conv.")}
    assert list(conv) == ["conv.x", "conv.B", "conv.C"]
    per_rank = {s: conv[f"conv.{s}"].dim("head") for s in "xBC"}
    assert {s: (d.size, d.global_size) for s, d in per_rank.items()} == {
        "x": (8192 // tp, 8192), "B": (1024 // tp, 1024), "C": (1024 // tp, 1024)}
    assert [conv[n].offset for n in conv] == [0, 8192 // tp * 2, (8192 + 1024) // tp * 2]
    assert all(f.dim("token") is None for f in r.fields)
    ssm = r.field("ssm")
    assert ssm.dtype == "fp32" and dims(ssm) == [("ssm_head", "head", 128 // tp, 128),
                                                  ("mamba_head_dim", "", 64, 64), ("ssm_state", "", 128, 128)]
    assert layers_in(p, "attn") == [7, 18, 29, 40] and len(layers_in(p, "mamba")) == 24


def test_qwen3_next_linear_and_full():
    """Qwen3-Next: full attention every 4th layer (KV heads replicated at TP4), GDN state q|k|v elsewhere."""
    p = plan("qwen3-next-80b-a3b-tp4")
    assert p.group("gdn").kind == "linear_attention"
    assert layers_in(p, "full") == list(range(3, 48, 4)) and len(layers_in(p, "gdn")) == 36
    attn = p.region("layer.47")
    assert attn.field("k").dim("head").size == 1 and attn.field("k").dim("head").global_size == 2
    assert attn.block_tokens == 64 and attn.kernel_blocks_per_block == 4
    gdn = p.region("layer.0")
    assert gdn.is_state
    sizes = {f.name: (f.dim("head").size, f.dim("head").global_size) for f in gdn.fields}
    assert sizes == {"conv.q": (512, 2048), "conv.k": (512, 2048), "conv.v": (1024, 4096), "recurrent": (8, 32)}


# ---------------------------------------------------------------- FP8 with scale tables
def test_fp8_per_block_scales():
    """FP8 Llama: e4m3 K/V plus per-block fp32 per-head scales without a token dim; padded block stride."""
    p = plan("llama-3.1-8b-fp8-tp2")
    r = p.region("layer.0")
    assert {f.name: f.dtype for f in r.fields} == {"k": "fp8_e4m3", "v": "fp8_e4m3", "k_scale": "fp32",
                                                   "v_scale": "fp32"}
    for name in ("k_scale", "v_scale"):
        f = r.field(name)
        assert f.dim("token") is None and dims(f) == [("head", "head", 4, 8)]
    assert r.block_bytes == 2 * 16 * 4 * 128 + 2 * 4 * 4
    assert r.block_stride == 16896 > r.block_bytes
    assert p.storage("kv.0").size == r.num_blocks * r.block_stride
