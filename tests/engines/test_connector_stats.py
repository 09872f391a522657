"""KvlcConnector's metrics through vLLM's own connector stats (``KVConnectorStats``), between real engines.

The stats are read where vLLM's stats logger aggregated them (worker → scheduler → scheduler stats →
``build_kv_connector_stats`` → ``aggregate``), so the whole path vLLM uses to log "KV Transfer
metrics" is exercised, not the connector's own counters.
"""

from __future__ import annotations

import pytest

from testkit.vllm_engines import EngineSpec
from tests.engines.conftest import Engines, engine_env, for_decode, kvlc_config, prompt

pytestmark = pytest.mark.engine
QUIET = {"VLLM_LOG_STATS_INTERVAL": "100000"}  # vLLM's periodic log would reset what the test reads


@pytest.fixture(scope="module")
def engines(model_dir, tmp_path_factory):
    e = Engines(tmp_path_factory.mktemp("stats-logs"))
    e.start("p", EngineSpec(model_dir, 32, connector=kvlc_config("kv_producer"), env={**engine_env(0), **QUIET},
                            log_stats=True))
    e.start("d", EngineSpec(model_dir, 32, connector=kvlc_config("kv_consumer"), env={**engine_env(1), **QUIET},
                            log_stats=True))
    yield e
    e.close()


def _prefill(engine, p) -> dict:
    (out,) = engine.generate([p], 1, [{"do_remote_decode": True}])
    return for_decode(out.kv_transfer_params)


def test_a_pd_request_shows_in_vllms_connector_stats(engines):
    """After one P/D request the decode engine's stats (as vLLM aggregated them) count one load, its
    bytes (2 layers x 150 tokens x 2 KV heads x 64 x K,V x bf16) in descriptors > 0, a transfer time and
    the connector's overhead, no failure; the tokens equal the decode engine's own."""
    d, p = engines["d"], engines["p"]
    x = prompt(150, seed=5)
    ref = d.generate([x], 8)[0].tokens
    d.transfer_metrics()  # whatever came before
    out = d.generate([x], 8, [_prefill(p, x)])[0]
    m = d.transfer_metrics()
    assert out.tokens == ref and out.num_cached_tokens >= 149
    r = m["reduced"]
    assert r["loads"] == 1 and r["failures"] == 0 and r["recomputes"] == 0, m
    assert r["bytes"] == 2 * 150 * 2 * 64 * 2 * 2, m
    assert r["descriptors"] > 0 and r["transfer_ms_p50"] > 0 and r["overhead_ms_p50"] >= 0, m
    assert len(m["data"]["transfer_s"]) == 1


def test_a_failed_load_counts_a_failure_and_a_recompute(engines):
    """Negative control: a decode given params whose producer address is dead fails its load; vLLM's
    stats count one failure and one recompute (policy "recompute"), no load and no bytes, and the
    recomputed tokens still equal the engine's own."""
    d, p = engines["d"], engines["p"]
    x = prompt(100, seed=6)
    ref = d.generate([x], 8)[0].tokens
    params = _prefill(p, x)
    params["kvlc_addresses"] = ["127.0.0.1:9"]  # discard port: nothing serves there
    d.transfer_metrics()
    out = d.generate([x], 8, [params])[0]
    r = d.transfer_metrics()["reduced"]
    assert out.tokens == ref
    assert (r["failures"], r["recomputes"], r["loads"], r["bytes"]) == (1, 1, 0, 0), r
