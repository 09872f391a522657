"""The runnable examples in public docstrings run and hold (compiler, pairing, explain)."""

import doctest
import importlib
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = ["kvlc.compiler", "kvlc.compiler.spec.source", "kvlc.compiler.algebra.copies", "kvlc.compiler.plan.model",
           "kvlc.compiler.pairing.pair", "kvlc.compiler.plan.resolve", "kvlc.compiler.algebra.layout", "kvlc.compiler.plan.fields",
           "kvlc.compiler.plan.check", "kvlc.compiler.plan.build", "kvlc.compiler.pairing.compat", "kvlc.compiler.pairing.tp",
           "kvlc.compiler.pairing.runs", "kvlc.compiler.pairing.program", "kvlc.compiler.request.check", "kvlc.compiler.request.rows",
           "kvlc.compiler.frozen", "kvlc.compiler.plan.expand", "kvlc.compiler.request.index",
           "kvlc.compiler.request.instantiate", "kvlc.compiler.request.prepared", "kvlc.compiler.request.bind",
           "kvlc.compiler.request.rules", "kvlc.compiler.request.tokens", "kvlc.compiler.request.windows",
           "kvlc.explain", "kvlc.explain.docs", "kvlc.errors"]


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
