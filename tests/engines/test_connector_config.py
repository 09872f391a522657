"""KvlcConnector's inputs without an engine: extra config, kv_transfer_params, lazy vLLM import."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvlc.engines.vllm.connector.config import ConnectorSettings, TransferMode
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
    assert (s.mode, s.port_for(0), s.port_for(3), s.lease) == (TransferMode.PULL_VIA_PUSH, 7100, 7103, 30.0)
    assert ConnectorSettings.from_extra(None).port_for(1) == 0


def test_remote_prefill_round_trip_keeps_vllm_and_unknown_fields_out():
    """The params round-trip; fields vLLM adds (remote_prefill_cached_tokens) are ignored on parse."""
    p = RemotePrefill.from_params({**GOOD, "remote_prefill_cached_tokens": 3})
    assert RemotePrefill.from_params(p.to_params()) == p
    assert p.effective_mode(TransferMode.PUSH) is TransferMode.PUSH
    assert RemotePrefill.from_params({**GOOD, "mode": "pull"}).effective_mode(TransferMode.PUSH) is TransferMode.PULL


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


def _connector(role_name: str):
    """A KvlcConnector of the given role over a minimal config (no engine, no KV cache bound)."""
    from types import SimpleNamespace as NS

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvlc.engines.vllm.connector.connector import KvlcConnector

    config = NS(kv_transfer_config=NS(kv_connector_extra_config={}, engine_id="e0"),
                parallel_config=NS(tensor_parallel_size=1, decode_context_parallel_size=1),
                cache_config=NS(block_size=32))
    return KvlcConnector(config, getattr(KVConnectorRole, role_name), None)


def test_hooks_keep_vllm_names_on_the_connector_and_on_each_side():
    """Every hook KvlcConnector delegates is vLLM's KVConnectorBase_V1 hook of that name, and the scheduler or
    worker side has a method of the same name (get_finished reads get_transfer_results, the one poll)."""
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

    from kvlc.engines.vllm.connector.connector import (HMA_HOOKS, SCHEDULER_HOOKS, SCHEDULER_HOOKS_034,
                                                       WORKER_HOOKS, WORKER_HOOKS_034, KvlcConnector)
    from kvlc.engines.vllm.connector.scheduler import SchedulerSide
    from kvlc.engines.vllm.connector.worker import WorkerSide

    assert len(WORKER_HOOKS) + len(SCHEDULER_HOOKS) == 15
    for side, hooks in ((WorkerSide, WORKER_HOOKS), (SchedulerSide, SCHEDULER_HOOKS)):
        for hook in hooks:
            assert hasattr(KVConnectorBase_V1, hook), hook
            assert hook == "get_finished" or callable(getattr(side, hook, None)), f"{side.__name__}.{hook}"
    # vLLM 0.34's hooks (checked against 0.34's own source in test_vllm_034_source.py)
    for side, hooks in ((WorkerSide, WORKER_HOOKS_034), (SchedulerSide, SCHEDULER_HOOKS_034)):
        for hook in hooks:
            assert callable(getattr(KvlcConnector, hook)) and callable(getattr(side, hook, None)), hook
    assert issubclass(KvlcConnector, SupportsHMA)   # vLLM keeps its hybrid KV-cache manager on
    for hook in HMA_HOOKS:
        assert hasattr(SupportsHMA, hook) and callable(getattr(SchedulerSide, hook, None)), hook


@pytest.mark.parametrize("role,hook,args", [
    ("SCHEDULER", "start_load_kv", (None,)), ("SCHEDULER", "wait_for_save", ()),
    ("SCHEDULER", "get_transfer_results", (set(),)), ("SCHEDULER", "register_kv_caches", ({},)),
    ("WORKER", "get_num_new_matched_tokens", (None, 0)), ("WORKER", "build_connector_meta", (None,)),
    ("WORKER", "request_finished", (None, [])), ("WORKER", "request_finished_all_groups", (None, ([],))),
    ("SCHEDULER", "unregister_kv_caches", ()), ("SCHEDULER", "restore_kv_caches", ()),
    ("WORKER", "may_load_async", (None,)),
])
def test_a_hook_called_on_the_other_role_names_the_hook_and_both_roles(role, hook, args):
    """A worker hook on the scheduler-role connector (and the other way round) raises a KvlcError that names
    the hook, the connector's role and the role the hook belongs to."""
    pytest.importorskip("vllm")
    c = _connector(role)
    with pytest.raises(KvlcError) as err:
        getattr(c, hook)(*args)
    wants = "WORKER" if role == "SCHEDULER" else "SCHEDULER"
    assert f"KvlcConnector.{hook}" in str(err.value) and f"role {role}" in str(err.value)
    assert f"{wants}-role connector" in str(err.value)


def test_one_worker_method_polls_the_agent():
    """Only WorkerSide.get_transfer_results drains the agent's completions (Transport.poll); get_finished
    and every other hook read its results."""
    import ast
    import inspect

    from kvlc.engines.vllm.connector import connector, worker

    def pollers(module) -> set[str]:
        tree = ast.parse(inspect.getsource(module))
        return {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                for n in ast.walk(f) if isinstance(n, ast.Attribute) and n.attr == "poll"}

    pytest.importorskip("vllm")
    assert pollers(worker) == {"get_transfer_results"} and pollers(connector) == set()


def test_a_load_is_one_token_range_and_one_block_ids_value_per_side():
    """metadata.Load carries the compiler's TokenRange (num_tokens is its length, a count) and the plan's
    group name -> ids for each side, as the scheduler builds them from vLLM's per-group lists."""
    pytest.importorskip("vllm")
    from kvlc.compiler.request.tokens import TokenRange
    from kvlc.engines.vllm.connector.metadata import Load, plan_block_ids

    load = Load("r", RemotePrefill.from_params(GOOD), plan_block_ids(("full",), [[7, 8]]),
                plan_block_ids(("full",), [[1, 2]]), TokenRange(40, 70), TransferMode.PULL, ("a:1",))
    assert (load.num_tokens, load.tokens.start, dict(load.local_block_ids)) == (30, 40, {"full": (7, 8)})
    with pytest.raises(KvlcError, match="2 KV-cache groups of block ids, but the plan has 1"):
        plan_block_ids(("full",), [[1], [2]])


def test_a_producer_of_another_cpu_isa_fails_the_load_with_the_reason():
    """A vec decode worker given an amx producer's params never starts the transfer: the load fails with
    why (entries of 16 tokens against 1) and the fix, and its blocks go to vLLM's failure policy."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace as NS

    from kvlc.compiler.request.tokens import TokenRange
    from kvlc.engines.vllm.connector.metadata import KvlcConnectorMetadata, Load, plan_block_ids
    from kvlc.engines.vllm.connector.worker import WorkerSide
    from kvlc.runtime import Completions

    class Transport:
        ep = NS(cpu_isa="vec", groups=("full",))
        loads: list = []

        def load(self, load, ask):
            self.loads.append(load)

        def forget_peer(self, addresses):
            pass

        def poll(self):
            return Completions()

    w = WorkerSide(None, None, ConnectorSettings())
    w.transport = t = Transport()
    remote = RemotePrefill.from_params({**GOOD, "kvlc_cpu_isa": "amx"})
    w.start_load_kv(KvlcConnectorMetadata(loads=[Load("req-1", remote, plan_block_ids(("full",), [[7, 8]]),
                                                      plan_block_ids(("full",), [[1, 2]]), TokenRange(0, 40),
                                                      TransferMode.PULL, ("a:1",))]))
    assert t.loads == []
    results = w.get_transfer_results(set())
    assert results.finished_recving == {"req-1"} and w.get_block_ids_with_load_errors() == {7, 8}
