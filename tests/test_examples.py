"""examples/ run as written: the two-agent CPU example moves and checks real bytes; the vLLM one parses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_two_agents_cpu_moves_and_checks_bytes():
    """examples/two_agents_cpu.py exits 0: a pull and a push between two real agents, every byte equal."""
    pytest.importorskip("torch", reason="the example allocates torch tensors")
    pytest.importorskip("nixl", reason="the example moves bytes through NIXL (UCX)")
    r = _run(str(EXAMPLES / "two_agents_cpu.py"), timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    lines = r.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["pull-1", "push-1"]
    assert all(ln.endswith(": ok") for ln in lines), r.stdout


def test_vllm_example_help():
    """examples/vllm_prefill_decode.py states its two roles without starting vLLM (tests/engines runs it)."""
    r = _run(str(EXAMPLES / "vllm_prefill_decode.py"), "--help", timeout=60)
    assert r.returncode == 0 and "{prefill,decode}" in r.stdout, r.stderr[-2000:]
