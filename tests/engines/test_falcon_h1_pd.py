"""Falcon-H1 (attention and a Mamba-2 mixer side by side in every layer) live through KvlcConnector.

A tiny random-weight Falcon-H1 of two decoder layers: vLLM 0.32 (``falcon_h1.py``,
``FalconH1ParallelHybrid``) names layer ``i``'s attention ``model.layers.{i}.attn`` and its Mamba-2
mixer ``model.{2 + i}.mixer``, so the engine has four cache layers: a full-attention group (0, 1) and
one Mamba-2 state group (2, 3) whose pages lie over the attention pages. Prefix caching is off (vLLM's
Mamba ``"none"`` mode: one state block per request).

One engine pair at a time (the fixture is parametrized; pytest finishes one pair's tests before it
starts the next):

* ``bf16`` at ``--block-size`` 32 on both sides: vLLM raises the attention block until a page holds a
  state (64 where the CPU has AVX-512 BF16 and keeps the SSM state in fp32, else 32). Oracle: the same
  P/D through vLLM's own NixlConnector (a pair started and closed before the kvlc pair): both stop one
  token short, so both decode from the state after ``n - 1`` tokens and one step, where the engine alone
  scans all ``n`` at once; bf16 rounds the two differently (measured here: the engine alone differed on 2
  of 24 prompts, KvlcConnector and NixlConnector on none from each other);
* ``fp32`` at ``--block-size`` 32 on the prefill engine and 64 on the decode engine, and the reverse:
  different blocks, moved by the exact plan's K/V halves. Oracle: the decode engine alone (fp32: 24 of
  24 prompts equal here).

Each engine's live derivation equals ``kvlc init --engine vllm``'s plan for the same config.json
(digest, names given); the NixlConnector engines' conv states are channels first (vLLM's CPU platform sets
``VLLM_SSM_CONV_STATE_LAYOUT=DS`` for them), which the live derivation refuses, the setting named.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from testkit.vllm_engines import EngineSpec, tiny_falcon_h1
from tests.engines.conftest import Engines, engine_env, kvlc_config, prefill, prompt
from tests.engines.test_hybrid_engine import torch_has_avx512_bf16
from tests.engines.test_mamba_pd import nixl_config

pytestmark = pytest.mark.engine
MAX_TOKENS = 12
N = 150          # prompt tokens: the producer hands over the first 149 (no multiple of a block)
ITEM = {"bfloat16": 2, "float32": 4}
KV = {"bfloat16": "bf16", "float32": "fp32"}
PAIRS = {"bf16-32-32": ("bfloat16", 32, 32, "nixl"),   # name: dtype, --block-size of prefill and decode, oracle
         "fp32-32-64": ("float32", 32, 64, "alone"), "fp32-64-32": ("float32", 64, 32, "alone")}
SEEDS = (4, 6)


def _state_bytes(dtype: str) -> int:
    """One mixer's state on one rank: conv 3 taps x (256 x + 2 x 32 B/C) channels in the model dtype, then
    the SSM state 8 heads x 32 x 16; vLLM's CPU platform keeps it in fp32 on an AVX-512 BF16 CPU (Falcon-H1
    has no config hook: the model dtype otherwise)."""
    ssm_item = 4 if dtype == "float32" or torch_has_avx512_bf16() else 2
    return 3 * 320 * ITEM[dtype] + 8 * 32 * 16 * ssm_item


def _token_bytes(dtype: str) -> int:
    return 2 * 2 * 64 * ITEM[dtype]       # K and V of 2 KV heads x 64, one attention layer


def _block(dtype: str, block_size: int) -> int:
    """The attention block vLLM 0.32 picks for ``--block-size``: raised until a page holds a state."""
    return block_size * -(-_state_bytes(dtype) // (block_size * _token_bytes(dtype)))


@dataclass
class Pair:
    """A kvlc prefill and decode engine of one dtype and block pair, and the oracle's tokens."""

    engines: Engines
    dtype: str
    blocks: tuple[int, int]
    model: str
    nixl: dict | None      # prompt -> tokens of the NixlConnector P/D; None: the decode engine alone is the oracle
    channels_first: str = ""   # why the live derivation refused the NixlConnector prefill engine (DS conv states)

    def oracle(self, p: list[int]) -> tuple[int, ...]:
        if self.nixl is None:
            return self.engines["d"].generate([p], MAX_TOKENS)[0].tokens
        return self.nixl[tuple(p)]


def _refusal(engine) -> str:
    """Why kvlc's live derivation refuses ``engine`` ("" if it does not)."""
    from kvlc.engines.vllm.derive.spec import derive_plan

    try:
        derive_plan(engine.view())
    except Exception as exc:   # the view's own check (RuntimeError from the engine) or derive_plan's ViewError
        return str(exc)
    return ""


def _nixl_tokens(root: Path, model: str, dtype: str, blocks: tuple[int, int]) -> tuple[dict, str]:
    """The P/D of every :data:`SEEDS` prompt through vLLM's own NixlConnector, and why kvlc's live derivation
    refuses its prefill engine; its engines closed on return."""
    root.mkdir()
    e = Engines(root)
    for side, role, core, block, port in (("p", "kv_producer", 0, blocks[0], 25621),
                                          ("d", "kv_consumer", 1, blocks[1], 25721)):
        e.start(side, EngineSpec(model, block, dtype=dtype, connector=nixl_config(role),
                                 env={**engine_env(core), "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}))
    try:
        out = {}
        for seed in SEEDS:
            p = prompt(N, seed=seed)
            (o,) = e["d"].generate([p], MAX_TOKENS, [prefill(e["p"], p)])
            assert o.num_cached_tokens == N - 1     # NixlConnector loads n - 1 tokens too
            out[tuple(p)] = o.tokens
        return out, _refusal(e["p"])
    finally:
        e.close()


@pytest.fixture(scope="module", params=list(PAIRS))
def pair(request, tmp_path_factory) -> Pair:
    """One :class:`Pair` (its NixlConnector oracle first, where it has one); all closed at the end."""
    pytest.importorskip("transformers")
    dtype, bp, bd, oracle = PAIRS[request.param]
    root = tmp_path_factory.mktemp(f"falcon-h1-{request.param}")
    model = str(tiny_falcon_h1(root / "model", dtype=dtype))
    nixl, refused = _nixl_tokens(root / "nixl", model, dtype, (bp, bd)) if oracle == "nixl" else (None, "")
    e = Engines(root)
    for side, role, core, block in (("p", "kv_producer", 0, bp), ("d", "kv_consumer", 1, bd)):
        e.start(side, EngineSpec(model, block, dtype=dtype, connector=kvlc_config(role), env=engine_env(core)))
    yield Pair(e, dtype, (bp, bd), model, nixl, refused)
    e.close()


def test_live_derivation_equals_kvlc_init(pair):
    """Each engine's live view (KvlcConnector's derivation, ``kvlc from-vllm --from-engine``'s spec) compiles to
    kvlc init --engine vllm's plan for the same config.json: four cache layers, the mixer of layer i is
    layer.{2 + i} over layer i's pages. A NixlConnector engine (channels-first conv states) is refused."""
    from kvlc.compiler import compile_spec
    from kvlc.engines.vllm.derive.spec import derive_plan
    from kvlc.init import EngineOptions, init_yaml

    e, dtype = pair.engines, pair.dtype
    config = json.loads((Path(pair.model) / "config.json").read_text())
    for side, block_size in zip("pd", pair.blocks):
        view = e[side].view()
        live = derive_plan(view)
        init = compile_spec(init_yaml(config, EngineOptions(
            engine="vllm", backend="CPU_ATTN", mem="DRAM", block_size=block_size, num_blocks=view.num_blocks,
            kv_dtype=KV[dtype], name=live.name, model_name=view.model.name)))
        assert live.digest == init.digest, (live.text(), init.text())
        assert live.model.num_layers == 4
        assert {r.name: r.groups for r in live.regions} == {"layer.0": ("full",), "layer.1": ("full",),
                                                              "layer.2": ("mamba",), "layer.3": ("mamba",)}
        assert [live.region(f"layer.{2 + i}").aliases for i in range(2)] == [("layer.0",), ("layer.1",)]
        assert next(g.block_size for g in live.groups if g.kind == "full_attention") == _block(dtype, block_size)
    if pair.nixl is not None:   # the NixlConnector engines: DS conv states, refused with the setting named
        assert "conv state shape (320, 3) is channels first" in pair.channels_first, pair.channels_first
        assert "fix: start the engine without VLLM_SSM_CONV_STATE_LAYOUT=DS" in pair.channels_first


@pytest.mark.parametrize("seed", SEEDS)
def test_falcon_h1_decodes_the_same_tokens(pair, seed):
    """Tokens equal the oracle (module docstring); the producer stopped one token short (n - 1 tokens, one state
    block); the decode engine loaded n - 1 tokens, moving both attention layers' K/V to the end of the
    shorter of the two sides' last blocks and both mixers' states, nothing else."""
    e, dtype, (bp, bd) = pair.engines, pair.dtype, pair.blocks
    p = prompt(N, seed=seed)
    want = pair.oracle(p)
    params = prefill(e["p"], p)
    assert params["remote_num_tokens"] == N - 1
    assert len(params["remote_block_ids"][1]) == 1, params["remote_block_ids"]   # groups: full, mamba
    before = e["d"].stats()["bytes"]
    (out,) = e["d"].generate([p], MAX_TOKENS, [params])
    moved = e["d"].stats()["bytes"] - before
    assert out.tokens == want
    assert out.num_cached_tokens == N - 1
    tokens = min(-(-(N - 1) // b) * b for b in (_block(dtype, bp), _block(dtype, bd)))
    assert moved == tokens * _token_bytes(dtype) * 2 + _state_bytes(dtype) * 2


def test_another_requests_state_changes_the_tokens(pair):
    """Negative control: prompt B decodes from its own attention KV but prompt A's state block (the one
    state group's block of another request): its tokens differ from the oracle's, which B's own state gives
    (test above); A, decoded from its own blocks after that, still equals the oracle. The transferred
    state decides the decode."""
    e = pair.engines
    a, b = (prompt(N, seed=s) for s in SEEDS)
    params_a, params_b = prefill(e["p"], a), prefill(e["p"], b)
    ids = list(params_b["remote_block_ids"])
    ids[1] = params_a["remote_block_ids"][1]
    (wrong,) = e["d"].generate([b], MAX_TOKENS, [{**params_b, "remote_block_ids": ids}])
    assert wrong.num_cached_tokens == N - 1
    assert wrong.tokens != pair.oracle(b)
    (right,) = e["d"].generate([a], MAX_TOKENS, [params_a])
    assert right.tokens == pair.oracle(a) and right.num_cached_tokens == N - 1
