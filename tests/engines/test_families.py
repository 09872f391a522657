"""Families the other engine tests do not start, through KvlcConnector in real vLLM 0.32 CPU engines.

Each a tiny random-weight model written by transformers' own classes (``testkit.vllm_engines.tiny_family``),
float32 (bf16 numerics let a Mamba hybrid's tokens drift between two engines), a prefill engine of 32-token
blocks and a decode engine of 64-token blocks:

* Mistral with a model-wide ``sliding_window`` and no ``layer_types``: vLLM slides every layer;
* Cohere-2 (three sliding layers, one full): vLLM's sliding layers see ``sliding_window + 1`` tokens;
* Granite-4 (``granitemoehybrid``: Mamba-2 or attention by ``layer_types``, the mixer spelled as Falcon-H1's);
* LFM2 (short-convolution layers, whose state is the conv taps alone, and attention by ``layer_types``).

Per family: the decode engine's greedy tokens after the transfer equal the decode engine alone for prompts
around the block and window edges, the loaded tokens are what the prefill engine sent, and each engine's
live plan has the digest ``kvlc init --engine vllm`` gives offline for the same config.json.
"""

from __future__ import annotations

import pytest

from tests.engines.conftest import Engines, engine_env, init_plan_like, kvlc_config, prefill, prompt

pytestmark = pytest.mark.engine

FAMILIES = ("mistral", "cohere2", "granitemoehybrid", "lfm2")
PROMPTS = (33, 64, 150)  # inside a block, a block's end, past the window (48) and several blocks
BLOCKS = {"p": 32, "d": 64}


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    from testkit.vllm_engines import EngineSpec, tiny_family

    family = request.param
    root = tmp_path_factory.mktemp(family)
    model = tiny_family(root / "model", family, "float32")
    e = Engines(root)
    for side, role, core in (("p", "kv_producer", 0), ("d", "kv_consumer", 1)):
        e.start(side, EngineSpec(str(model), BLOCKS[side], dtype="float32", connector=kvlc_config(role),
                                 env=engine_env(core)))
    yield family, model, e
    e.close()


def test_tokens_equal_the_decode_engine_alone(pair):
    family, _, e = pair
    for i, n in enumerate(PROMPTS):
        p = prompt(n, seed=i)
        alone = e["d"].generate([p], 10)[0].tokens
        params = prefill(e["p"], p)
        before = e["d"].stats()["bytes"]
        (out,) = e["d"].generate([p], 10, [params])
        assert out.tokens == alone, (family, n)
        # the decode engine computed nothing it was sent: every token the prefill engine sent was loaded
        # (a Mamba hybrid sends n - 1: the last token's state is recomputed from the prompt's end)
        assert 0 < params["remote_num_tokens"] == out.num_cached_tokens, (family, n, params, out)
        assert e["d"].stats()["bytes"] > before, (family, n)  # and the bytes came through kvlc


def test_live_plan_equals_kvlc_init(pair):
    from kvlc.engines.vllm.derive.spec import derive_plan

    family, model, e = pair
    for side, block in BLOCKS.items():
        live = derive_plan(e[side].view())
        assert live.digest == init_plan_like(live, model, "fp32", block).digest, (family, side)
