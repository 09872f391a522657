"""Shared set-up for the vLLM end-to-end tests: a tiny random Llama and long-lived engine processes.

Engines are expensive on a 2-core machine (an import of vLLM alone takes 8-25 s), so each test
module starts the engines it needs once, in parallel, and its scenarios share them; and they are forked
from one server that imported vLLM once per session (``EngineProcess(preload=True)``), not spawned.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from testkit.vllm_engines import EngineProcess, EngineSpec, tiny_llama  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    """The tiny Llama (random weights, initializer_range 0.2), written once per session."""
    return str(tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama"))


def kvlc_config(role: str, policy: str = "recompute", **extra) -> dict:
    """KVTransferConfig arguments for KvlcConnector, exactly as a vLLM user writes them."""
    return dict(kv_connector="KvlcConnector", kv_connector_module_path="kvlc.engines.vllm", kv_role=role,
                kv_connector_extra_config={"host": "127.0.0.1", "port": 0, "timeout": 20.0, **extra},
                kv_load_failure_policy=policy)


def engine_env(core: int | str, single_process: bool = True) -> dict:
    env = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "VLLM_CPU_OMP_THREADS_BIND": str(core), "KVLC_SECRET": "kvlc-engine-tests-secret-0123456789"}
    if single_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


class Engines:
    """Named engines of one module, started together, closed together."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: dict[str, EngineProcess] = {}

    def start(self, name: str, spec: EngineSpec) -> None:
        self.procs[name] = EngineProcess(spec, self.log_dir / f"{name}.log", preload=True).start()

    def __getitem__(self, name: str) -> EngineProcess:
        return self.procs[name].wait_ready()

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def close(self) -> None:
        for p in self.procs.values():  # all stop at once: a multi-process engine takes seconds to end
            p.request_stop()
        for p in self.procs.values():
            p.close()


def prompt(n: int, seed: int = 0) -> list[int]:
    """A deterministic token prompt of ``n`` tokens (n need not be a multiple of any block size)."""
    return [(i * 37 + 11 + seed * 101) % 1000 for i in range(n)]


def for_decode(params: dict) -> dict:
    """The prefill engine's params as a client passes them on, minus vLLM's note of the prefill
    side's cache hits, so the decode engine's ``num_cached_tokens`` counts its own (loaded) tokens."""
    return {k: v for k, v in params.items() if k != "remote_prefill_cached_tokens"}


def prefill(engine, p) -> dict:
    """Prefill prompt ``p`` on ``engine`` as a P/D proxy does (one token, ``do_remote_decode``): the params
    a decode engine is given."""
    (out,) = engine.generate([p], 1, [{"do_remote_decode": True}])
    assert out.kv_transfer_params and out.kv_transfer_params["do_remote_prefill"], out
    return for_decode(out.kv_transfer_params)


class Run:
    """One command started now, its output in files (a full pipe would stall it while another is read):
    slow one-off engine commands of a module start together and their tests take the results."""

    def __init__(self, args: list[str], folder: Path, env: dict):
        self.folder = folder
        self._out, self._err = open(folder / "stdout", "w"), open(folder / "stderr", "w")
        self._proc = subprocess.Popen(args, cwd=folder, env=env, stdout=self._out, stderr=self._err)
        self._done: subprocess.CompletedProcess | None = None

    def result(self, timeout: float = 400) -> subprocess.CompletedProcess:
        if self._done is None:
            try:
                self._proc.wait(timeout)
            finally:
                self.close()
            self._done = subprocess.CompletedProcess(self._proc.args, self._proc.returncode,
                                                     (self.folder / "stdout").read_text(errors="replace"),
                                                     (self.folder / "stderr").read_text(errors="replace"))
        return self._done

    def close(self) -> None:
        self._proc.kill()  # nothing when it has ended
        self._proc.wait()
        self._out.close()
        self._err.close()


def init_plan_like(live, model: Path, kv_dtype: str = "fp32", block_size: int = 32):
    """kvlc init --engine vllm's plan for ``model``'s config.json, named, sized and TP-split like ``live`` (a
    plan derived from a running engine started with ``block_size``), for comparing digests."""
    import json

    from kvlc.compiler import compile_spec
    from kvlc.init import EngineOptions, init_yaml

    return compile_spec(init_yaml(json.loads((Path(model) / "config.json").read_text()), EngineOptions(
        engine="vllm", backend="CPU_ATTN", mem="DRAM", block_size=block_size, kv_dtype=kv_dtype,
        tp_size=live.parallel.tp_size, num_blocks=live.regions[0].num_blocks, name=live.name,
        model_name=live.model.name)))
