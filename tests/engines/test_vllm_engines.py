"""The engine harness notices a dead engine at once, instead of waiting out a generate's timeout."""

from __future__ import annotations

import os
import signal
import time

import pytest

from testkit.vllm_engines import EngineDied, EngineProcess, EngineSpec
from tests.engines.conftest import engine_env

pytestmark = pytest.mark.engine


def test_a_dead_engine_is_seen_at_once(tmp_path, model_dir):
    spec = EngineSpec(model=model_dir, env=engine_env(0))
    eng = EngineProcess(spec, log_path=tmp_path / "engine.log").start()
    try:
        time.sleep(1.0)  # the child is importing; it dies before it can answer
        os.kill(eng.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDied, match=r"died \(exit code -9\)"):
            eng.wait_ready(timeout=120)
        assert time.monotonic() - t0 < 10
    finally:
        eng.kill()
