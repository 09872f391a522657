"""``kvlc from-vllm --from-engine`` on a live Falcon-H1 (real vLLM 0.32 CPU engines, one at a time).

The issue's reproduction: the live reader took Nemotron-H's config field names and refused a Falcon-H1
("the model config has no 'n_groups'"). Now the command writes ``kvlc init --engine vllm``'s spec for the
same config.json (digest, names given); an engine whose conv states are channels first (vLLM's ``DS``
layout) is refused with the setting named.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.vllm_engines import tiny_falcon_h1
from tests.engines.conftest import ROOT, init_plan_like

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    return tiny_falcon_h1(tmp_path_factory.mktemp("falcon-h1-cli") / "model", dtype="float32")


def _from_engine(model: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "VLLM_SSM_CONV_STATE_LAYOUT"}
    environ.update(PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    return subprocess.run([sys.executable, "-m", "kvlc.cli", "from-vllm", str(model), "--from-engine",
                           "--block-size", "32", "--kv-dtype", "fp32", "--kv-cache-mib", "16"],
                          capture_output=True, text=True, timeout=300, env=environ)


def test_from_engine_writes_kvlc_inits_spec(model):
    """The live spec of a tiny Falcon-H1 (2 decoder layers) compiles to kvlc init --engine vllm's plan: attention
    layer.0-1 in group full, the mixers layer.2-3 in group mamba over their pages, 4 cache layers."""
    from kvlc.compiler import compile_spec

    out = _from_engine(model)
    assert out.returncode == 0, out.stderr[-3000:]
    live = compile_spec(out.stdout)
    init = init_plan_like(live, model)
    assert live.digest == init.digest, (live.text(), init.text())
    assert live.model.num_layers == 4
    assert [(r.name, r.groups, r.aliases) for r in live.regions] == [
        ("layer.0", ("full",), ()), ("layer.1", ("full",), ()),
        ("layer.2", ("mamba",), ("layer.0",)), ("layer.3", ("mamba",), ("layer.1",))]


def test_channels_first_conv_state_is_refused(model):
    """VLLM_SSM_CONV_STATE_LAYOUT=DS (vLLM's CPU platform sets it for NixlConnector engines): refused, the
    setting named, no spec written."""
    out = _from_engine(model, VLLM_SSM_CONV_STATE_LAYOUT="DS")
    assert out.returncode != 0 and not out.stdout.strip()
    assert "conv state shape (320, 3) is channels first" in out.stderr
    assert "fix: start the engine without VLLM_SSM_CONV_STATE_LAYOUT=DS" in out.stderr
