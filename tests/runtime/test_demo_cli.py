"""``kvlc demo`` as a newcomer runs it: from any directory, every option checked before engines start
(exit 2 with a clear message), the pair checked first, the time split and exactly what was verified."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.runtime
ROOT = Path(__file__).resolve().parents[2]


def _demo(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "kvlc.cli", "demo", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, says", [
    (["--pool-mib", "0"], "--pool-mib 0: give at least 1"),
    (["--requests", "0"], "--requests 0: give at least 1"),
    (["--requests", "-3"], "--requests -3: give at least 1"),
    (["--tokens", "10000000"], "tokens 10000000"),
    (["--tokens", "0"], "tokens 0"),
    (["--batch", "0"], "'--batch': 0 is not in the range"),
    (["--timeout", "0"], "'--timeout': 0.0 is not in the range"),
    (["--start-timeout", "-1"], "'--start-timeout': -1.0 is not in the range"),
])
def test_bad_options_exit_2_with_a_clear_message(tmp_path, args, says):
    """Every bad option is refused before any engine starts: exit 2, the option named, no traceback."""
    out = _demo(*args, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert says in out.stderr and "Traceback" not in out.stderr + out.stdout
    assert "kvlc demo:" not in out.stdout  # nothing started


def test_a_slow_start_ends_with_one_line_naming_the_setting(tmp_path):
    """Engines that cannot start within --start-timeout (here: far too short for any machine) end the
    demo with one line that says what took too long and which option to raise, never a traceback."""
    pytest.importorskip("nixl")
    out = _demo("--requests", "1", "--pool-mib", "2", "--start-timeout", "0.01", cwd=tmp_path)
    assert out.returncode != 0
    assert "while the engines started" in out.stderr and "--start-timeout (now 0.01 s)" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout


def test_incompatible_pair_exits_2_with_the_report_before_engines_start(tmp_path):
    """A pair that cannot exchange bytes prints the pairing report and exits 2 without starting engines."""
    t0 = time.monotonic()
    out = _demo(str(ROOT / "layouts" / "llama-3.1-8b.yaml"), "--consumer",
                str(ROOT / "tests" / "runtime" / "layouts" / "hybrid-tp1.yaml"), cwd=tmp_path)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "error" in out.stderr and "Traceback" not in out.stderr
    assert "kvlc demo:" not in out.stdout
    assert time.monotonic() - t0 < 120


def test_demo_runs_from_any_directory_and_says_what_it_verified(tmp_path):
    """From a folder that is not the repository, the default layout is found; the output splits start-up,
    transfer and verification time and says exactly how many requests and bytes were verified."""
    pytest.importorskip("nixl")
    out = _demo("--requests", "3", "--pool-mib", "2", "--check", "first", cwd=tmp_path)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-2000:])
    text = out.stdout
    for what in ("start-up", "transfer time", "verification time", "requests verified", "bytes verified"):
        assert what in text
    assert "of 3 requests verified" in text and "every byte of all" not in text


def test_missing_extras_are_named_with_the_install_command(monkeypatch, capsys):
    """Without msgpack (or torch, nixl, rich) the demo says which are missing and how to install them."""
    import importlib.util

    from kvlc.cli import run_cmds

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "msgpack" else real(name, *a))
    with pytest.raises(SystemExit) as exc:
        run_cmds._demo_needs_extras()
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "missing: msgpack" in err and "pip install 'kvlc[runtime]'" in err


def test_demo_json_is_one_document_with_what_was_verified(tmp_path):
    """``--json`` prints one JSON document (no progress display): counts, times, bytes verified, ok
    (here the two requests move as one batch: ``--batch 2``)."""
    import json

    pytest.importorskip("nixl")
    out = _demo("--requests", "2", "--pool-mib", "2", "--batch", "2", "--json", cwd=tmp_path)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-2000:])
    doc = json.loads(out.stdout)
    assert doc["ok"] is True and doc["requests"] == 2 and doc["verified_requests"] == 2
    assert doc["checked_bytes"] > 0 and doc["mismatches"] == [] and doc["failed"] == {}
    assert doc["startup_seconds"] > 0 and doc["nbytes"] > 0 and doc["descriptors_per_request"] > 0
