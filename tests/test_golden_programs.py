"""Golden transfer programs for the checked-in layout pairs (layouts/pairs/pairs.yaml).

Each pair is paired as a pull (consumer rank 0 READs) and as a push (producer
rank 0 WRITEs); the program's text form must equal the checked-in fixture.
Regenerate with KVLC_UPDATE_GOLDEN=1 and review the diff.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest
import yaml

import kvlc
from kvlc.compiler.pairing.pair import pair

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "programs"
PAIRS = yaml.safe_load((ROOT / "layouts" / "pairs" / "pairs.yaml").read_text())["pairs"]
UPDATE = os.environ.get("KVLC_UPDATE_GOLDEN") == "1"

_plans: dict = {}


def plan(name: str):
    if name not in _plans:
        _plans[name] = kvlc.compile_spec(ROOT / "layouts" / name)
    return _plans[name]


def _compare(path: Path, text: str) -> None:
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"missing golden file {path}; run with KVLC_UPDATE_GOLDEN=1"
    want = path.read_text()
    if want != text:
        diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True),
                                            str(path), "generated", n=1))
        pytest.fail(f"program differs from {path.name}:\n{diff[:4000]}")


@pytest.mark.parametrize("entry", PAIRS, ids=[p["name"] for p in PAIRS])
def test_pull_program_matches_golden(entry):
    """The consumer-rank-0 pull program of each checked-in pair equals its golden text."""
    prog = pair(plan(entry["consumer"]), plan(entry["producer"]), local_rank=0, direction="READ")
    _compare(GOLDEN / f"{entry['name']}.pull.txt", prog.text())


@pytest.mark.parametrize("entry", PAIRS, ids=[p["name"] for p in PAIRS])
def test_push_program_matches_golden(entry):
    """The producer-rank-0 push program of each checked-in pair equals its golden text."""
    prog = pair(plan(entry["producer"]), plan(entry["consumer"]), local_rank=0, direction="WRITE")
    _compare(GOLDEN / f"{entry['name']}.push.txt", prog.text())


def test_pairs_cover_the_issue_cases():
    """The pair list holds the cases the design promises: TP both ways, MLA, Mamba, block sizes, mixed memory."""
    names = {p["name"] for p in PAIRS}
    for need in ("llama70b-tp8-to-tp4", "llama70b-tp4-to-tp8", "deepseek-v3-tp8-to-tp1",
                 "nemotron-h-tp4-to-tp2", "gemma3-b16-to-b32", "deepseek-v3.2-to-hisparse"):
        assert need in names
    mixed = pair(plan("deepseek-v3.2-hisparse-tp8.yaml"), plan("deepseek-v3.2-tp8.yaml"),
                 local_rank=0, direction="READ")
    assert {(k.local_mem, k.remote_mem) for k in mixed.part_keys} == {("DRAM", "VRAM"), ("VRAM", "VRAM")}
