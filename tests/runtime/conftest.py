"""Fixtures shared by the multi-process runtime tests (helpers live in runtime_engines.py)."""

import pytest
from runtime_engines import tiny_plans


@pytest.fixture(scope="module")
def plans():
    """The tiny dense plans x (TP1), y (TP2 HND) and z (the 256-block consumer), compiled once a module."""
    return tiny_plans()
