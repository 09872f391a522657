"""The two commands of docs/vllm.md, run as a user runs them: a prefill engine, then a decode engine."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tests.engines.conftest import ROOT, prompt

pytestmark = pytest.mark.engine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_commands_prefill_then_decode(model_dir, tmp_path):
    """`serve prefill` answers with kv_transfer_params; `serve decode --check` decodes through kvlc and
    its tokens equal its own tokens without a transfer (exit 0, match true, KV loaded)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVLC_SECRET": "serve-test-secret-0123456789"}
    api = _free_port()
    log = open(tmp_path / "prefill.log", "w")
    pre = subprocess.Popen([sys.executable, "-m", "kvlc.engines.vllm.serve", "prefill", "--model", model_dir,
                            "--api-port", str(api), "--block-size", "64"],
                           env={**env, "VLLM_CPU_OMP_THREADS_BIND": "0"}, stdout=subprocess.PIPE,
                           stderr=log, text=True)
    try:
        deadline = time.monotonic() + 300
        line = ""
        while "ready" not in line:
            line = pre.stdout.readline()
            assert line or pre.poll() is None, (tmp_path / "prefill.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "prefill engine did not start"
        ids = ",".join(map(str, prompt(77, seed=21)))
        dec = subprocess.run([sys.executable, "-m", "kvlc.engines.vllm.serve", "decode", "--model", model_dir,
                              "--prefill", f"http://127.0.0.1:{api}", "--prompt", ids, "--max-tokens", "10",
                              "--check"], env={**env, "VLLM_CPU_OMP_THREADS_BIND": "1"},
                             capture_output=True, text=True, timeout=400)
        assert dec.returncode == 0, dec.stderr[-3000:]
        result = json.loads(dec.stdout.strip().splitlines()[-1])
        assert result["match"] and len(result["tokens"]) == 10
        assert result["kv_transfer_params"]["remote_num_tokens"] == 77
        assert "kvlc: rank 0 loads request" in dec.stderr
    finally:
        pre.kill()
        pre.wait(30)
        log.close()
