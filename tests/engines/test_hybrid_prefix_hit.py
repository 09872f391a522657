"""A hybrid decode engine's own prefix-cache hit, the rest loaded through KvlcConnector (real vLLM 0.32, CPU, bf16).

A tiny Gemma-3 (sliding, sliding, sliding, full; window 64; :func:`testkit.vllm_engines.tiny_gemma3`), vLLM's
hybrid manager on. The decode engine has prefix caching on and already computed a prefix of the prompt; given a
KvlcConnector prefill engine's params for the whole prompt it keeps its own hit (vLLM's ``num_computed_tokens``
in ``get_num_new_matched_tokens``) and loads only tokens ``[hit, n)``: the full group all of them, each sliding
group only those its window still needs. Oracle: the decode engine alone, after the same prefix (and with an
empty cache: the same tokens).
"""

from __future__ import annotations

import pytest

from kvlc.compiler.request.tokens import TokenRange, window_start
from testkit.vllm_engines import EngineSpec, tiny_gemma3
from tests.engines.conftest import Engines, engine_env, kvlc_config, prefill, prompt

pytestmark = pytest.mark.engine
MAX_TOKENS = 12
WINDOW = 64
BLOCK = 32
TOKEN_BYTES = 2 * 2 * 64 * 2   # per layer and token: 2 KV heads, K and V, head_dim 64, bf16


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    pytest.importorskip("transformers")
    model = str(tiny_gemma3(tmp_path_factory.mktemp("gemma3") / "model", window=WINDOW))
    e = Engines(tmp_path_factory.mktemp("prefix-hit-logs"))
    e.start("p", EngineSpec(model, BLOCK, connector=kvlc_config("kv_producer"), env=engine_env(0)))
    e.start("d", EngineSpec(model, BLOCK, prefix_caching=True, connector=kvlc_config("kv_consumer"),
                            env=engine_env(1)))
    yield e
    e.close()


def _alone(d, p: list[int], k: int):
    """The decode engine alone on ``p`` after computing its first ``k`` tokens (its own cache hit), and on an
    empty cache; the cache then holds the ``k``-token prefix only."""
    d.reset_prefix_cache()
    fresh = d.generate([p], MAX_TOKENS)[0]
    d.reset_prefix_cache()
    d.generate([p[:k]], 1)
    alone = d.generate([p], MAX_TOKENS)[0]
    d.reset_prefix_cache()
    d.generate([p[:k]], 1)
    return fresh, alone


@pytest.mark.parametrize("n,k,seed", [(200, 100, 2), (150, 140, 4)])
def test_prefix_hit_then_the_rest_loaded(engines, n, k, seed):
    """Tokens equal the decode engine alone (with and without its prefix hit); the load starts at the engine's own
    hit (vLLM's cached-token count of the prefix, whole blocks: 96 of a 100-token prefix, 128 of 140): the full
    layer moved tokens [hit, n), each sliding layer [max(hit, its window's first kept block), n), nothing else."""
    d = engines["d"]
    p = prompt(n, seed=seed)
    fresh, alone = _alone(d, p, k)
    hit = alone.num_cached_tokens
    assert 0 < hit <= k and hit % BLOCK == 0 and fresh.tokens == alone.tokens
    params = prefill(engines["p"], p)
    before = d.stats()["bytes"]
    (out,) = d.generate([p], MAX_TOKENS, [params])
    moved = d.stats()["bytes"] - before
    assert out.tokens == alone.tokens
    assert out.num_cached_tokens == n
    sliding = n - window_start(TokenRange(hit, n), WINDOW, BLOCK)
    assert moved == TOKEN_BYTES * ((n - hit) + 3 * sliding) < TOKEN_BYTES * (n + 3 * sliding)


def test_wrong_sliding_blocks_after_a_prefix_hit_change_the_tokens(engines):
    """Negative control: after the same prefix hit, the sliding groups' window blocks read from another sliding
    layer's pages give other tokens (the loaded rest decides the decode, not the cached prefix alone)."""
    d = engines["d"]
    p = prompt(200, seed=3)
    _, alone = _alone(d, p, 100)
    params = prefill(engines["p"], p)
    ids = params["remote_block_ids"]
    (out,) = d.generate([p], MAX_TOKENS, [{**params, "remote_block_ids": [ids[1], ids[2], ids[0], ids[3]]}])
    assert out.num_cached_tokens == 200
    assert out.tokens != alone.tokens
