"""The runnable examples in public docstrings run and hold (compiler, pairing, explain)."""

import doctest
import importlib
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = ["kvlc.compiler", "kvlc.compiler.source", "kvlc.compiler.algebra", "kvlc.compiler.plan",
           "kvlc.compiler.pair", "kvlc.compiler.resolve", "kvlc.compiler.layout", "kvlc.compiler.fields",
           "kvlc.compiler.check", "kvlc.compiler.build", "kvlc.compiler.compat", "kvlc.compiler.tp",
           "kvlc.compiler.runs", "kvlc.compiler.program", "kvlc.compiler.request", "kvlc.compiler.rows",
           "kvlc.compiler.frozen", "kvlc.compiler.expand", "kvlc.compiler.index",
           "kvlc.compiler.instantiate", "kvlc.compiler.prepared", "kvlc.explain"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    """Every ``>>>`` example in the module's docstrings gives the output it shows."""
    module = importlib.import_module(name)
    cwd = os.getcwd()
    os.chdir(ROOT)  # examples name checked-in layouts relative to the repository root
    try:
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    finally:
        os.chdir(cwd)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
