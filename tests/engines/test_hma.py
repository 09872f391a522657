"""Prefill/decode through KvlcConnector with vLLM's hybrid KV-cache manager on (real vLLM engines, CPU, bf16).

A tiny Gemma-3 (layers sliding, sliding, sliding, full; window 64; random weights): KvlcConnector
implements ``SupportsHMA``, so vLLM keeps its hybrid manager (four KV-cache groups over one page pool,
out-of-window blocks freed to the null block). Oracle: the decode engine's own greedy tokens.
"""

from __future__ import annotations

import pytest

from testkit.vllm_engines import EngineSpec, tiny_gemma3
from tests.engines.conftest import Engines, engine_env, for_decode, kvlc_config, prompt

pytestmark = pytest.mark.engine
MAX_TOKENS = 12
WINDOW = 64
TOKEN_BYTES = 2 * 2 * 64 * 2   # per layer and token: 2 KV heads, K and V, head_dim 64, bf16


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    model = str(tiny_gemma3(tmp_path_factory.mktemp("model") / "tiny-gemma3", window=WINDOW))
    e = Engines(tmp_path_factory.mktemp("hma-logs"))
    e.start("p32", EngineSpec(model, 32, connector=kvlc_config("kv_producer"), env=engine_env(0)))
    e.start("p128", EngineSpec(model, 128, connector=kvlc_config("kv_producer"), env=engine_env(1)))
    e.start("d32", EngineSpec(model, 32, connector=kvlc_config("kv_consumer"), env=engine_env(0)))
    e.start("d64", EngineSpec(model, 64, connector=kvlc_config("kv_consumer"), env=engine_env(1)))
    yield e
    e.close()


def _prefill(engine, p) -> dict:
    (out,) = engine.generate([p], 1, [{"do_remote_decode": True}])
    assert out.kv_transfer_params and out.kv_transfer_params["do_remote_prefill"], out
    return for_decode(out.kv_transfer_params)


def _window_tokens(n: int, block: int) -> int:
    """Tokens a sliding group moves to a decode engine of ``block``-token blocks: from the block of the first
    token the window still needs (vLLM skips ``n - window + 1`` tokens) to the end of the prompt."""
    return n - max(0, n - WINDOW + 1) // block * block


def test_hybrid_manager_stays_on(engines):
    """vLLM keeps its hybrid manager for KvlcConnector: no 'Turning off' warning, and the prefill engine's
    params carry one block list per KV-cache group (three sliding, one full), the sliding ones
    starting with vLLM's null block 0 where the window has moved on."""
    params = _prefill(engines["p32"], prompt(200, seed=1))
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
    params = _prefill(engines[prod], p)
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
    params = _prefill(engines["p32"], p)
    ids = params["remote_block_ids"]
    params["remote_block_ids"] = [ids[1], ids[2], ids[0], ids[3]]
    (out,) = engines["d32"].generate([p], MAX_TOKENS, [params])
    assert out.num_cached_tokens >= 199
    assert out.tokens != ref
