"""Prefill/decode of Mamba-2 and Gated-DeltaNet hybrids through KvlcConnector (real vLLM 0.32 engines, CPU).

Two tiny random-weight hybrids: a Nemotron-H (layers M * M M * M: Mamba-2 state groups (0, 3) and (2, 5),
a full-attention group (1, 4)) and a Qwen3-Next (Gated DeltaNet, full attention every fourth layer: three
linear-attention groups and one full group). The producer stops one prompt token short, so the state it
hands over is the state after ``n - 1`` tokens; the decode engine loads those tokens' KV (to the end of
the last block: vLLM zeroed the producer's tail, and skips zeroing blocks a connector loads) and each state
group's one state block, and computes the last prompt token itself.

Nemotron-H runs with prefix caching off (vLLM's Mamba ``"none"`` mode: one state block per request),
Qwen3-Next with it on (``"align"``: a state block per attention block, the running one last).

Oracles. Nemotron-H runs in float32: tokens equal the decode engine's own. vLLM's CPU Gated DeltaNet runs
in bfloat16 only, where the producer's chunked scan and the decode engine's recurrent step round
differently and greedy tokens of a random MoE drift from the engine alone on some prompts; so Qwen3-Next's
tokens are compared with vLLM's own NixlConnector moving the same request between two more engines
(it stops one token short too): equal tokens, where the engine alone may differ.
"""

from __future__ import annotations

import pytest

from testkit.vllm_engines import EngineSpec, tiny_nemotron_h, tiny_qwen3_next
from tests.engines.conftest import Engines, engine_env, kvlc_config, prefill, prompt
from tests.engines.test_hybrid_engine import torch_has_avx512_bf16

pytestmark = pytest.mark.engine
MAX_TOKENS = 12


def _state_bytes(conv: int, rec: int, rec_item: int) -> int:
    return conv + rec * rec_item


# name: writer, dtype, prefix caching, prompt tokens (no multiple of a block), state group indexes (vLLM
# order), attention block vLLM picks for --block-size 32, K+V bytes per token and attention layer,
# attention layers, state layers, one layer's state bytes (conv + ssm). Nemotron-H runs with prefix caching
# off (vLLM 0.32's CPU Mamba-2 fails in its "align" mode: IndexError in mamba_mixer2.conv_ssm_forward, the
# engine alone too); Qwen3-Next with it on ("align": a state block per 160 tokens, 400 tokens: three).
MODELS = {
    "nemotron-h": (tiny_nemotron_h, "float32", False, 150, (0, 1), 32, 2 * 2 * 64 * 4, 2, 4,
                   lambda: _state_bytes(3 * 320 * 4, 8 * 32 * 16, 4)),
    "qwen3-next": (tiny_qwen3_next, "bfloat16", True, 400, (0, 1, 2), 160, 2 * 2 * 64 * 2, 2, 6,
                   lambda: _state_bytes(3 * 512 * 2, 4 * 64 * 64, 4 if torch_has_avx512_bf16() else 2)),
}


def nixl_config(role: str) -> dict:
    """KVTransferConfig arguments for vLLM's own NixlConnector on CPU."""
    return dict(kv_connector="NixlConnector", kv_role=role, kv_buffer_device="cpu")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Per model a kvlc prefill and decode engine, and for Qwen3-Next a NixlConnector pair; all start at once."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("mamba-pd")
    e = Engines(root)
    for name, (write, dtype, cache, *_rest) in MODELS.items():
        model = str(write(root / name, dtype=dtype))
        for side, role, core in (("p", "kv_producer", 0), ("d", "kv_consumer", 1)):
            e.start(f"{name}-{side}", EngineSpec(model, 32, dtype=dtype, connector=kvlc_config(role),
                                                 env=engine_env(core), prefix_caching=cache))
        if name == "qwen3-next":
            for side, role, core, port in (("p", "kv_producer", 0, 25611), ("d", "kv_consumer", 1, 25711)):
                e.start(f"nixl-{side}", EngineSpec(model, 32, dtype=dtype, connector=nixl_config(role),
                                                   prefix_caching=cache,
                                                   env={**engine_env(core), "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}))
    yield e
    e.close()


def _oracle(engines, name: str, p) -> tuple[int, ...]:
    """Nemotron-H (fp32): the decode engine alone. Qwen3-Next (bf16): the same P/D through NixlConnector."""
    if name == "nemotron-h":
        return engines[f"{name}-d"].generate([p], MAX_TOKENS)[0].tokens
    (out,) = engines["nixl-d"].generate([p], MAX_TOKENS, [prefill(engines["nixl-p"], p)])
    assert out.num_cached_tokens == len(p) - 1   # NixlConnector also loads n - 1 tokens
    return out.tokens


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("seed", [4, 6])
def test_hybrid_decodes_the_same_tokens(engines, name, seed):
    """Tokens equal the oracle; the producer stopped one token short (params: n - 1 tokens, one block per
    state group); the decode engine loaded n - 1 tokens, moving every attention layer's K/V up to the
    end of the last block and one state of every state layer, nothing else."""
    _, _, _, n, state_groups, block, token_bytes, attn_layers, state_layers, state_bytes = MODELS[name]
    p = prompt(n, seed=seed)
    want = _oracle(engines, name, p)
    params = prefill(engines[f"{name}-p"], p)
    assert params["remote_num_tokens"] == n - 1
    ids = params["remote_block_ids"]
    assert [len(ids[g]) for g in state_groups] == [1] * len(state_groups), ids
    before = engines[f"{name}-d"].stats()["bytes"]
    (out,) = engines[f"{name}-d"].generate([p], MAX_TOKENS, [params])
    moved = engines[f"{name}-d"].stats()["bytes"] - before
    assert out.tokens == want
    assert out.num_cached_tokens == n - 1
    tokens = -(-(n - 1) // block) * block
    assert moved == tokens * token_bytes * attn_layers + state_bytes() * state_layers


@pytest.mark.parametrize("mode", ["push", "pull_via_push"])
def test_push_modes_decode_the_same_tokens(engines, mode):
    """The prefill engine pushes (or the decode engine asks it to): Nemotron-H's tokens equal the engine
    alone, n - 1 tokens loaded."""
    name = "nemotron-h"
    p = prompt(MODELS[name][3], seed=8)
    want = _oracle(engines, name, p)
    params = {**prefill(engines[f"{name}-p"], p), "mode": mode}
    (out,) = engines[f"{name}-d"].generate([p], MAX_TOKENS, [params])
    assert out.tokens == want and out.num_cached_tokens == len(p) - 1


@pytest.mark.parametrize("name", list(MODELS))
def test_wrong_state_changes_the_tokens(engines, name):
    """Negative control: each state group reads another state group's state block (other layers' states),
    the attention KV unchanged: the tokens differ, so the transferred state decides the decode."""
    _, _, _, n, state_groups, *_rest = MODELS[name]
    p = prompt(n, seed=5)
    want = _oracle(engines, name, p)
    params = prefill(engines[f"{name}-p"], p)
    ids = list(params["remote_block_ids"])
    rolled = [ids[g] for g in state_groups[1:] + state_groups[:1]]
    for g, new in zip(state_groups, rolled):
        ids[g] = new
    params["remote_block_ids"] = ids
    (out,) = engines[f"{name}-d"].generate([p], MAX_TOKENS, [params])
    assert out.num_cached_tokens == n - 1
    assert out.tokens != want


def test_state_of_the_whole_prompt_is_refused(engines):
    """Params whose state covers every prompt token (a producer that did not stop short) would make the
    decode engine count the last token twice: it computes the prompt locally instead (no tokens loaded)."""
    name = "nemotron-h"
    p = prompt(MODELS[name][3], seed=7)
    params = prefill(engines[f"{name}-p"], p)
    short = p[:-1]   # the decode engine's prompt is the producer's n - 1 tokens
    before = len(engines[f"{name}-d"].stats()["load_seconds"])
    (out,) = engines[f"{name}-d"].generate([short], MAX_TOKENS, [params])
    assert out.num_cached_tokens == 0 and len(engines[f"{name}-d"].stats()["load_seconds"]) == before
    assert out.tokens == engines[f"{name}-d"].generate([short], MAX_TOKENS)[0].tokens
