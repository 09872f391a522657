"""Cross-host tests share the multi-process runtime tests' helpers (tests/runtime/runtime_engines.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
