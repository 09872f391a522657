"""The two commands of docs/vllm.md (examples/vllm_prefill_decode.py), run as a user runs them: a prefill
engine, then a decode engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.engines.conftest import ROOT, Run
from testkit.openai_servers import free_port, refused_urls

pytestmark = pytest.mark.engine
EXAMPLE = str(ROOT / "examples" / "vllm_prefill_decode.py")


def test_two_commands_prefill_then_decode(model_dir, tmp_path):
    """`prefill` answers with kv_transfer_params; `decode --check` decodes through kvlc and
    its tokens equal its own tokens without a transfer (exit 0, match true, KV loaded)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVLC_SECRET": "serve-test-secret-0123456789"}
    api = free_port()
    out_path = tmp_path / "prefill.log"
    log = open(out_path, "w")  # a file, not a pipe: vLLM logs to stdout and would block a full pipe
    pre = subprocess.Popen([sys.executable, EXAMPLE, "prefill", "--model", model_dir,
                            "--api-port", str(api), "--block-size", "64"],
                           env={**env, "VLLM_CPU_OMP_THREADS_BIND": "0"},
                           stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while "kvlc prefill engine ready:" not in out_path.read_text(errors="replace"):
            assert pre.poll() is None, out_path.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "prefill engine did not start"
            time.sleep(0.5)
        dec = subprocess.run([sys.executable, EXAMPLE, "decode", "--model", model_dir,
                              "--prefill", f"http://127.0.0.1:{api}", "--prompt-tokens", "200", "--max-tokens",
                              "10", "--check"], env={**env, "VLLM_CPU_OMP_THREADS_BIND": "1"},
                             capture_output=True, text=True, timeout=400)
        both = dec.stdout + dec.stderr  # vLLM logs to stdout; the result is the JSON line
        assert dec.returncode == 0, both[-3000:]
        result = json.loads([ln for ln in dec.stdout.splitlines() if ln.startswith("{")][-1])
        assert result["match"] and len(result["tokens"]) == 10
        assert result["kv_transfer_params"]["remote_num_tokens"] == 200
        assert "kvlc: rank 0 loads request" in both and "(tokens [0, 200)" in both   # 4 prefill blocks of 64
    finally:
        pre.kill()
        pre.wait(30)
        log.close()


@pytest.fixture(scope="module", autouse=True)
def lonely_decode(model_dir, tmp_path_factory):
    """The decode command with no prefill engine behind the URL, started with the module: its engine starts
    (one core) while the first test's prefill engine does (the other core). The URL's port stays bound,
    never listened on, until it ends: no engine of the other test can take it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVLC_SECRET": "serve-test-secret-0123456789",
           "VLLM_CPU_OMP_THREADS_BIND": "1"}
    with refused_urls() as (url,):
        run = Run([sys.executable, EXAMPLE, "decode", "--model", model_dir, "--prefill", url,
                   "--prompt-tokens", "40", "--timeout", "3"], tmp_path_factory.mktemp("lonely-decode"), env)
        try:
            yield run
        finally:
            run.close()


def test_serve_decode_without_a_prefill_engine_says_so_in_one_line(lonely_decode):
    """The decode command with no prefill engine behind the URL: exit 1 and one line that says what did
    not answer and what to set, never a traceback."""
    dec = lonely_decode.result()
    assert dec.returncode == 1, (dec.stdout + dec.stderr)[-3000:]
    errors = [ln for ln in dec.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "did not answer" in errors[0] and "--timeout" in errors[0], dec.stderr[-2000:]
    assert "Traceback" not in dec.stderr
