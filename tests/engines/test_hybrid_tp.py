"""Mamba-2 hybrids at tensor parallelism 2 through KvlcConnector (real vLLM 0.32 CPU engines, float32).

Two tiny random-weight Falcon-H1 (attention and a Mamba-2 mixer in each of 2 decoder layers; 8 Mamba heads
x 32, 16 states; prefix caching off) that differ in ``mamba_n_groups`` only, so in how vLLM shards the conv
state's B and C channels:

* ``one-group`` (``mamba_n_groups`` 1, as the released Falcon-H1 models): every rank holds the whole B and C
  and half of x (vLLM's ``MambaMixer2``); kvlc states them ``replicated`` and reads them from one rank;
* ``two-groups`` (2): each rank holds one group's B and C and half of x; kvlc splits every section.
  Not started by default (the suite's time): set ``KVLC_TEST_TWO_GROUPS=1`` to run it too. Probed live
  when this module was written: tokens equal on 2 of 2 prompts for each of TP 2 -> 1, 1 -> 2 and 2 -> 2;
  split sections across TP sizes are also drawn by tests/test_pair_properties.py, without an engine.

And a tiny Nemotron-H (Mamba-2 and attention in separate layers, ``M*MM*M``; two groups): each rank holds
one group's B and C and half of x and of the SSM heads, the attention layers half the KV heads.

Per model a TP 2 engine (vLLM's multi-process executor, one worker per rank; the engines ask for forked
workers, ``VLLM_WORKER_MULTIPROC_METHOD=fork``, which one probe here found 9 s quicker to start, though
vLLM 0.32's CPU platform sets ``spawn`` in its own config step: which one runs was not checked) and a TP 1
engine, both ``kv_both``, so one engine pair runs TP 2 -> TP 1 and TP 1 -> TP 2; the four start at once.
TP 2 -> TP 2 gave equal tokens in a probe (two more TP 2 engines; not run here). In float32 a TP 2
engine's greedy tokens equal a TP 1 engine's, so the oracle is the decode engine alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from testkit.vllm_engines import EngineSpec, tiny_falcon_h1, tiny_nemotron_h
from tests.engines.conftest import Engines, engine_env, init_plan_like, kvlc_config, prefill, prompt

pytestmark = pytest.mark.engine
MAX_TOKENS = 12
N = 150                                       # prompt tokens: the producer hands over 149
GROUPS = {"one-group": 1, **({"two-groups": 2} if os.environ.get("KVLC_TEST_TWO_GROUPS") == "1" else {}),
          "nemotron-h": 2}
# model -> mamba_n_groups (Falcon-H1's, or Nemotron-H's n_groups)
NEMOTRON = "nemotron-h"
PAIRS = [("t2", "t1"), ("t1", "t2")]          # (prefill, decode) engines of one model
SEEDS = (4, 6)


def _state_bytes(groups: int) -> int:
    """One mixer's whole state (fp32): conv 3 taps x (256 x + 2 x groups x 16 B/C) channels, SSM 8 x 32 x 16
    (both models: 8 heads x 32, 16 states, conv kernel 4)."""
    return 3 * (256 + 2 * groups * 16) * 4 + 8 * 32 * 16 * 4


def _mixers(model: str) -> int:
    """State layers (Falcon-H1: a mixer in each of 2 layers; Nemotron-H ``M*MM*M``: 4); both have 2 attention
    layers of 2 KV heads x 64."""
    return 4 if model == NEMOTRON else 2


@dataclass
class Models:
    engines: Engines
    dirs: dict[str, Path]

    def engine(self, model: str, name: str):
        return self.engines[f"{model}-{name}"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Models:
    """Per model a TP 2 and a TP 1 engine (``kv_both``), all four started at once."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hybrid-tp")
    e = Engines(root)
    dirs = {}
    for i, (model, groups) in enumerate(GROUPS.items()):
        dirs[model] = (tiny_nemotron_h(root / model) if model == NEMOTRON
                       else tiny_falcon_h1(root / model, dtype="float32", mamba_n_groups=groups))
        tp2 = {**engine_env("0|1", single_process=False), "VLLM_WORKER_MULTIPROC_METHOD": "fork"}
        for name, tp, env in (("t2", 2, tp2), ("t1", 1, engine_env(i % 2))):
            e.start(f"{model}-{name}", EngineSpec(str(dirs[model]), 32, dtype="float32", tp=tp, env=env,
                                                  connector=kvlc_config("kv_both"), derive_extension=tp > 1))
    yield Models(e, dirs)
    e.close()


@pytest.mark.parametrize("model", list(GROUPS))
def test_tp2_live_plan_is_kvlc_inits(models, model):
    """The TP 2 engine's live plan (rank 0's KvlcConnector derivation) is kvlc init --engine vllm --tp-size 2's:
    conv.x holds 128 of 256 channels per rank; conv.B and conv.C are whole (replicated) with one group, half
    of the two groups' 32 channels with two."""
    from kvlc.engines.vllm.derive.spec import derive_plan

    live = derive_plan(models.engine(model, "t2").view())
    init = init_plan_like(live, models.dirs[model])
    assert live.digest == init.digest, (live.text(), init.text())
    dims = {f.name: [(d.role, d.size, d.global_size) for d in f.dims if d.name == "channel"][0]
            for f in live.region("layer.2").fields if f.name.startswith("conv.")}   # (a Mamba layer of both)
    bc = ("", 16, 16) if GROUPS[model] == 1 else ("head", 16, 32)
    assert dims == {"conv.x": ("head", 128, 256), "conv.B": bc, "conv.C": bc}


@pytest.mark.parametrize("prod,cons", PAIRS, ids=["tp2-to-tp1", "tp1-to-tp2"])
@pytest.mark.parametrize("model", list(GROUPS))
def test_tokens_equal_the_decode_engine_alone(models, model, prod, cons):
    """Prefill at one TP size, decode at the other: the decode engine loads 149 tokens (K/V and both mixers'
    states, each rank's x and SSM heads from the rank that holds them) and its tokens equal its own, 2 prompts;
    where the decode engine is TP 1 it moved exactly 160 tokens of K/V and every mixer's whole state (B and C
    once)."""
    p_eng, d_eng = models.engine(model, prod), models.engine(model, cons)
    for seed in SEEDS:
        p = prompt(N, seed=seed)
        want = d_eng.generate([p], MAX_TOKENS)[0].tokens
        params = prefill(p_eng, p)
        assert params["remote_num_tokens"] == N - 1 and params["tp_size"] == (2 if prod == "t2" else 1)
        before = d_eng.stats()["bytes"] if cons == "t1" else 0
        (out,) = d_eng.generate([p], MAX_TOKENS, [params])
        assert out.num_cached_tokens == N - 1
        assert out.tokens == want, (seed, out.tokens, want)
        if cons == "t1":
            moved = d_eng.stats()["bytes"] - before
            assert moved == 160 * 2 * 2 * 64 * 4 * 2 + _state_bytes(GROUPS[model]) * _mixers(model)


@pytest.mark.parametrize("prod,cons", PAIRS, ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_another_requests_state_changes_the_tokens(models, prod, cons):
    """Negative control (one-group model): prompt B decoded from its own K/V but prompt A's state block moved
    across TP gives other tokens than the decode engine alone; A from its own blocks still equals it. The
    state moved across TP decides the decode, so the equal tokens above are the states' doing."""
    p_eng, d_eng = models.engine("one-group", prod), models.engine("one-group", cons)
    a, b = (prompt(N, seed=s) for s in SEEDS)
    params_a, params_b = prefill(p_eng, a), prefill(p_eng, b)
    ids = list(params_b["remote_block_ids"])
    ids[1] = params_a["remote_block_ids"][1]             # groups: full attention, mamba
    (wrong,) = d_eng.generate([b], MAX_TOKENS, [{**params_b, "remote_block_ids": ids}])
    assert wrong.num_cached_tokens == N - 1
    assert wrong.tokens != d_eng.generate([b], MAX_TOKENS)[0].tokens
    (right,) = d_eng.generate([a], MAX_TOKENS, [params_a])
    assert right.tokens == d_eng.generate([a], MAX_TOKENS)[0].tokens and right.num_cached_tokens == N - 1
