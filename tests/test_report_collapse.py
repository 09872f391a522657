"""Pairing reports read as one line per kind of problem, not one per expanded layer."""

from __future__ import annotations

from pathlib import Path

import kvlc

ROOT = Path(__file__).resolve().parents[1]


def test_region_missing_collapses_to_one_line_with_the_layer_set_and_count():
    """8B (32 layers) against 70B (80 layers): 48 region-missing findings render as one line."""
    report = kvlc.check_pair(kvlc.compile_spec(ROOT / "layouts/llama-3.1-8b.yaml"),
                             kvlc.compile_spec(ROOT / "layouts/llama-3.1-70b-tp8.yaml"),
                             local_rank=0, direction="READ")
    missing = [f for f in report.findings if f.code == "region-missing"]
    assert len(missing) == 48                       # the data keeps every finding
    lines = [line for line in report.render().splitlines() if "[region-missing]" in line]
    assert lines == [lines[0]] and "layer.{32..79}" in lines[0] and "(48 alike)" in lines[0]
    err = [line for line in report.render_errors().splitlines() if "[region-missing]" in line]
    assert err == lines


def test_distinct_findings_stay_separate():
    """Findings whose words differ are never merged, whatever their numbers."""
    from kvlc.collapse import collapse_lines
    assert collapse_lines(["error [a] layer.1: x", "error [b] layer.2: x"]) == ["error [a] layer.1: x",
                                                                             "error [b] layer.2: x"]
