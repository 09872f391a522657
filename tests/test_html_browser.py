"""The pages of `kvlc explain --html` and `kvlc pair --html`, laid out by a real headless browser.

Chromium (the Debian package `chromium`) loads each page; a test-only script measures the
drawn elements after layout and appends them as JSON, read back with `--dump-dom`. The tests
assert on that geometry — what a user sees — and that a screenshot exists and is not blank.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvlc.cli import main

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ROOT / "layouts"
MEASURE = (Path(__file__).parent / "browser" / "measure.js").read_text()
BROWSER = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
WINDOW = (1400, 1800)

pytestmark = pytest.mark.skipif(BROWSER is None, reason="needs chromium: apt-get install -y chromium")


def _chromium(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    cmd = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
           "--disable-extensions", f"--window-size={WINDOW[0]},{WINDOW[1]}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True)


def _measure(page: Path) -> dict:
    probe = page.with_name(page.stem + ".probe.html")
    probe.write_text(page.read_text().replace("</body>", f"<script>{MEASURE}</script>\n</body>"))
    dom = _chromium("--virtual-time-budget=3000", "--dump-dom", probe.as_uri()).stdout
    found = re.search(r'<pre id="kvlc-geometry">(.*?)</pre>', dom, flags=re.S)
    assert found, "the measuring script did not run"
    return json.loads(html.unescape(found.group(1)))


def _explain(tmp_path_factory, layout: str) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("html") / f"{layout}.html"
    res = CliRunner().invoke(main, ["explain", str(LAYOUTS / f"{layout}.yaml"), "--html", str(out)])
    assert res.exit_code == 0, res.output
    return out, _measure(out)


def _pair(tmp_path_factory, producer: str, consumer: str, *args: str) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("html") / f"{producer}--{consumer}.html"
    res = CliRunner().invoke(main, ["pair", str(LAYOUTS / f"{producer}.yaml"), str(LAYOUTS / f"{consumer}.yaml"),
                                    "--html", str(out), *args])
    assert res.exit_code == 0, res.output
    return out, _measure(out)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _explain(tmp_path_factory, "llama-3.1-8b")


@pytest.fixture(scope="module")
def hnd(tmp_path_factory):
    return _explain(tmp_path_factory, "llama-3.1-70b-hnd-tp4")


@pytest.fixture(scope="module")
def hisparse(tmp_path_factory):
    return _explain(tmp_path_factory, "deepseek-v3.2-hisparse-tp8")


@pytest.fixture(scope="module")
def pair_hnd(tmp_path_factory):
    return _pair(tmp_path_factory, "llama-3.1-70b-hnd-tp8", "llama-3.1-70b-hnd-tp4")


def _close(a: float, b: float, tol: float = 1.0) -> bool:
    return abs(a - b) <= tol


# ---------------------------------------------------------------- explain
def test_identical_storages_drawn_once(llama):
    """Llama's 32 equal per-layer storages are one bar marked x32, not 32 bars."""
    _, g = llama
    assert [(s["name"], s["count"]) for s in g["storages"]] == [("kv.{0..31}", 32)]
    assert "x32" in g["storages"][0]["label"]
    assert [r["label"] for r in g["regions"]] == ["layer.{0..31}"]
    bar, region = g["storages"][0]["bar"], g["regions"][0]["box"]
    assert region["w"] > 0.95 * bar["w"]                      # the region fills its storage


def test_block_map_places_v_at_its_offset(llama):
    """One block of Llama: k at byte 0, v at byte 32,768 = half of the 65,536-byte block, to scale."""
    _, g = llama
    (block,) = g["blocks"]
    assert block["bytes"] == 65536
    k, v = block["fields"]
    bar = block["bar"]
    assert (k["name"], v["name"]) == ("k", "v")
    assert _close(k["box"]["x"], bar["x"]) and _close(v["box"]["x"], bar["x"] + bar["w"] / 2)
    assert _close(k["box"]["w"], bar["w"] / 2) and _close(v["box"]["w"], bar["w"] / 2)


def test_nhd_and_hnd_blocks_look_different(llama, hnd):
    """Token-major (NHD): head 0 is 16 separate strips across the field; head-major (HND): one solid run."""
    nhd_k = llama[1]["blocks"][0]["fields"][0]
    hnd_k = hnd[1]["blocks"][0]["fields"][0]
    assert nhd_k["order"] == "token x head x head_dim" and hnd_k["order"] == "head x token x head_dim"
    xs = [s["x"] for s in nhd_k["slices"]]
    assert len(xs) == 16 and xs == sorted(xs)
    gaps = [b - a for a, b in zip(xs, xs[1:])]
    assert all(_close(gap, nhd_k["box"]["w"] / 16) for gap in gaps)          # one strip per token
    assert all(s["w"] < nhd_k["box"]["w"] / 16 for s in nhd_k["slices"])      # 1 of 8 heads of each token
    (run,) = hnd_k["slices"]
    assert _close(run["x"], hnd_k["box"]["x"]) and _close(run["w"], hnd_k["box"]["w"] / 2)  # head 0 of 2
    notes = " ".join(n["text"] for n in nhd_k["notes"] + hnd_k["notes"])
    assert "16 runs" in notes and "1 run" in notes


def test_one_scale_per_memory_type(hisparse):
    """A 17 GiB DRAM storage and the 2 GiB VRAM indexer each fill their own map: the indexer stays visible."""
    _, g = hisparse
    assert sorted(m["mem"] for m in g["maps"]) == ["DRAM", "VRAM"]
    bars = {s["map"]: s["bar"] for s in g["storages"]}
    assert _close(bars["DRAM"]["w"], bars["VRAM"]["w"])                     # each the width of its scale
    indexer = [r for r in g["regions"] if r["map"] == "VRAM"]
    assert indexer and sum(r["box"]["w"] for r in indexer) > 0.9 * bars["VRAM"]["w"]
    assert {r["label"] for r in indexer} == {"layer.{0..60}.indexer"}


def test_replication_is_shown(hisparse):
    """The MLA latent and the indexer (no head dim) are marked as held by all 8 ranks, in drawn text."""
    _, g = hisparse
    fields = {f["name"]: f for b in g["blocks"] for f in b["fields"]}
    assert fields["latent"]["replicas"] == 8 and fields["k"]["replicas"] == 8
    texts = [n["text"] for n in fields["latent"]["notes"]]
    assert any("x8 ranks" in t for t in texts)
    assert all(n["box"]["w"] > 0 for n in fields["latent"]["notes"])


def test_field_notes_stay_inside_the_drawing(hisparse, llama, hnd):
    """No label under a field runs past the right edge of its block bar."""
    for _, g in (hisparse, llama, hnd):
        for b in g["blocks"]:
            right = b["bar"]["x"] + b["bar"]["w"]
            for f in b["fields"]:
                for n in f["notes"]:
                    assert n["box"]["x"] + n["box"]["w"] <= right + 12, (f["name"], n["text"])


@pytest.fixture(scope="module")
def mamba(tmp_path_factory):
    return _explain(tmp_path_factory, "nemotron-h-8b-tp2")


def test_field_notes_never_overlap(mamba, llama):
    """Labels of narrow neighbouring fields (Mamba conv sections) are stacked, never drawn over each other."""
    for _, g in (mamba, llama):
        for b in g["blocks"]:
            boxes = [(f["name"], n["box"]) for f in b["fields"] for n in f["notes"]]
            for i, (fa, a) in enumerate(boxes):
                for fc, c in boxes[i + 1:]:
                    if fa == fc:
                        continue          # the lines of one field's note sit on top of each other by design
                    apart = (a["x"] + a["w"] <= c["x"] + 1.5 or c["x"] + c["w"] <= a["x"] + 1.5
                             or a["y"] + a["h"] <= c["y"] + 1.5 or c["y"] + c["h"] <= a["y"] + 1.5)
                    assert apart, (b["regions"], fa, a, fc, c)
    names = {n["text"].split(":")[0] for b in mamba[1]["blocks"] for f in b["fields"] for n in f["notes"]}
    assert {"conv.x", "conv.B", "conv.C", "ssm", "k", "v"} <= names


# ---------------------------------------------------------------- pair
def test_pair_draws_which_consumer_rank_reads_which_heads(pair_hnd):
    """TP8 -> TP4: consumer rank c takes heads 2c and 2c+1 from producer ranks 2c and 2c+1, bands joining them."""
    _, g = pair_hnd
    ranks = {(r["side"], r["rank"]): r for r in g["ranks"]}
    assert len([k for k in ranks if k[0] == "producer"]) == 8 and len([k for k in ranks if k[0] == "consumer"]) == 4
    assert sorted((b["c"], b["p"], b["h0"], b["h1"]) for b in g["bands"]) == [
        (c, p, p, p + 1) for c in range(4) for p in (2 * c, 2 * c + 1)]
    for b in g["bands"]:
        prod, cons = ranks[("producer", b["p"])]["box"], ranks[("consumer", b["c"])]["box"]
        box = b["box"]
        assert _close(box["y"], prod["y"] + prod["h"], 2) and _close(box["y"] + box["h"], cons["y"], 2)
        assert box["x"] >= min(prod["x"], cons["x"]) - 1
        assert box["x"] + box["w"] <= max(prod["x"] + prod["w"], cons["x"] + cons["w"]) + 1


def test_pair_draws_the_descriptors_of_one_block(pair_hnd):
    """Consumer rank 0 of the HND pair: 2 runs (k, v) from each of 2 peers that tile its block exactly."""
    _, g = pair_hnd
    assert [(p["peer"], p["runs"]) for p in g["peers"]] == [(0, 2), (1, 2)]
    (local,) = g["local"]
    runs = sorted(g["lruns"], key=lambda r: r["box"]["x"])
    assert [(r["peer"], r["field"]) for r in runs] == [(0, "k"), (1, "k"), (0, "v"), (1, "v")]
    assert _close(sum(r["box"]["w"] for r in runs), local["w"], 2)
    for a, b in zip(runs, runs[1:]):
        assert a["box"]["x"] + a["box"]["w"] <= b["box"]["x"] + 1                   # no overlap
    peers = {p["peer"]: p["box"] for p in g["peers"]}
    for r in g["rruns"]:
        inside = peers[r["peer"]]
        assert inside["x"] - 1 <= r["box"]["x"] and r["box"]["x"] + r["box"]["w"] <= inside["x"] + inside["w"] + 1


# ---------------------------------------------------------------- screenshots
@pytest.mark.parametrize("which", ["llama", "pair_hnd"])
def test_screenshot_is_not_blank(which, request, tmp_path):
    """A screenshot of the page exists, has the window's size and shows a picture, not a blank page."""
    from PIL import Image
    page, _ = request.getfixturevalue(which)
    png = tmp_path / f"{which}.png"
    _chromium(f"--screenshot={png}", page.as_uri())
    assert png.exists() and png.stat().st_size > 10_000
    img = Image.open(png).convert("RGB")
    assert img.size == WINDOW
    small = img.resize((140, 180))
    pixels = [small.getpixel((x, y)) for y in range(small.height) for x in range(small.width)]
    white = sum(1 for p in pixels if min(p) > 245)
    assert len(set(pixels)) > 50 and white < 0.9 * len(pixels)
