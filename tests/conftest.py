"""The suite's two lanes under pytest-xdist (README's test command: ``-n 2 --dist loadgroup``), and the width
its commands print at.

Lane ``crosshost`` (tests/crosshost/) runs on one worker: its tests spend most of their time waiting on
links that are slowed, cut or down, so they cost the other lane little CPU. Every other test is lane
``main`` and runs on the other worker one after another in the order it is written, as without xdist:
vLLM engines hold CPU cores and are started once per module, runtime tests time deadlines and SIGSTOPs,
and compiler tests next to them would only slow both down on a two-core machine (measured 2026-12-07:
the compiler tests spread over both workers beside the engine tests took the suite from 1,436 s to only
1,331 s, a random-pairs property test from 25 s to 90 s). Without xdist (``pytest tests/test_x.py``) the
groups are plain markers and change nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SIDE_LANES = {"crosshost": "crosshost"}  # folder under tests/ -> its lane; everything else: "main"


def lane(path: Path) -> str:
    """The lane of a test file."""
    rel = path.resolve().relative_to(HERE)
    return SIDE_LANES.get(rel.parts[0], "main") if len(rel.parts) > 1 else "main"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(lane(item.path)))


@pytest.fixture(autouse=True)
def _piped_width(monkeypatch):
    """Commands print at the width of piped output (no ``$COLUMNS``), whatever the shell or an xdist worker
    (whose environment has ``COLUMNS=80``) exported; a test that wants a width sets it itself."""
    monkeypatch.delenv("COLUMNS", raising=False)
