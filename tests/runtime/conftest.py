"""Fixtures shared by the multi-process runtime tests (helpers live in runtime_engines.py)."""

import importlib.util
import os
from pathlib import Path

import pytest
from runtime_engines import tiny_plans

KERNEL = Path(__file__).resolve().parents[2] / "kvlc" / "runtime" / "ipc" / "kernel.py"


@pytest.fixture(scope="module")
def plans():
    """The tiny dense plans x (TP1), y (TP2 HND) and z (the 256-block consumer), compiled once a module."""
    return tiny_plans()


@pytest.fixture(scope="module")
def interpreted():
    """kernel.py loaded with TRITON_INTERPRET=1 (its @jit then runs on the CPU), under another name."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        spec = importlib.util.spec_from_file_location("kvlc_ipc_kernel_interpreted", KERNEL)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    return mod
