"""Prefill/decode through KvlcConnector between real vLLM engines (CPU, bf16, single-process mode).

Oracle: the decode engine's own greedy tokens for the same prompt without any transfer.
"""

from __future__ import annotations

import threading

import pytest

from testkit.vllm_engines import EngineSpec
from tests.engines.conftest import Engines, engine_env, for_decode, kvlc_config, prompt

pytestmark = pytest.mark.engine
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def engines(model_dir, tmp_path_factory):
    e = Engines(tmp_path_factory.mktemp("pd-logs"))
    e.start("p128", EngineSpec(model_dir, 128, connector=kvlc_config("kv_producer"), env=engine_env(0)))
    e.start("p32", EngineSpec(model_dir, 32, connector=kvlc_config("kv_producer"), env=engine_env(1)))
    e.start("d32", EngineSpec(model_dir, 32, connector=kvlc_config("kv_consumer"), env=engine_env(0)))
    e.start("d64", EngineSpec(model_dir, 64, connector=kvlc_config("kv_consumer"), env=engine_env(1)))
    e.start("d32f", EngineSpec(model_dir, 32, dtype="float32",
                               connector=kvlc_config("kv_consumer", policy="fail"), env=engine_env(0)))
    yield e
    e.close()


def own(engine, p):
    return engine.generate([p], MAX_TOKENS)[0].tokens


def prefill(engine, prompts, extra=None):
    outs = engine.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    params = []
    for o in outs:
        assert o.kv_transfer_params and o.kv_transfer_params["do_remote_prefill"], o
        params.append({**for_decode(o.kv_transfer_params), **(extra or {})})
    return params


def decode(engine, p, params):
    return engine.generate([p], MAX_TOKENS, [params])[0]


@pytest.mark.parametrize("prod,cons,n", [("p32", "d32", 150), ("p128", "d32", 150), ("p32", "d64", 171)])
def test_pull_tokens_equal_decode_engines_own(engines, prod, cons, n):
    """Pull across equal and different block sizes (128→32, 32→64): the decode engine used the
    loaded KV (cached tokens) and its tokens equal its own tokens without a transfer."""
    p = prompt(n, seed=n)
    ref = own(engines[cons], p)
    (params,) = prefill(engines[prod], [p])
    assert params["remote_num_tokens"] == n and params["transfer_mode"] == "pull"
    out = decode(engines[cons], p, params)
    assert out.num_cached_tokens >= n - 1, out
    assert out.tokens == ref


def test_corrupted_transfer_changes_tokens(engines):
    """Negative control: the same flow reading the prefill blocks in the wrong order gives other tokens."""
    p = prompt(150, seed=3)
    ref = own(engines["d32"], p)
    (params,) = prefill(engines["p32"], [p])
    params["remote_block_ids"] = [list(reversed(params["remote_block_ids"][0]))]
    out = decode(engines["d32"], p, params)
    assert out.num_cached_tokens >= 149
    assert out.tokens != ref


@pytest.mark.parametrize("mode", ["push", "pull_via_push"])
@pytest.mark.parametrize("prod,cons", [("p32", "d32"), ("p128", "d64")])
def test_push_modes_tokens_equal(engines, mode, prod, cons):
    """Push (the prefill worker WRITEs into blocks the decode names) and pull-via-push (the prefill
    agent WRITEs on its own) give the decode engine's own tokens."""
    p = prompt(133, seed=hash((mode, prod)) % 97)
    ref = own(engines[cons], p)
    (params,) = prefill(engines[prod], [p], {"mode": mode})
    out = decode(engines[cons], p, params)
    assert out.num_cached_tokens >= 132, out
    assert out.tokens == ref


def test_one_prefill_engine_serves_two_decode_engines(engines):
    """One prefill engine, two requests, two decode engines loading at the same time."""
    pa, pb = prompt(97, seed=11), prompt(161, seed=12)
    refs = {"d32": own(engines["d32"], pa), "d64": own(engines["d64"], pb)}
    params = prefill(engines["p32"], [pa, pb])
    outs = {}

    def run(name, p, par):
        outs[name] = decode(engines[name], p, par)

    threads = [threading.Thread(target=run, args=("d32", pa, params[0])),
               threading.Thread(target=run, args=("d64", pb, params[1]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert outs["d32"].tokens == refs["d32"] and outs["d64"].tokens == refs["d64"]
    assert outs["d32"].num_cached_tokens >= 96 and outs["d64"].num_cached_tokens >= 160


def test_incompatible_pair_is_refused_and_request_fails_per_policy(engines):
    """A float32 decode engine meets a bf16 prefill engine: kvlc refuses the pairing (report in the
    log), and with policy "fail" the request fails instead of decoding garbage."""
    p = prompt(120, seed=5)
    (params,) = prefill(engines["p32"], [p])
    out = decode(engines["d32f"], p, params)
    assert out.finish_reason == "error", out
    log = engines.log("d32f")
    assert "kvlc: load of request" in log and "dtype" in log


def test_incompatible_pair_recomputes_with_policy_recompute(engines):
    """A bf16 decode engine given params whose prefill plan cannot pair (a float32 engine is the
    producer here) recomputes the prompt and still gives its own tokens."""
    p = prompt(120, seed=6)
    ref = own(engines["d32"], p)
    # the float32 engine is a consumer; act as a client that lies about which engine holds the KV
    (params,) = prefill(engines["p32"], [p])
    params["kvlc_addresses"] = [engines_address(engines, "d32f")]
    out = decode(engines["d32"], p, params)
    assert out.tokens == ref
    assert out.num_cached_tokens == 0


def engines_address(engines, name: str) -> str:
    import re

    found = re.findall(r"kvlc: rank 0 bound plan \S+ \(\w+\) at (\S+)", engines.log(name))
    assert found, f"engine {name} logged no kvlc address"
    return found[-1]


def test_prefill_engine_killed_after_prefill_decode_recomputes(engines):
    """The prefill engine dies after prefill: the decode engine (policy "recompute") computes the
    prompt itself and its tokens still match. Runs last: it kills p32."""
    p = prompt(140, seed=9)
    ref = own(engines["d32"], p)
    (params,) = prefill(engines["p32"], [p])
    engines.procs["p32"].kill()
    out = decode(engines["d32"], p, params)
    assert out.tokens == ref
    assert "kvlc: load of request" in engines.log("d32")
