"""Invalid specs → exact, located error messages (golden files).

Every ``tests/fixtures/invalid/NAME.yaml`` holds one deliberate problem; ``NAME.expected``
holds the exact lines kvlc prints for it, with file paths relative to the repository
root. Regenerate with ``KVLC_UPDATE_GOLDEN=1 pytest tests/test_invalid_specs.py`` and
review the diff: every line must say where (file:line:col and YAML path), what is wrong,
what was expected, what was found, and how to fix it where that is obvious.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

import kvlc
from kvlc.errors import SpecError

ROOT = Path(__file__).resolve().parents[1]
INVALID = ROOT / "tests" / "fixtures" / "invalid"
FIXTURES = sorted(INVALID.glob("*.yaml"))
UPDATE = os.environ.get("KVLC_UPDATE_GOLDEN") == "1"
LINE = re.compile(r"^tests/fixtures/invalid/[\w\-]+\.yaml:\d+:\d+: \S+: .+$")


def rendered(path: Path) -> tuple[SpecError, str]:
    """Compile ``path``; return the error and its rendered text with paths relative to the root."""
    with pytest.raises(SpecError) as info:
        kvlc.compile_spec(path)
    return info.value, info.value.render().replace(f"{ROOT}/", "") + "\n"


def test_enough_fixtures():
    """At least 35 invalid fixtures, each with a golden message and a one-line description."""
    assert len(FIXTURES) >= 35
    for path in FIXTURES:
        first = path.read_bytes().decode("utf-8", "replace").splitlines()[:1]
        assert first and first[0].startswith("# Invalid: "), f"{path.name}: describe the problem on line 1"
        assert UPDATE or path.with_suffix(".expected").exists(), f"{path.name}: no .expected golden"
    stray = {p.stem for p in INVALID.glob("*.expected")} - {p.stem for p in FIXTURES}
    assert not stray, f"golden files without a fixture: {sorted(stray)}"


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_invalid_spec_message(path: Path):
    """The spec is refused with exactly the golden lines (location, path, expected, found, fix)."""
    exc, text = rendered(path)
    golden = path.with_suffix(".expected")
    if UPDATE:
        golden.write_text(text)
    assert text == golden.read_text()


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_every_problem_is_located_and_explained(path: Path):
    """Each problem has a file mark and a YAML path, and says what was expected and what was found."""
    exc, text = rendered(path)
    assert 1 <= len(exc.problems) <= 2, "a fixture holds one deliberate problem (two fields at most)"
    for p in exc.problems:
        assert p.mark is not None and p.mark.line >= 1 and p.mark.col >= 1
        assert p.expected and p.found, f"{p}: say what was expected and what was found"
    for line in text.splitlines():
        assert LINE.match(line), line


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_marks_point_into_the_file(path: Path):
    """The line:col of every problem lies inside the fixture's text."""
    exc, _ = rendered(path)
    lines = path.read_bytes().decode("utf-8", "replace").splitlines() or [""]
    for p in exc.problems:
        assert p.mark.line <= len(lines) + 1
        if p.mark.line <= len(lines):
            assert p.mark.col <= len(lines[p.mark.line - 1]) + 1


def _interleaved(offset: int) -> str:
    text = (INVALID / "interleaved_regions_overlap.yaml").read_text()
    assert "    offset: 128\n" in text
    return text.replace("    offset: 128\n", f"    offset: {offset}\n")


@pytest.mark.parametrize("offset", [256, 512, 768])
def test_interleaved_regions_that_do_not_overlap_compile(offset: int):
    """Two regions of one stride whose blocks alternate without sharing a byte are valid."""
    plan = kvlc.compile_spec(_interleaved(offset))
    a, b = plan.regions
    assert a.block_stride == b.block_stride == 1024 and a.block_bytes == b.block_bytes == 256
    owner = np.zeros(max(a.end, b.end), dtype=np.int8)
    for r in (a, b):
        for i in range(r.num_blocks):
            start = r.offset + i * r.block_stride
            assert not owner[start:start + r.block_bytes].any(), f"{r.name} block {i} shares bytes"
            owner[start:start + r.block_bytes] = 1


@pytest.mark.parametrize("offset", [255, 769])
def test_interleaved_regions_one_byte_off_are_refused(offset: int):
    """Moving the interleaved region one byte into its neighbour's blocks is an overlap."""
    with pytest.raises(kvlc.CompileError, match="overlaps region 'layer.0'"):
        kvlc.compile_spec(_interleaved(offset))
