"""Contracts of ``kvlc explain``: exact totals, collapsed layer runs, a well-formed page drawn to scale.

Byte counts under test (see kvlc/explain.py): a region's ``bytes`` are ``num_blocks * block_bytes``
(padding between blocks excluded), its ``span`` is ``end - offset``; the page draws spans.
"""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET
from dataclasses import replace
from html.parser import HTMLParser
from io import StringIO
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

import kvlc
from kvlc.cli import main
from kvlc.collapse import compact_ints
from kvlc.explain.numbers import exact, human
from kvlc.explain.page import MIN_REGION_PX, render_html
from kvlc.explain.summary import collapse, summarize
from kvlc.explain.tables import render_table

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ROOT / "layouts" / "llama-3.1-8b.yaml"
SVG = "{http://www.w3.org/2000/svg}"

# Three storages: VRAM with per-layer regions, a region shared by two groups and a tiny Mamba state;
# a DRAM storage with free space; a VRAM storage on device 1 with two interleaved regions (K/V
# alternating blocks). Kernel blocks of 16 tokens, logical blocks of 32.
MIXED = """\
kvlc: 1
name: mixed-explain
model: {name: test/mixed, num_layers: 4, num_kv_heads: 4, head_dim: 64}
parallel: {tp_size: 2}
block_size: 32
kernel_block_size: 16
groups:
  - {name: full, kind: full_attention}
  - {name: swa, kind: sliding_window, window: 128}
  - {name: ssm, kind: mamba}
storages:
  - {name: hbm, mem: VRAM, device: 0}
  - {name: host, mem: DRAM, device: 0, size: 1048576}
  - {name: pair, mem: VRAM, device: 1}
layouts:
  kv:
    fields:
      - {name: k, dtype: bf16, dims: [{name: token, role: token}, {name: head, role: head}, {name: head_dim}]}
      - {name: v, dtype: bf16, dims: [{name: token, role: token}, {name: head, role: head}, {name: head_dim}]}
  half:
    fields:
      - {name: x, dtype: bf16, dims: [{name: token, role: token}, {name: head, role: head}, {name: head_dim}]}
  state:
    fields:
      - {name: conv, dtype: fp32, dims: [{name: ch, size: 256}]}
regions:
  - repeat: {var: layer, range: layers}
    regions:
      - {name: "layer.{layer}.kv", storage: hbm, layout: kv, num_blocks: 64, groups: [full]}
  - {name: shared.kv, storage: hbm, layout: kv, num_blocks: 8, groups: [full, swa]}
  - {name: mamba.0, storage: hbm, layout: state, num_blocks: 4, groups: [ssm]}
  - {name: host.kv, storage: host, layout: kv, num_blocks: 32, groups: [full]}
  - {name: il.k, storage: pair, layout: half, num_blocks: 16, block_stride: 8192, offset: 0, groups: [full]}
  - {name: il.v, storage: pair, layout: half, num_blocks: 16, block_stride: 8192, offset: 4096,
     groups: [full]}
"""

# 61 layers, two regions per layer interleaved in plan order, all in one storage.
BIG = """\
kvlc: 1
name: big-61
model: {name: test/big, num_layers: 61, num_kv_heads: 1, head_dim: 576}
block_size: 64
groups:
  - {name: mla, kind: full_attention}
  - {name: idx, kind: indexer}
storages:
  - {name: pool, mem: VRAM, device: 0}
layouts:
  latent:
    fields:
      - {name: c, dtype: bf16, dims: [{name: token, role: token}, {name: head_dim}]}
  index:
    fields:
      - {name: q, dtype: fp8_e4m3, dims: [{name: token, role: token}, {name: d, size: 128}]}
      - {name: scale, dtype: fp32, dims: [{name: token, role: token}]}
regions:
  - repeat: {var: layer, range: layers}
    regions:
      - {name: "layer.{layer}.kv", storage: pool, layout: latent, num_blocks: 512, groups: [mla]}
      - {name: "layer.{layer}.idx", storage: pool, layout: index, num_blocks: 512, groups: [idx]}
"""


def _alternating(blocks_odd: int = 256) -> str:
    """8 layers alternating sliding (even) / full (odd), one storage per layer."""
    regions = "\n".join(
        f"  - {{name: layer.{i}, storage: kv.{i}, layout: kv, "
        f"num_blocks: {128 if i % 2 == 0 else blocks_odd}, groups: [{'swa' if i % 2 == 0 else 'full'}]}}"
        for i in range(8))
    return f"""\
kvlc: 1
name: alternating
model: {{name: test/alt, num_layers: 8, num_kv_heads: 2, head_dim: 64}}
block_size: 16
groups:
  - {{name: swa, kind: sliding_window, window: 128}}
  - {{name: full, kind: full_attention}}
storages:
  - repeat: {{var: layer, range: layers}}
    storages:
      - {{name: "kv.{{layer}}", mem: VRAM}}
layouts:
  kv:
    fields:
      - {{name: kv, dtype: bf16,
         dims: [{{name: token, role: token}}, {{name: head, role: head}}, {{name: head_dim}}]}}
regions:
{regions}
"""


@pytest.fixture(scope="module")
def mixed():
    return kvlc.compile_spec(MIXED)


@pytest.fixture(scope="module")
def mixed_page(mixed):
    return render_html(mixed)


def _svgs(page: str) -> list[ET.Element]:
    return [ET.fromstring(m) for m in re.findall(r"<svg\b.*?</svg>", page, flags=re.S)]


def _maps(page: str) -> list[ET.Element]:
    return [s for s in _svgs(page) if "map" in s.get("class", "").split()]


class _AllMaps:
    """Every memory type's map as one element tree to search (each map has its own scale)."""

    def __init__(self, maps):
        self.maps = maps

    def iter(self, tag):
        for m in self.maps:
            yield from m.iter(tag)


def _map(page: str) -> _AllMaps:
    return _AllMaps(_maps(page))


def _groups(svg, attr: str) -> dict[str, ET.Element]:
    return {g.get(attr): g for g in svg.iter(SVG + "g") if g.get(attr) is not None}


def _extent(g: ET.Element) -> ET.Element:
    return next(r for r in g.iter(SVG + "rect") if r.get("class") == "extent")


# ---------------------------------------------------------------- totals
def test_region_rows_are_exact(mixed):
    """A row's bytes are num_blocks*block_bytes, its span end-offset, its capacity in logical blocks."""
    s = summarize(mixed)
    assert [r.name for r in s.regions] == [r.name for r in mixed.regions]
    for row, r in zip(s.regions, mixed.regions):
        assert row.bytes == r.num_blocks * r.block_bytes
        assert row.span == r.end - r.offset
        assert row.capacity == r.num_blocks // r.kernel_blocks_per_block
        assert row.mem == f"{r.mem}:{r.device}" and row.groups == r.groups
    il = next(r for r in s.regions if r.name == "il.k")
    assert (il.bytes, il.span, il.tokens) == (16 * 4096, 15 * 8192 + 4096, "32 (2x16)")
    assert next(r for r in s.regions if r.name == "mamba.0").tokens == "state"


def test_totals_are_sums_of_regions(mixed):
    """Storage, memory-type, group and grand totals equal the sums of their regions' bytes."""
    s = summarize(mixed)
    for st in s.storages:
        mine = [r for r in s.regions if r.storage == st.name]
        assert st.bytes == sum(r.bytes for r in mine) and st.regions == len(mine)
        assert st.size == mixed.storage(st.name).size and st.free == st.size - st.bytes >= 0
    for m in s.mems:
        assert m.bytes == sum(r.bytes for r in s.regions if r.mem.startswith(m.mem + ":"))
        assert m.size == sum(st.size for st in mixed.storages if st.mem == m.mem)
    assert sum(m.bytes for m in s.mems) == s.total_bytes == sum(r.bytes for r in s.regions)
    assert sum(m.size for m in s.mems) == s.total_size == sum(st.size for st in mixed.storages)
    for g in s.groups:
        mine = [r for r in mixed.regions if g.name in r.groups]
        assert g.bytes == sum(r.num_blocks * r.block_bytes for r in mine)
        assert g.block_bytes == sum(r.block_bytes * r.kernel_blocks_per_block for r in mine)
    full, swa, ssm = s.groups
    assert (full.regions, swa.regions, ssm.regions) == (8, 1, 1)   # shared.kv counts in both groups
    assert (full.block_bytes, full.token_bytes, ssm.token_bytes) == (114688, 3584.0, None)
    assert full.capacity == 4                                       # shared.kv: 8 kernel blocks = 4 logical
    host = next(st for st in s.storages if st.name == "host")
    assert (host.bytes, host.free) == (262144, 786432)


SPECS = sorted(p.name for p in (ROOT / "layouts").glob("*.yaml")
               if re.search(r"^kvlc:", p.read_text(), flags=re.M))   # not pairs.yaml and the like


@pytest.mark.parametrize("spec", SPECS)
def test_checked_in_layouts_add_up(spec):
    """For every checked-in layout, totals add up and collapsing keeps every region exactly once."""
    plan = kvlc.compile_spec(ROOT / "layouts" / spec)
    s = summarize(plan)
    assert s.total_bytes == sum(st.bytes for st in s.storages) == sum(m.bytes for m in s.mems)
    assert all(st.free >= 0 for st in s.storages)
    runs = s.runs()
    assert sorted(r.name for run in runs for r in run.rows) == sorted(r.name for r in plan.regions)
    assert sum(run.bytes for run in runs) == s.total_bytes


# ---------------------------------------------------------------- collapsing
def test_compact_ints():
    """Integer sets print as ranges, stepped ranges, or comma lists."""
    assert compact_ints(range(61)) == "0..60"
    assert compact_ints(range(0, 35, 2)) == "0,2,..,34"
    assert compact_ints([3, 1, 2, 7, 9]) == "1..3,7,9"
    assert compact_ints([4]) == "4" and compact_ints([4, 5]) == "4,5" and compact_ints([1, 3, 5]) == "1,3,5"


def test_collapse_61_layers_interleaved_in_plan_order():
    """kv and idx regions alternate in the plan; each kind collapses into one run of 61."""
    s = summarize(kvlc.compile_spec(BIG))
    runs = s.runs()
    assert [(r.label, r.count, r.storage) for r in runs] == [
        ("layer.{0..60}.kv", 61, "pool"), ("layer.{0..60}.idx", 61, "pool")]
    kv, idx = runs
    step = kv.rows[1].offset - kv.rows[0].offset
    assert kv.offset == f"0 + i*{step:,}" and idx.offset == f"{idx.rows[0].offset:,} + i*{step:,}"
    assert [r.name for r in kv.rows] == [f"layer.{i}.kv" for i in range(61)]
    assert kv.bytes == 61 * 512 * kv.first.block_bytes
    assert len(s.runs(full=True)) == 122


def test_collapse_keeps_different_geometry_apart():
    """Layers alternating sliding/full collapse per kind; a differing block count splits a run."""
    runs = summarize(kvlc.compile_spec(_alternating())).runs()
    assert [(r.label, r.storage, r.count) for r in runs] == [
        ("layer.{0,2,..,6}", "kv.{0,2,..,6}", 4), ("layer.{1,3,..,7}", "kv.{1,3,..,7}", 4)]
    text = _alternating().replace("name: layer.7, storage: kv.7, layout: kv, num_blocks: 256",
                                  "name: layer.7, storage: kv.7, layout: kv, num_blocks: 512")
    runs = summarize(kvlc.compile_spec(text)).runs()
    assert [(r.label, r.count) for r in runs] == [("layer.{0,2,..,6}", 4), ("layer.{1,3,5}", 3),
                                                  ("layer.7", 1)]


def test_collapse_names_with_several_numbers():
    """With two numbers varying, the first is the layer; rows split by the other one."""
    base = summarize(kvlc.compile_spec(LLAMA)).regions[0]
    names = [f"attn.{layer}.k{part}" for part in (0, 1) for layer in range(3)] + ["conv1d.2"]
    rows = [replace(base, name=n) for n in names]
    assert [(r.label, r.count) for r in collapse(rows)] == [
        ("attn.{0..2}.k0", 3), ("attn.{0..2}.k1", 3), ("conv1d.2", 1)]


def test_collapse_mixed(mixed):
    """Only regions that differ by their layer number merge; singles keep their own row."""
    rows = summarize(mixed).regions
    assert [(r.label, r.count) for r in collapse(rows)] == [
        ("layer.{0..3}.kv", 4), ("shared.kv", 1), ("mamba.0", 1), ("host.kv", 1), ("il.k", 1), ("il.v", 1)]


def test_rich_table_collapsed_and_full():
    """The terminal table shows one row per run (x61) by default and every region with full=True."""
    plan = kvlc.compile_spec(BIG)
    con = Console(file=StringIO(), width=240)
    render_table(plan, con)
    out = con.file.getvalue()
    assert "layer.{0..60}.kv" in out and "x61" in out and "layer.17.kv" not in out
    assert plan.digest in out and "2.39 GiB (2,566,520,832)" in out
    assert "q@0:fp8_e4m3[token=64,d=128]" in out          # brackets are text, not rich markup
    con = Console(file=StringIO(), width=240)
    render_table(plan, con, full=True)
    out = con.file.getvalue()
    assert all(f"layer.{i}.idx" in out for i in range(61))


# ---------------------------------------------------------------- HTML
class _Balance(HTMLParser):
    VOID = {"meta", "link", "br", "wbr", "hr", "img", "input", "col", "area", "base", "source"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.tags: set[str] = set()

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:]} at {self.getpos()}")
        else:
            self.stack.pop()


def test_html_well_formed_and_standalone(mixed_page):
    """Every tag closes in order, each SVG parses as XML, and nothing is fetched from elsewhere."""
    p = _Balance()
    p.feed(mixed_page)
    p.close()
    assert p.errors == [] and p.stack == []
    assert mixed_page.startswith("<!DOCTYPE html>")
    assert {"html", "head", "style", "body", "svg", "table"} <= p.tags
    assert not {"script", "link", "img", "iframe"} & p.tags
    svgs = _svgs(mixed_page)
    classes = sorted(s.get("class") for s in svgs)
    assert classes == ["block"] * 3 + ["legend", "map", "map"]     # 3 block layouts; VRAM and DRAM maps
    assert re.findall(r"https?://[^\s\"')]+", mixed_page) == ["http://www.w3.org/2000/svg"] * len(svgs)
    assert "@import" not in mixed_page and "url(http" not in mixed_page


def test_html_names_plan_and_digest(mixed, mixed_page):
    """The page names the plan and carries its full digest."""
    assert f"<h1>{mixed.name}</h1>" in mixed_page
    assert mixed.digest in mixed_page and f'content="{mixed.digest}"' in mixed_page


def test_every_storage_and_region_titled_exactly(mixed, mixed_page):
    """Each storage and region is drawn once, with a <title> holding its exact byte numbers."""
    svg = _map(mixed_page)
    storages, regions = _groups(svg, "data-storage"), _groups(svg, "data-region")
    assert sorted(storages) == sorted(s.name for s in mixed.storages)   # all differ: none collapsed
    assert sorted(regions) == sorted(r.name for r in mixed.regions)
    s = summarize(mixed)
    for st in s.storages:
        title = storages[st.name].find(SVG + "title").text
        assert f"size {exact(st.size)} B" in title and f"{exact(st.bytes)} B in blocks" in title
        assert f"{exact(st.free)} B free" in title and storages[st.name].get("data-size") == str(st.size)
    for r in mixed.regions:
        g = regions[r.name]
        title = g.find(SVG + "title").text
        assert f"offset {exact(r.offset)} B, end {exact(r.end)} B, span {exact(r.end - r.offset)} B" in title
        assert (f"{exact(r.num_blocks)} blocks x {exact(r.block_bytes)} B (stride {exact(r.block_stride)} B"
                in title)
        assert f"= {exact(r.num_blocks * r.block_bytes)} B" in title
        assert g.get("data-bytes") == str(r.num_blocks * r.block_bytes)


def test_widths_proportional_to_bytes(mixed, mixed_page):
    """Region rects and storage bars have widths proportional to their spans / sizes (to 0.5%)."""
    svg = _map(mixed_page)
    regions, storages = _groups(svg, "data-region"), _groups(svg, "data-storage")
    w = {name: float(_extent(g).get("width")) for name, g in regions.items()}
    span = {r.name: r.end - r.offset for r in mixed.regions}
    for a, b in (("layer.0.kv", "shared.kv"), ("layer.2.kv", "layer.3.kv"), ("shared.kv", "il.k")):
        assert w[a] / w[b] == pytest.approx(span[a] / span[b], rel=5e-3)
    bar = {n: float(next(g.iter(SVG + "rect")).get("width")) for n, g in storages.items()}
    size = {s.name: s.size for s in mixed.storages}
    assert bar["pair"] / bar["hbm"] == pytest.approx(size["pair"] / size["hbm"], rel=5e-3)   # both VRAM
    assert bar["hbm"] == max(bar.values())
    # DRAM has a scale of its own: its only storage spans the full width, whatever VRAM holds
    dram = next(m for m in _maps(mixed_page) if m.get("data-mem") == "DRAM")
    assert int(dram.get("data-scale-bytes")) == size["host"] and bar["host"] == pytest.approx(bar["hbm"])
    # offsets to scale: layer.1.kv starts one layer's span after layer.0.kv
    x = {name: float(_extent(g).get("x")) for name, g in regions.items()}
    assert (x["layer.1.kv"] - x["layer.0.kv"]) / w["layer.0.kv"] == pytest.approx(1.0, rel=5e-3)


def test_tiny_regions_visible_numbers_exact(mixed, mixed_page):
    """A 4 KiB region in a 2 MiB bar is drawn at the minimum width; its title keeps the exact bytes."""
    g = _groups(_map(mixed_page), "data-region")["mamba.0"]
    r = mixed.region("mamba.0")
    assert float(_extent(g).get("width")) == pytest.approx(MIN_REGION_PX)
    assert r.num_blocks * r.block_bytes == 4096 and "= 4,096 B" in g.find(SVG + "title").text


def test_interleaved_regions_get_lanes_and_groups_bands(mixed_page):
    """Interleaved il.k/il.v sit in different lanes; shared.kv is drawn as one band per group."""
    regions = _groups(_map(mixed_page), "data-region")
    yk, yv = (float(_extent(regions[n]).get("y")) for n in ("il.k", "il.v"))
    assert yk != yv
    bands = [r for r in regions["shared.kv"].iter(SVG + "rect") if r.get("fill", "").startswith("#")]
    assert len({b.get("fill") for b in bands}) == 2


def test_dram_hatched_vram_solid(mixed_page):
    """DRAM regions carry the hatch pattern and DRAM storages a dashed outline; VRAM ones neither."""
    svg = _map(mixed_page)
    regions, storages = _groups(svg, "data-region"), _groups(svg, "data-storage")

    def hatched(g):
        return any(r.get("fill", "").startswith("url(#hatch") for r in g.iter(SVG + "rect"))

    assert hatched(regions["host.kv"]) and not hatched(regions["layer.0.kv"])
    assert next(storages["host"].iter(SVG + "rect")).get("stroke-dasharray")
    assert next(storages["hbm"].iter(SVG + "rect")).get("stroke-dasharray") is None


def test_html_tables_match_summary(mixed, mixed_page):
    """The page's tables carry the same totals as the terminal tables, in human units and exact bytes."""
    s = summarize(mixed)
    assert f"{human(s.total_bytes)} ({exact(s.total_bytes)})" in mixed_page
    for st in s.storages:
        assert f"<td>{st.name}</td>" in mixed_page
    assert "layer.{0..3}.kv" in mixed_page


# ---------------------------------------------------------------- CLI
def test_cli_writes_page_atomically(tmp_path):
    """`kvlc explain --html` writes exactly render_html(plan), leaving no temporary file behind."""
    out = tmp_path / "llama.html"
    res = CliRunner().invoke(main, ["explain", str(LLAMA), "--html", str(out)])
    assert res.exit_code == 0, res.output
    assert out.read_text() == render_html(kvlc.compile_spec(LLAMA))
    assert sorted(os.listdir(tmp_path)) == ["llama.html"]
    assert "layer.{0..31}" in res.stdout and "x32" in res.stdout


def test_cli_failed_write_keeps_old_page(tmp_path, monkeypatch):
    """If the final rename fails, the previous page stays intact and no temporary file remains."""
    out = tmp_path / "page.html"
    out.write_text("old page")

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    res = CliRunner().invoke(main, ["explain", str(LLAMA), "--html", str(out)])
    assert res.exit_code != 0
    assert out.read_text() == "old page" and sorted(os.listdir(tmp_path)) == ["page.html"]


def test_cli_bad_spec_exits_2(tmp_path):
    """A spec error exits 2 with its located message and writes no page."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(LLAMA.read_text().replace('storage: "kv.{layer}"', "storage: nowhere"))
    out = tmp_path / "bad.html"
    res = CliRunner().invoke(main, ["explain", str(bad), "--html", str(out)])
    assert res.exit_code == 2
    assert "unknown storage 'nowhere'" in res.stderr and f"{bad}:" in res.stderr
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["bad.yaml"]


def test_cli_accepts_plan_json_and_full(tmp_path):
    """A compiled plan .json explains like its spec; --full lists every region."""
    plan = kvlc.compile_spec(LLAMA)
    pj = tmp_path / "plan.json"
    pj.write_text(plan.to_json())
    a = CliRunner().invoke(main, ["explain", str(LLAMA)])
    b = CliRunner().invoke(main, ["explain", str(pj)])
    assert a.exit_code == b.exit_code == 0 and a.stdout == b.stdout
    full = CliRunner().invoke(main, ["explain", str(pj), "--full"])
    assert full.exit_code == 0 and all(f"layer.{i} " in full.stdout for i in range(32))


EXPLAIN_MODULES = sorted(p.stem for p in (ROOT / "kvlc" / "explain").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", EXPLAIN_MODULES)
def test_explain_docstring_examples(name):
    """Every ``>>>`` example in the kvlc.explain modules gives the output it shows."""
    import doctest
    import importlib
    module = importlib.import_module(f"kvlc.explain.{name}")
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    finally:
        os.chdir(cwd)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


# ---------------------------------------------------------------- terminal widths
def _cells(t):
    from kvlc.explain.terminal import atoms
    rows = list(t.rows) + ([t.footer] if t.footer else [])
    return [a.strip() for row in rows for cell, num in zip(row, t.numeric) for a in atoms(cell, num) if a.strip()]


@pytest.mark.parametrize("columns", [110, 60])
@pytest.mark.parametrize("spec", SPECS)
def test_tables_never_cut_a_number(spec, columns):
    """At $COLUMNS 110 and 60 every line fits and every number (and unbreakable piece of text) shows whole."""
    from kvlc.explain.tables import tables
    plan = kvlc.compile_spec(ROOT / "layouts" / spec)
    res = CliRunner().invoke(main, ["explain", str(ROOT / "layouts" / spec)], env={"COLUMNS": str(columns)})
    assert res.exit_code == 0, res.output
    lines = res.stdout.split("\n")
    too_long = [line for line in lines if len(line) > columns and line.strip() != plan.digest]
    assert too_long == []
    for t in tables(summarize(plan)):
        for piece in _cells(t):
            assert piece in res.stdout, (t.title, piece)


def test_piped_output_is_not_cut_at_a_fixed_width():
    """Without a terminal and without $COLUMNS, tables keep their natural width (one table, no wrapping)."""
    res = CliRunner().invoke(main, ["explain", str(ROOT / "layouts" / "deepseek-v3.2-hisparse-tp8.yaml")],
                             env={"COLUMNS": None})
    assert res.exit_code == 0
    assert max(len(line) for line in res.stdout.split("\n")) > 200 and "[1/" not in res.stdout
    assert "k@0:fp8_e4m3[token=64,index_head_dim=128] scale@8192:fp32[token=64]" in res.stdout


def test_narrow_terminal_splits_columns_repeating_the_key():
    """At 60 columns a wide table becomes several, each starting with the key column."""
    res = CliRunner().invoke(main, ["explain", str(LLAMA)], env={"COLUMNS": "60"})
    parts = re.findall(r"Regions \(32, per-layer runs collapsed into 1 row\)\s*\[(\d)/(\d)\]", res.stdout)
    assert len(parts) >= 3 and all(total == parts[0][1] for _, total in parts)
    assert res.stdout.count("layer.{0..31}") >= len(parts)


def test_vertical_when_even_two_columns_do_not_fit():
    """A width where the key and one more column cannot stand side by side prints one block per row."""
    from kvlc.explain.terminal import TableData
    from kvlc.explain.terminal import console, print_table
    con = console(30)
    con.file = StringIO()
    t = TableData("t", ("region", "bytes"), (False, True),
                  (("layer.{0..31}", "8 GiB (8,589,934,592)"),))
    print_table(t, con)
    out = con.file.getvalue()
    assert "8 GiB (8,589,934,592)" in out and "layer.{0..31}" in out and "┃" not in out


def test_pair_table_fits_the_terminal():
    """`kvlc pair` at 60 columns: the program table fits and its numbers show whole."""
    res = CliRunner().invoke(main, ["pair", str(ROOT / "layouts" / "llama-3.1-70b-tp8.yaml"),
                                    str(ROOT / "layouts" / "llama-3.1-70b-tp4.yaml")], env={"COLUMNS": "60"})
    assert res.exit_code == 0
    assert all(len(line) <= 60 for line in res.stdout.split("\n"))
    assert "2,560" in res.stdout and "655,360" in res.stdout


def test_explain_size_pair_pages_need_no_torch_or_nixl(tmp_path):
    """explain (tables, --json, --html), size, pair --html and schema run with torch and nixl unimportable."""
    import subprocess
    import sys
    blocker = ("import sys\nclass B:\n    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] in ('torch', 'nixl'):\n            raise ImportError(name)\n"
               "sys.meta_path.insert(0, B())\nfrom click.testing import CliRunner\nfrom kvlc.cli import main\n")
    calls = [["explain", "layouts/deepseek-v3-tp8.yaml", "--json"],
             ["explain", "layouts/deepseek-v3-tp8.yaml", "--html", str(tmp_path / "a.html")],
             ["size", "layouts/llama-3.1-70b-hnd-tp4.yaml", "--peer", "layouts/llama-3.1-70b-hnd-tp8.yaml",
              "--tokens", "100"],
             ["pair", "layouts/llama-3.1-70b-hnd-tp8.yaml", "layouts/llama-3.1-70b-hnd-tp4.yaml",
              "--html", str(tmp_path / "p.html")],
             ["schema"]]
    code = blocker + "".join(f"r = CliRunner().invoke(main, {c!r})\nassert r.exit_code == 0, r.output\n"
                             for c in calls) + "print('ok')\n"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# ---------------------------------------------------------------- fitting, over random tables
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_word = st.text(alphabet="abcdefgh=.,{}0123456789 ", min_size=0, max_size=40)
_num = st.integers(min_value=0, max_value=10**15).map(lambda n: f"{n:,}")


@st.composite
def _tables(draw):
    from kvlc.explain.terminal import TableData
    ncols = draw(st.integers(2, 9))
    numeric = (False,) + tuple(draw(st.booleans()) for _ in range(ncols - 1))
    headers = tuple(draw(st.text(alphabet="abc /", min_size=1, max_size=14)).strip() or "h" for _ in range(ncols))
    nrows = draw(st.integers(1, 4))
    rows = tuple(tuple(draw(_num) if num else draw(_word) for num in numeric) for _ in range(nrows))
    return TableData("random", headers, numeric, rows)


@settings(max_examples=150, deadline=None)
@given(_tables(), st.integers(20, 200))
def test_fit_chunks_fit_and_keep_every_column(t, width):
    """Every chunk of fit() fits the width, starts with the key column, and the chunks hold every column once."""
    from kvlc.explain.terminal import _columns, _overhead, fit
    chunks = fit(t, width)
    if chunks is None:              # vertical: only when the key and some column cannot stand together
        cols = _columns(t)
        assert any(cols[0].least + c.least + _overhead(2) > width for c in cols[1:])
        return
    assert all(c[0][0] == 0 for c in chunks)
    assert sorted(i for c in chunks for i, _ in c[1:]) == list(range(1, len(t.columns)))
    for c in chunks:
        assert sum(w for _, w in c) + _overhead(len(c)) <= width


@settings(max_examples=150, deadline=None)
@given(_tables(), st.integers(20, 200))
def test_printed_tables_keep_numbers_whole(t, width):
    """Whatever the width, each numeric cell shows up whole in the printed output."""
    from kvlc.explain.terminal import console, print_table
    con = console(width)
    con.file = StringIO()
    print_table(t, con)
    out = con.file.getvalue()
    for row in t.rows:
        for cell, num in zip(row, t.numeric):
            if num:
                assert cell in out


@st.composite
def _fields(draw):
    from kvlc.compiler.plan.model import PlanDim, PlanField
    order = draw(st.permutations(["token", "head", "head_dim", "kv"]))
    names = list(order[:draw(st.integers(2, 4))])
    if "head" not in names:
        names.insert(draw(st.integers(0, len(names))), "head")
    sizes = [draw(st.integers(1, 5)) for _ in names]
    itemsize = draw(st.sampled_from([1, 2, 4]))
    strides, acc = [], itemsize
    for s in reversed(sizes):
        strides.append(acc)
        acc *= s
    strides.reverse()
    dims = tuple(PlanDim(name=n, role=n if n in ("token", "head") else "", size=s, global_size=s, stride=st_)
                 for n, s, st_ in zip(names, sizes, strides))
    return PlanField(name="f", dtype="x", itemsize=itemsize, offset=draw(st.integers(0, 64)), dims=dims)


@settings(max_examples=200, deadline=None)
@given(_fields())
def test_slice_runs_are_exactly_the_bytes_of_head_0(f):
    """The darker runs of a block map cover exactly the bytes whose head index is 0, merged to the minimum."""
    from itertools import product

    from kvlc.explain.blocks import slice_runs
    hi = [i for i, d in enumerate(f.dims) if d.role == "head"][0]
    want = set()
    for idx in product(*(range(d.size) for d in f.dims)):
        if idx[hi] == 0:
            start = f.offset + sum(k * d.stride for k, d in zip(idx, f.dims))
            want.update(range(start, start + f.itemsize))
    runs = slice_runs(f, "head")
    got = [b for a, n in runs for b in range(a, a + n)]
    assert sorted(got) == sorted(want) and len(got) == len(want)           # exactly those bytes, once each
    assert all(a + n < b for (a, n), (b, _) in zip(runs, runs[1:]))        # sorted, none adjacent: minimal
