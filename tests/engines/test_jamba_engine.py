"""Jamba (Mamba-1 mixers and attention) on vLLM 0.32's CPU platform: derived live, refused by KvlcConnector.

A tiny random-weight Jamba (:func:`testkit.vllm_engines.tiny_jamba`: layers M, M, attention, M; float32). vLLM
0.32 starts it (``jamba.py``: ``MambaMixer``, ``MambaSpec`` groups of ``mamba_type`` MAMBA1, hybrid manager on)
but cannot compute it on CPU: ``mamba_ssm.selective_scan_fn`` calls ``torch.ops._C.selective_scan_fwd``, which
the CPU build's ``vllm._C`` lacks, so the first prefill raises ``AttributeError: '_OpNamespace' '_C' object has
no attribute 'selective_scan_fwd'`` with or without a KV connector (measured: benchmarks/probes/live_families.py).
So: ``kvlc from-vllm --from-engine`` (no forward) writes kvlc init's spec, and KvlcConnector refuses the engine
at start, naming the ``mamba_type`` and the missing op, instead of the first request failing inside vLLM.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from testkit.vllm_engines import EngineProcess, EngineSpec, tiny_jamba
from tests.engines.conftest import Run, engine_env, init_plan_like, kvlc_config

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    return tiny_jamba(tmp_path_factory.mktemp("jamba") / "model")


@pytest.fixture(scope="module")
def from_engine(model, tmp_path_factory):
    """`kvlc from-vllm --from-engine` on core 1, started with the module (it runs beside the refused engine)."""
    run = Run([sys.executable, "-m", "kvlc.cli", "from-vllm", str(model), "--from-engine", "--block-size", "32",
               "--kv-dtype", "fp32", "--kv-cache-mib", "16"], tmp_path_factory.mktemp("jamba-cli"),
              {**os.environ, **engine_env(1)})
    yield run
    run.close()


def test_vllm_cpu_has_no_mamba1_scan():
    """The fact the refusal rests on: vLLM's CPU ops have no selective_scan_fwd (Mamba-1's prefill scan)."""
    import torch
    import vllm._custom_ops  # noqa: F401  (loads vllm._C)

    with pytest.raises((AttributeError, RuntimeError), match="selective_scan_fwd"):
        torch.ops._C.selective_scan_fwd


def test_kvlc_connector_refuses_mamba1_on_cpu(model, from_engine, tmp_path):
    """A Jamba engine with KvlcConnector does not start: the error names vLLM's mamba_type MAMBA1, the missing
    op, the error vLLM itself would give at the first prefill, and the fix."""
    e = EngineProcess(EngineSpec(str(model), 32, dtype="float32", connector=kvlc_config("kv_consumer"),
                                 env=engine_env(0)), tmp_path / "engine.log", preload=True).start()
    try:
        with pytest.raises(RuntimeError) as err:
            e.wait_ready(300)
    finally:
        e.close()
    msg = str(err.value)
    assert "KvlcError" in msg and "vLLM mamba_type MAMBA1" in msg, msg
    assert "no selective_scan_fwd" in msg and "fix: serve this model on a GPU build of vLLM" in msg, msg


def test_from_engine_writes_kvlc_inits_spec(model, from_engine):
    """`kvlc from-vllm --from-engine` on the live Jamba compiles to kvlc init --engine vllm's plan (digest, names
    given): three Mamba-1 state groups (conv 3 taps x 512 channels, SSM 512 x 16, fp32) and a full group, all
    over one page pool (vLLM raised the block to 64 tokens so that a page holds a state)."""
    from kvlc.compiler import compile_spec

    out = from_engine.result()
    assert out.returncode == 0, out.stderr[-3000:]
    live = compile_spec(out.stdout)
    init = init_plan_like(live, model)
    assert live.digest == init.digest, (live.text(), init.text())
    assert [(r.name, r.groups, r.aliases) for r in live.regions] == [
        ("layer.0", ("mamba",), ()), ("layer.1", ("mamba.1",), ("layer.0",)),
        ("layer.2", ("full",), ("layer.0",)), ("layer.3", ("mamba.2",), ("layer.0",))]
    assert {g.name: (g.kind, g.block_size) for g in live.groups}["full"] == ("full_attention", 64)
    assert "ssm@6144:fp32(channel@H=512/512:64,ssm_state=16:4)" in live.region("layer.0").text()
