"""UCX backend options: typed, validated, passed to NIXL's UCX backend; the cuda_ipc READ default is
set at agent creation only when the user has not set it, never at import."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvlc.errors import KvlcError
from kvlc.runtime.settings import AgentSettings
from kvlc.runtime.nixl import ucx
from kvlc.runtime.nixl.ucx import GET_ZCOPY_ENV, ErrorHandling, UcxOptionError, UcxOptions, apply_env


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"num_threads": -1}, "num_threads: expected an integer in 0..256"),
        ({"num_threads": "4"}, "got '4'"),
        ({"split_batch_size": 0}, "split_batch_size"),
        ({"num_workers": True}, "num_workers"),
        ({"error_handling": "peeer"}, "did you mean 'peer'"),
        ({"extra": {"num_threads": "2"}}, "typed fields"),
        ({"extra": {"ucx_devices": 3}}, "must be strings"),
        ({"cuda_ipc_get_zcopy": "y"}, "True or False"),
    ],
)
def test_bad_options_are_kvlc_errors_naming_the_field(kwargs, words):
    """Every bad value is a UcxOptionError (a KvlcError) naming the field and what it got."""
    with pytest.raises(UcxOptionError, match=words) as info:
        UcxOptions(**kwargs)
    assert isinstance(info.value, KvlcError)


def test_backend_params_default_and_set_values():
    """Default: no thread pool (the measured faster setting); set values, and the environment's, reach
    the backend parameters; a bad environment value is a UcxOptionError naming the variable."""
    assert UcxOptions().backend_params() == {"num_workers": "1"}
    assert UcxOptions(num_threads=4).backend_params() == {
        "num_threads": "4", "split_batch_size": "4", "num_workers": "1"}
    opts = UcxOptions(num_threads=8, split_batch_size=2, num_workers=2, error_handling="none",
                      extra={"ucx_devices": "lo"})
    assert opts.error_handling is ErrorHandling.NONE
    assert opts.backend_params() == {
        "num_threads": "8", "split_batch_size": "2", "num_workers": "2",
        "ucx_error_handling_mode": "none", "ucx_devices": "lo"}
    env = {"KVLC_UCX_NUM_THREADS": "4", "KVLC_UCX_SPLIT_BATCH_SIZE": "8", "KVLC_UCX_NUM_WORKERS": "2"}
    assert UcxOptions.from_env(env) == UcxOptions(num_threads=4, split_batch_size=8, num_workers=2)
    assert UcxOptions.from_env({}) == UcxOptions()
    with pytest.raises(UcxOptionError, match="KVLC_UCX_NUM_THREADS='four'"):
        UcxOptions.from_env({"KVLC_UCX_NUM_THREADS": "four"})


def test_env_default_only_when_unset_and_only_with_cuda():
    """GET_ZCOPY is set to y when absent on a CUDA machine; a user's value is kept; opting out sets nothing."""
    env: dict[str, str] = {}
    assert apply_env(UcxOptions(), env, cuda=True) == {GET_ZCOPY_ENV: "y"} and env == {GET_ZCOPY_ENV: "y"}
    env = {GET_ZCOPY_ENV: "n"}
    assert apply_env(UcxOptions(), env, cuda=True) == {} and env == {GET_ZCOPY_ENV: "n"}
    env = {}
    assert apply_env(UcxOptions(cuda_ipc_get_zcopy=False), env, cuda=True) == {} and env == {}
    assert apply_env(UcxOptions(), env, cuda=False) == {} and env == {}


def test_import_sets_no_ucx_variable():
    """Importing the runtime leaves UCX's environment alone (the default is applied at agent creation)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    code = ("import os, kvlc.runtime, kvlc.runtime.nixl.core, kvlc.runtime.staging.endpoint; "
            "print(sorted(k for k in os.environ if k.startswith('UCX_')))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.runtime
def test_agent_creates_ucx_with_the_options(monkeypatch):
    """A real agent hands the parameters to NIXL (read back from the backend) and applies the env default
    at creation when a GPU is reported."""
    pytest.importorskip("nixl")
    from kvlc.runtime.nixl.core import Agent

    monkeypatch.delenv(GET_ZCOPY_ENV, raising=False)
    monkeypatch.setattr(ucx, "cuda_visible", lambda: True)
    monkeypatch.setattr(ucx, "_set_by_kvlc", set())
    agent = Agent("ucx-params-test", ucx=UcxOptions(num_threads=2, split_batch_size=8))
    try:
        assert os.environ.get(GET_ZCOPY_ENV) == "y"
        assert agent.backend_params["UCX"] == {"num_threads": "2", "split_batch_size": "8", "num_workers": "1"}
        got = agent._nixl.get_backend_params("UCX")
        assert (got["num_threads"], got["split_batch_size"]) == ("2", "8")
    finally:
        agent.close()
        os.environ.pop(GET_ZCOPY_ENV, None)


@pytest.mark.parametrize("env, vram, threads", [
    ({}, True, "4"), ({}, False, None), ({"KVLC_UCX_NUM_THREADS": "0"}, True, None),
    ({"KVLC_UCX_NUM_THREADS": "8"}, False, "8"), ({"KVLC_UCX_SPLIT_BATCH_SIZE": "16"}, True, "4"),
])
def test_default_thread_pool_for_agents_that_hold_vram(env, vram, threads):
    """An agent with VRAM gets UCX's thread pool unless KVLC_UCX_NUM_THREADS says otherwise (0: none);
    a DRAM-only agent keeps NIXL's default; the other variables still apply."""
    params = UcxOptions.for_agent(vram, env).backend_params()
    assert params.get("num_threads") == threads
    if "KVLC_UCX_SPLIT_BATCH_SIZE" in env:
        assert params["split_batch_size"] == "16"


def test_dram_kv_agent_keeps_nixls_default(monkeypatch):
    """A KvAgent over DRAM only creates its UCX backend without a thread pool (read back from NIXL)."""
    pytest.importorskip("nixl")
    from kvlc.runtime import KvAgent, allocate
    from kvlc.demo.run import DEFAULT_LAYOUT, cpu_plan

    monkeypatch.delenv("KVLC_UCX_NUM_THREADS", raising=False)
    plan = cpu_plan(DEFAULT_LAYOUT, max_bytes=1 << 20)
    with KvAgent(plan, 0, allocate(plan), AgentSettings(insecure=True, progress="manual")) as agent:
        assert "num_threads" not in agent.nixl.backend_params["UCX"]
        assert agent.nixl.ucx == UcxOptions.for_agent(False, {})
