"""A decode-side prefix-cache hit at any token offset, through KvlcConnector between real vLLM engines.

The decode engine (32-token blocks, prefix caching on) already holds a shared prefix of 96 tokens
(three of its blocks) from an earlier request. The prefill engine has 128-token blocks, so the hit
ends inside its first block and inside the 128-token tile of both block sizes — a load the
connector used to recompute. Now it loads the token range [96, 150) and keeps the cached blocks.
Oracle: greedy tokens of a decode engine of the same block size alone (no transfer, no cache).
"""

from __future__ import annotations

import pytest

from testkit.vllm_engines import EngineSpec
from tests.engines.conftest import Engines, engine_env, for_decode, kvlc_config, prompt

pytestmark = pytest.mark.engine
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def engines(model_dir, tmp_path_factory):
    e = Engines(tmp_path_factory.mktemp("prefix-logs"))
    e.start("p128", EngineSpec(model_dir, 128, connector=kvlc_config("kv_producer"), env=engine_env(0)))
    e.start("d32c", EngineSpec(model_dir, 32, connector=kvlc_config("kv_consumer"), env=engine_env(1),
                               prefix_caching=True))
    e.start("d32", EngineSpec(model_dir, 32, connector=kvlc_config("kv_consumer"), env=engine_env(0)))
    yield e
    e.close()


@pytest.mark.parametrize("mode", ["pull", "push", "pull_via_push"])
def test_prefix_hit_mid_tile_loads_the_rest(engines, mode):
    """Tokens equal the decode engine's own; the load is the range [96, 150) (the log says so)."""
    shared = prompt(96, seed={"pull": 7, "push": 8, "pull_via_push": 9}[mode])   # a new prefix per mode
    first = shared + prompt(40, seed=1)
    second = shared + prompt(54, seed=2)          # 150 tokens; block 4 (tokens 96..127) differs from `first`
    ref = engines["d32"].generate([second], MAX_TOKENS)[0].tokens
    engines["d32c"].generate([first], 1)          # caches the shared prefix's three blocks
    outs = engines["p128"].generate([second], 1, [{"do_remote_decode": True}])
    params = {**for_decode(outs[0].kv_transfer_params), "mode": mode}
    out = engines["d32c"].generate([second], MAX_TOKENS, [params])[0]
    assert out.tokens == ref
    assert out.num_cached_tokens >= 149, out
    assert f"tokens [96, 150), {mode}" in engines.log("d32c")
