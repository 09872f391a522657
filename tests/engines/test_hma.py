"""Prefill/decode through KvlcConnector with vLLM's hybrid KV-cache manager on (real vLLM engines, CPU, bf16).

A tiny Gemma-3 (layers sliding, sliding, sliding, full; window 64; random weights): KvlcConnector
implements ``SupportsHMA``, so vLLM keeps its hybrid manager (four KV-cache groups over one page pool,
out-of-window blocks freed to the null block). Oracle: the decode engine's own greedy tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvlc.compiler import compile_spec
from kvlc.engines.vllm.derive.spec import derive_plan
from kvlc.engines.vllm.derive.view import EngineView
from kvlc.init import EngineOptions, init_yaml
from testkit.vllm_engines import EngineSpec, tiny_gemma3
from tests.engines.conftest import Engines, Run, engine_env, kvlc_config, prefill, prompt

pytestmark = pytest.mark.engine
MAX_TOKENS = 12
WINDOW = 64
TOKEN_BYTES = 2 * 2 * 64 * 2   # per layer and token: 2 KV heads, K and V, head_dim 64, bf16


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(tiny_gemma3(tmp_path_factory.mktemp("model") / "tiny-gemma3", window=WINDOW))


@pytest.fixture(scope="module")
def one_off_engines(model, tmp_path_factory):
    """The module's two one-off engine processes, started at once (each is mostly one core's import and
    start-up): `kvlc from-vllm --from-engine` at block 32 and at block 128. Block -> its Run.
    (Mamba / linear-attention hybrids through KvlcConnector: test_mamba_pd.py.)"""
    runs = {}
    for block, core in ((32, 0), (128, 1)):
        folder = tmp_path_factory.mktemp(f"live-{block}")
        runs[block] = Run([sys.executable, "-m", "kvlc.cli", "from-vllm", model, "--from-engine",
                           "--block-size", str(block), "--kv-cache-mib", "8", "-o", str(folder / "live.yaml"),
                           "--save-view", str(folder / "view.json")], folder, {**os.environ, **engine_env(core)})
    yield runs
    for run in runs.values():
        run.close()  # ends a run no selected test waited for


@pytest.mark.parametrize("block", [32, 128])
def test_offline_specs_equal_the_live_engine(model, block, one_off_engines):
    """`kvlc from-vllm --from-engine` (a real engine, hybrid manager on) derives the plan that `kvlc init
    --engine vllm` and offline `kvlc from-vllm` write from config.json (same digest; names given to init)."""
    run = one_off_engines[block]
    live = run.result()
    assert live.returncode == 0, (live.stdout + live.stderr)[-4000:]
    view = EngineView.from_dict(json.loads((run.folder / "view.json").read_text()))
    want = derive_plan(view)
    assert len(want.groups) == 4 and [len(r.aliases) for r in want.regions] == [0, 1, 1, 1]
    offline = subprocess.run([sys.executable, "-m", "kvlc.cli", "from-vllm", model, "--block-size", str(block),
                              "--num-blocks", str(view.num_blocks)], env={**os.environ, **engine_env(0)},
                             capture_output=True, text=True, timeout=120)
    assert offline.returncode == 0, offline.stderr
    cfg = json.loads((Path(model) / "config.json").read_text())
    init = init_yaml(cfg, EngineOptions(engine="vllm", backend="CPU_ATTN", mem="DRAM", block_size=block,
                                        num_blocks=view.num_blocks, name=want.name, model_name=view.model.name))
    assert compile_spec(offline.stdout).digest == compile_spec(init).digest == want.digest


@pytest.fixture(scope="module")
def engines(model, tmp_path_factory):
    e = Engines(tmp_path_factory.mktemp("hma-logs"))
    e.start("p32", EngineSpec(model, 32, connector=kvlc_config("kv_producer"), env=engine_env(0)))
    e.start("p128", EngineSpec(model, 128, connector=kvlc_config("kv_producer"), env=engine_env(1)))
    e.start("d32", EngineSpec(model, 32, connector=kvlc_config("kv_consumer"), env=engine_env(0)))
    e.start("d64", EngineSpec(model, 64, connector=kvlc_config("kv_consumer"), env=engine_env(1)))
    yield e
    e.close()


def _window_tokens(n: int, block: int) -> int:
    """Tokens a sliding group moves to a decode engine of ``block``-token blocks: from the block of the first
    token the window still needs (vLLM skips ``n - window + 1`` tokens) to the end of the prompt."""
    return n - max(0, n - WINDOW + 1) // block * block


def test_hybrid_manager_stays_on(engines):
    """vLLM keeps its hybrid manager for KvlcConnector: no 'Turning off' warning, and the prefill engine's
    params carry one block list per KV-cache group (three sliding, one full), the sliding ones
    starting with vLLM's null block 0 where the window has moved on."""
    params = prefill(engines["p32"], prompt(200, seed=1))
    ids = params["remote_block_ids"]
    assert len(ids) == 4 and all(len(g) == 7 for g in ids), ids
    assert all(g[:4] == [0, 0, 0, 0] and 0 not in g[4:] for g in ids[:3]) and 0 not in ids[3], ids
    for name in ("p32", "d32"):
        assert "Turning off hybrid kv cache manager" not in engines.log(name)


@pytest.mark.parametrize("prod,cons", [("p32", "d32"), ("p128", "d32"), ("p32", "d64"), ("p128", "d64")])
def test_sliding_window_model_decodes_the_same_tokens(engines, prod, cons):
    """Tokens equal the decode engine's own; it used the transferred KV (cached tokens cover the prompt);
    the sliding groups moved only the tokens their window keeps, the full group all of them."""
    n = 200
    p = prompt(n, seed=2)
    ref = engines[cons].generate([p], MAX_TOKENS)[0].tokens
    params = prefill(engines[prod], p)
    before = engines[cons].stats()["bytes"]
    (out,) = engines[cons].generate([p], MAX_TOKENS, [params])
    moved = engines[cons].stats()["bytes"] - before
    assert out.tokens == ref
    assert out.num_cached_tokens >= n - 1
    block = int(cons[1:])
    assert moved == TOKEN_BYTES * (n + 3 * _window_tokens(n, block)) < TOKEN_BYTES * 4 * n


def test_wrong_sliding_blocks_change_the_tokens(engines):
    """Negative control: the sliding groups' window blocks read from another sliding layer's pages give other
    tokens (the window's KV decides the decode)."""
    p = prompt(200, seed=3)
    ref = engines["d32"].generate([p], MAX_TOKENS)[0].tokens
    params = prefill(engines["p32"], p)
    ids = params["remote_block_ids"]
    params["remote_block_ids"] = [ids[1], ids[2], ids[0], ids[3]]
    (out,) = engines["d32"].generate([p], MAX_TOKENS, [params])
    assert out.num_cached_tokens >= 199
    assert out.tokens != ref
