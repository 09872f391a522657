"""DeepSeek-V2 MLA prefill/decode through KvlcConnector on vLLM 0.32's CPU MLA backend (real engines, float32).

What is established here, with the engines' own caches as evidence (docs/vllm.md, "MLA on CPU"):

* kvlc moves the latent cache exactly: after a load, every byte of every layer for the tokens the
  decode engine does not recompute equals the prefill engine's.
* vLLM's CPU MLA path is what differs: the decode engine recomputes the prompt's last token after the
  loaded KV; at layer 0 (whose input is the token's embedding alone) its latent equals the prefill
  engine's to the bit, and only its 64 RoPE-key values differ. vLLM itself turns prefix caching and
  chunked prefill off for MLA on CPU, the two other ways a token is computed after cached KV, so the
  engine alone never takes that path. The decode engine's tokens then differ from the engine alone;
  the consumer says so once, as a warning, when it registers its KV cache.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from testkit.vllm_engines import EngineSpec, tiny_deepseek_v2
from tests.engines.conftest import Engines, engine_env, for_decode, kvlc_config, prompt

pytestmark = pytest.mark.engine
LATENT, ROPE, FP32 = 512, 64, 4
TOKEN_BYTES = (LATENT + ROPE) * FP32   # per layer and token
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    model = str(tiny_deepseek_v2(tmp_path_factory.mktemp("model") / "tiny-dsv2"))
    e = Engines(tmp_path_factory.mktemp("logs"))
    for name, role, core in (("prefill", "kv_producer", 0), ("decode", "kv_consumer", 1)):
        e.start(name, EngineSpec(model, block_size=16, dtype="float32", connector=kvlc_config(role),
                                 env=engine_env(core)))
    yield e
    e.close()


def _last_load_ids(log: str) -> list[int]:
    """The decode engine's block ids of its latest load, from the worker's log line."""
    line = [ln for ln in log.splitlines() if "loads request" in ln][-1]
    return [int(x) for x in re.search(r"local \{'mla': \(([^)]*)\)", line).group(1).split(",") if x.strip()]


@pytest.mark.parametrize("n", [40, 100])
def test_mla_bytes_land_exactly_and_vllm_recomputes_the_last_token_otherwise(engines, n):
    pre, dec = engines["prefill"], engines["decode"]
    p = prompt(n, seed=n)
    alone = dec.generate([p], 8)[0].tokens
    params = pre.generate([p], 1, [{"do_remote_decode": True}])[0].kv_transfer_params
    produced = pre.kv_blocks(list(params["remote_block_ids"][0]))
    out = dec.generate([p], 8, [for_decode(params)])[0]
    assert out.num_cached_tokens == n  # the decode engine took the prompt's KV from kvlc
    loaded = dec.kv_blocks(_last_load_ids(engines.log("decode")))
    for layer in LAYERS:
        a, b = produced[layer][:n * TOKEN_BYTES], loaded[layer][:n * TOKEN_BYTES]
        kept = (n - 1) * TOKEN_BYTES
        assert np.array_equal(a[:kept], b[:kept]), f"{layer}: a byte of tokens [0, {n - 1}) differs after the load"
    # the last prompt token, recomputed by the decode engine: layer 0's latent is the producer's, its RoPE keys not
    last = slice((n - 1) * TOKEN_BYTES, n * TOKEN_BYTES)
    mine = np.frombuffer(loaded[LAYERS[0]][last].tobytes(), np.float32)
    theirs = np.frombuffer(produced[LAYERS[0]][last].tobytes(), np.float32)
    assert np.array_equal(mine[:LATENT], theirs[:LATENT])
    assert not np.array_equal(mine[LATENT:], theirs[LATENT:]), "vLLM's CPU MLA recompute now matches: re-check"
    assert out.tokens != alone, "tokens equal the engine alone: vLLM's CPU MLA defect is gone, update docs/vllm.md"


def test_mla_consumer_warns_once_that_vllm_cpu_mla_decodes_otherwise(engines):
    engines["decode"], engines["prefill"]
    warned = [ln for ln in engines.log("decode").splitlines() if "backend recomputes a prompt's last token" in ln]
    assert len(warned) == 1 and ("CPU_MLA" in warned[0] or "AMX_MLA" in warned[0]), warned
    assert "backend recomputes" not in engines.log("prefill")
