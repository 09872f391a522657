"""Llama-4 chunked local attention live through KvlcConnector (real vLLM 0.32 CPU engines, float32).

A tiny random-weight Llama-4 text model (:func:`testkit.vllm_engines.tiny_llama4`: RoPE layers 0-2 with chunked
local attention of 32 tokens, a NoPE full-attention layer 3, as Scout's 3 of 4): vLLM 0.32 (``llama4.py``:
``ChunkedLocalAttention`` where ``not nope and attention_chunk_size``) keeps its hybrid manager for
KvlcConnector and gives it three chunked-local groups and one full group over one page pool; a chunked group's
blocks before the current chunk are vLLM's null block (``ChunkedLocalAttentionManager``).

The producer stops one prompt token short (vLLM frees the chunk the consumer's own last token needs when the
prompt length starts a chunk); the consumer loads ``n - 1`` tokens of the full layer and, of each chunked layer,
only the blocks of the chunk of token ``n - 1``. Oracle: the decode engine alone (float32; one engine pair,
block 32 on both sides).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testkit.vllm_engines import EngineSpec, tiny_llama4
from tests.engines.conftest import Engines, engine_env, kvlc_config, prefill, prompt

pytestmark = pytest.mark.engine
MAX_TOKENS = 12
CHUNK = 32
BLOCK = 32
TOKEN_BYTES = 2 * 2 * 64 * 4   # K and V of 2 KV heads x 64, fp32, one layer


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    pytest.importorskip("transformers")
    return str(tiny_llama4(tmp_path_factory.mktemp("llama4") / "model", chunk=CHUNK))


@pytest.fixture(scope="module")
def engines(model, tmp_path_factory):
    e = Engines(tmp_path_factory.mktemp("llama4-logs"))
    e.start("p", EngineSpec(model, BLOCK, dtype="float32", connector=kvlc_config("kv_producer"), env=engine_env(0)))
    e.start("d", EngineSpec(model, BLOCK, dtype="float32", connector=kvlc_config("kv_consumer"), env=engine_env(1)))
    yield e
    e.close()


def test_live_derivation_equals_kvlc_init(engines, model):
    """Both engines' live views compile to kvlc init --engine vllm's plan for the same config.json (digest, names
    given): three chunked_local groups of chunk 32 and one full group, four layers over one page pool."""
    from kvlc.compiler import compile_spec
    from kvlc.engines.vllm.derive.spec import derive_plan
    from kvlc.init import EngineOptions, init_yaml

    config = json.loads((Path(model) / "config.json").read_text())
    for side in "pd":
        view = engines[side].view()
        live = derive_plan(view)
        init = compile_spec(init_yaml(config, EngineOptions(
            engine="vllm", backend="CPU_ATTN", mem="DRAM", block_size=BLOCK, num_blocks=view.num_blocks,
            kv_dtype="fp32", name=live.name, model_name=view.model.name)))
        assert live.digest == init.digest, (live.text(), init.text())
        assert [(g.name, g.kind, g.window) for g in live.groups] == [
            ("chunked.32", "chunked_local", CHUNK), ("chunked.32.1", "chunked_local", CHUNK),
            ("chunked.32.2", "chunked_local", CHUNK), ("full", "full_attention", 0)]
        assert [r.aliases for r in live.regions] == [(), ("layer.0",), ("layer.0",), ("layer.0",)]
    assert "Turning off hybrid kv cache manager" not in engines.log("d")


def _chunk_tokens(stop: int) -> int:
    """Tokens a chunked layer moves for a load of ``[0, stop)``: from the block of the first token of the chunk
    of token ``stop`` (vLLM skips ``stop // chunk * chunk`` tokens) to ``stop``."""
    return stop - stop // CHUNK * CHUNK // BLOCK * BLOCK


@pytest.mark.parametrize("n,seed", [(150, 4), (128, 5), (129, 7)])
def test_llama4_decodes_the_same_tokens(engines, n, seed):
    """Tokens equal the decode engine alone; it loaded n - 1 tokens: the full layer's K/V of all of them, each
    chunked layer's only from the chunk of token n - 1 (n = 128: tokens 96..126; n = 129: none, token 128 starts a
    chunk; n = 150: 128..148), nothing else; the producer's chunked ids before that chunk are vLLM's null block."""
    p = prompt(n, seed=seed)
    ref = engines["d"].generate([p], MAX_TOKENS)[0].tokens
    params = prefill(engines["p"], p)
    assert params["remote_num_tokens"] == n - 1
    skipped = (n - 1) // CHUNK * CHUNK // BLOCK
    assert all(set(g[:skipped]) <= {0} and 0 not in g[skipped:] for g in params["remote_block_ids"][:3]), params
    before = engines["d"].stats()["bytes"]
    (out,) = engines["d"].generate([p], MAX_TOKENS, [params])
    moved = engines["d"].stats()["bytes"] - before
    assert out.tokens == ref
    assert out.num_cached_tokens == n - 1
    assert moved == TOKEN_BYTES * ((n - 1) + 3 * _chunk_tokens(n - 1)) < TOKEN_BYTES * 4 * (n - 1)


def test_wrong_chunk_blocks_change_the_tokens(engines):
    """Negative control: each chunked layer's current-chunk block read from another chunked layer's pages gives
    other tokens (the chunk's transferred KV decides the decode); the right ids, after, give the oracle's."""
    p = prompt(150, seed=6)
    ref = engines["d"].generate([p], MAX_TOKENS)[0].tokens
    params = prefill(engines["p"], p)
    ids = params["remote_block_ids"]
    (wrong,) = engines["d"].generate([p], MAX_TOKENS, [{**params, "remote_block_ids": [ids[1], ids[2], ids[0], ids[3]]}])
    assert wrong.num_cached_tokens == 149
    assert wrong.tokens != ref
    (right,) = engines["d"].generate([p], MAX_TOKENS, [prefill(engines["p"], p)])
    assert right.tokens == ref


def test_params_covering_the_whole_prompt_are_computed_locally(engines):
    """Params whose tokens cover the whole prompt (a producer that did not stop one short, e.g. another
    connector's) are refused by the consumer before any transfer: it computes the prompt itself (no cached
    tokens, the oracle's tokens) and logs why, naming the chunk that vLLM frees."""
    p = prompt(128, seed=8)
    ref = engines["d"].generate([p], MAX_TOKENS)[0].tokens
    params = prefill(engines["p"], p)
    before = engines["d"].stats()["bytes"]
    (out,) = engines["d"].generate([p], MAX_TOKENS, [{**params, "remote_num_tokens": 128}])
    assert out.tokens == ref and out.num_cached_tokens == 0
    assert engines["d"].stats()["bytes"] == before
    assert "vLLM freed its chunked-local blocks before the last token's chunk" in engines.log("d")


@pytest.mark.parametrize("stop,read", [(149, 1), (127, 1), (128, 0), (33, 1), (32, 0)])
def test_chunked_groups_read_only_the_current_chunk(model, stop, read):
    """The request rule on init's plan of the same model (no engine): tokens [0, stop) move every full block and,
    per chunked group, only the blocks of the chunk of token ``stop`` (none when ``stop`` starts a chunk); the
    null-block placeholders (0, repeated) before them are neither read nor refused as duplicates."""
    from kvlc import compile_spec, pair
    from kvlc.compiler.request.check import check_request
    from kvlc.init import EngineOptions, init_yaml

    plan = compile_spec(init_yaml(json.loads((Path(model) / "config.json").read_text()), EngineOptions(
        engine="vllm", backend="CPU_ATTN", mem="DRAM", block_size=BLOCK, num_blocks=64, kv_dtype="fp32")))
    prog = pair(plan, plan, local_rank=0)
    n = -(-stop // BLOCK)
    skipped = stop // CHUNK * CHUNK // BLOCK
    chunked = {g: [0] * skipped + list(range(first, first + n - skipped))   # each group its own pages of the pool
               for g, first in (("chunked.32", 10), ("chunked.32.1", 30), ("chunked.32.2", 40))}
    ids = {"full": list(range(50, 50 + n)), **chunked}
    req = check_request(prog, ids, ids, stop)
    assert req.local["full"].tolist() == list(range(50, 50 + n))
    for g, want in chunked.items():
        assert req.local[g].tolist() == want[skipped:][:read] and req.remote[g].tolist() == req.local[g].tolist()
