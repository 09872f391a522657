"""Golden plan text: compiling each checked-in layout gives exactly tests/golden/plans/<stem>.txt.

Run with KVLC_UPDATE_GOLDEN=1 to rewrite the golden files after an intended change, then review
the diff (`git diff tests/golden/plans`).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

import kvlc

ROOT = Path(__file__).resolve().parents[1]
SPECS = sorted((ROOT / "layouts").glob("*.yaml"))
GOLDEN = ROOT / "tests" / "golden" / "plans"
UPDATE = os.environ.get("KVLC_UPDATE_GOLDEN") == "1"


def _diff(expected: str, actual: str, name: str, limit: int = 40) -> str:
    lines = list(difflib.unified_diff(expected.splitlines(), actual.splitlines(),
                                      f"golden/{name}", "compiled", lineterm="", n=0))
    more = f"\n... and {len(lines) - limit} more diff lines" if len(lines) > limit else ""
    return "\n".join(lines[:limit]) + more


@pytest.mark.parametrize("spec", SPECS, ids=lambda p: p.stem)
def test_plan_text_matches_golden(spec):
    """plan.text() of layouts/<stem>.yaml equals tests/golden/plans/<stem>.txt byte for byte."""
    text = kvlc.compile_spec(spec).text()
    golden = GOLDEN / f"{spec.stem}.txt"
    if UPDATE:
        GOLDEN.mkdir(parents=True, exist_ok=True)
        if not golden.exists() or golden.read_text() != text:
            golden.write_text(text)
        return
    assert golden.exists(), f"no golden plan for {spec.name}; run with KVLC_UPDATE_GOLDEN=1"
    expected = golden.read_text()
    assert expected == text, _diff(expected, text, golden.name)


def test_every_golden_has_a_layout():
    """Every golden plan file belongs to a checked-in layout (no stale goldens)."""
    stale = sorted(p.name for p in GOLDEN.glob("*.txt") if not (ROOT / "layouts" / f"{p.stem}.yaml").exists())
    assert not stale, f"golden plans without a layout: {stale}"
