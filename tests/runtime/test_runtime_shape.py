"""The runtime's shape: its docstring examples run, its public names are the product only, modules stay
small, and it does no layout arithmetic (descriptors come from the compiler's program)."""

from __future__ import annotations

import doctest
import importlib
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "kvlc" / "runtime"
MODULES = ["kvlc.runtime.kinds", "kvlc.runtime.channel.auth", "kvlc.runtime.channel.tcp", "kvlc.runtime.channel.wire",
           "kvlc.runtime.nixl.core", "kvlc.demo.procs", "kvlc.demo.run"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    """Every ``>>>`` example in the module's docstrings gives the output it shows."""
    module = importlib.import_module(name)
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    finally:
        os.chdir(cwd)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def test_public_names_are_the_product():
    """kvlc.runtime exports the agent API only: no demo, harness or test helpers."""
    import kvlc.runtime as rt

    for name in rt.__all__:
        assert hasattr(rt, name)
        obj = getattr(rt, name)
        assert not getattr(obj, "__module__", "").startswith("kvlc.demo"), name
    assert not {"run_demo", "cpu_plan", "scaled_plan", "DemoResult", "EngineProcess"} & set(rt.__all__)


def test_modules_do_no_layout_arithmetic():
    """No runtime module computes block addresses (that is the compiler's); modules are split by concern,
    not by a line cap (tests/test_import_contract.py and tests/test_complexity.py state the shape)."""
    for path in RUNTIME.rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"block_bytes\s*\*|\* *block_bytes|kernel_block_size\s*\*", text), path.name


def test_importing_the_runtime_changes_no_environment():
    """Importing kvlc.runtime (and its NIXL wrapper) leaves os.environ as it was."""
    import subprocess
    import sys

    code = ("import os; before = dict(os.environ); import kvlc.runtime, kvlc.runtime.nixl.core; "
            "assert dict(os.environ) == before, set(os.environ) ^ set(before)")
    env = {k: v for k, v in os.environ.items() if k != "NIXL_LOG_LEVEL"}
    env["PYTHONPATH"] = str(ROOT)
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
