"""KvlcConnector's inputs without an engine: extra config, kv_transfer_params, lazy vLLM import."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvlc.engines.vllm.connector.config import ConnectorSettings, Mode
from kvlc.engines.vllm.connector.params import RemotePrefill
from kvlc.errors import KvlcError
from tests.engines.conftest import ROOT

GOOD = dict(remote_engine_id="e", remote_request_id="r", remote_block_ids=[[1, 2]], remote_num_tokens=40,
            remote_host="127.0.0.1", remote_port=7100, tp_size=2, remote_block_size=32,
            kvlc_addresses=["127.0.0.1:7100", "127.0.0.1:7101"], kvlc_push_addresses=["a:1", "a:2"])


def test_import_kvlc_and_the_adapter_import_no_vllm():
    """`import kvlc` and `import kvlc.engines.vllm` leave vLLM unimported (it is an optional extra)."""
    code = ("import sys, kvlc, kvlc.engines.vllm, kvlc.engines.vllm.connector.config, kvlc.engines.vllm.connector.params;"
            "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("extra,needle", [
    ({"mode": "pul"}, "did you mean 'pull'"),
    ({"prot": 7100}, "unknown key 'prot'; did you mean 'port'"),
    ({"port": 70000}, "expected 0..65535, found 70000"),
    ({"port": "x"}, "kv_connector_extra_config.port"),
    ({"lease": 0}, "lease and timeout must be positive"),
])
def test_bad_extra_config_names_the_key(extra, needle):
    """Every bad kv_connector_extra_config value is a KvlcError naming the key and the fix."""
    with pytest.raises(KvlcError) as err:
        ConnectorSettings.from_extra(extra)
    assert needle in str(err.value)


def test_extra_config_defaults_and_ports():
    s = ConnectorSettings.from_extra({"host": "0.0.0.0", "port": 7100, "mode": "pull_via_push"})
    assert (s.mode, s.port_for(0), s.port_for(3), s.lease) == (Mode.PULL_VIA_PUSH, 7100, 7103, 30.0)
    assert ConnectorSettings.from_extra(None).port_for(1) == 0


def test_remote_prefill_round_trip_keeps_vllm_and_unknown_fields_out():
    """The params round-trip; fields vLLM adds (remote_prefill_cached_tokens) are ignored on parse."""
    p = RemotePrefill.from_params({**GOOD, "remote_prefill_cached_tokens": 3})
    assert RemotePrefill.from_params(p.to_params()) == p
    assert p.effective_mode(Mode.PUSH) is Mode.PUSH
    assert RemotePrefill.from_params({**GOOD, "mode": "pull"}).effective_mode(Mode.PUSH) is Mode.PULL


@pytest.mark.parametrize("change,needle", [
    ({"connector": "nixl"}, "come from connector 'nixl'"),
    ({"remote_block_ids": "x"}, "kv_transfer_params.remote_block_ids"),
    ({"tp_size": 3}, "tp_size is 3 but 2 kvlc address(es)"),
    ({"remote_num_tokens": -1}, "kv_transfer_params.remote_num_tokens"),
])
def test_bad_params_say_which_field(change, needle):
    with pytest.raises(KvlcError) as err:
        RemotePrefill.from_params({**GOOD, **change})
    assert needle in str(err.value)


def test_missing_field_is_named():
    bad = dict(GOOD)
    del bad["kvlc_addresses"]
    with pytest.raises(KvlcError, match="kvlc_addresses"):
        RemotePrefill.from_params(bad)
