"""Tensor parallelism and vLLM's default multi-process mode (float32: TP 2 and TP 1 give equal tokens).

TP 2 engines run multi-process (EngineCore with the scheduler, one worker process per rank), so the
scheduler and the workers share nothing but vLLM's metadata and outputs.
"""

from __future__ import annotations

import re

import pytest

from testkit.vllm_engines import EngineSpec
from tests.engines.conftest import Engines, engine_env, for_decode, kvlc_config, prompt

pytestmark = pytest.mark.engine
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def engines(model_dir, tmp_path_factory):
    e = Engines(tmp_path_factory.mktemp("tp-logs"))
    multi = dict(dtype="float32", tp=2)
    e.start("pt2", EngineSpec(model_dir, 32, connector=kvlc_config("kv_producer"),
                              env=engine_env("0|1", single_process=False), **multi))
    e.start("dt2", EngineSpec(model_dir, 64, connector=kvlc_config("kv_consumer"),
                              env=engine_env("1|0", single_process=False), **multi))
    e.start("pf1", EngineSpec(model_dir, 32, dtype="float32", connector=kvlc_config("kv_producer"),
                              env=engine_env(0)))
    e.start("df1", EngineSpec(model_dir, 64, dtype="float32", connector=kvlc_config("kv_consumer"),
                              env=engine_env(1)))
    yield e
    e.close()


def run_pd(engines, prod, cons, n, mode="pull"):
    p = prompt(n, seed=n)
    ref = engines[cons].generate([p], MAX_TOKENS)[0].tokens
    out = engines[prod].generate([p], 1, [{"do_remote_decode": True}])[0]
    params = {**for_decode(out.kv_transfer_params), "mode": mode}
    got = engines[cons].generate([p], MAX_TOKENS, [params])[0]
    return ref, got, params


@pytest.mark.parametrize("mode", ["pull", "push", "pull_via_push"])
def test_tp2_to_tp2_multiprocess_block_32_to_64(engines, mode):
    """Both engines multi-process at TP 2, block 32 → 64: every decode rank loads its heads from its
    prefill rank; tokens equal the decode engine's own."""
    ref, got, params = run_pd(engines, "pt2", "dt2", 141, mode)
    assert params["tp_size"] == 2 and len(params["kvlc_addresses"]) == 2
    assert got.num_cached_tokens >= 140, got
    assert got.tokens == ref


def test_tp1_float32_to_tp1(engines):
    """The float32 pair at TP 1 (block 32 → 64) for comparison with the hetero-TP runs."""
    ref, got, _ = run_pd(engines, "pf1", "df1", 141)
    assert got.num_cached_tokens >= 140
    assert got.tokens == ref


@pytest.mark.parametrize("prod,cons", [("pt2", "df1"), ("pf1", "dt2")])
def test_hetero_tp_tokens_equal(engines, prod, cons):
    """Prefill TP 2 (block 32) → decode TP 1 (block 64), and TP 1 → TP 2: the decode engine gathers
    (or splits) the heads, loads the prompt (cached tokens, no failed load) and its tokens equal its own."""
    ref, got, _ = run_pd(engines, prod, cons, 141)
    assert not re.search(r"kvlc: load of request \S+ from engine", engines.log(cons))
    assert got.num_cached_tokens >= 140, got
    assert got.tokens == ref
