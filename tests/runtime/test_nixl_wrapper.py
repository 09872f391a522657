"""The NIXL choke point: typed errors naming the operation, XferState instead of strings, idempotent
handles, prepared (also strided Nx5) descriptor lists — on a real UCX agent."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvlc.runtime.errors import NixlError
from kvlc.runtime.nixl.core import Agent, Xfer, XferState, call, check

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")
pytestmark = pytest.mark.runtime


def test_check_turns_err_none_and_exceptions_into_nixl_errors():
    """'ERR', None and exceptions become NixlError with the operation named; values pass through."""
    assert check(b"x", "get metadata") == b"x"
    with pytest.raises(NixlError, match="NIXL post transfer failed: NIXL_ERR"):
        check("ERR", "post transfer")
    with pytest.raises(NixlError, match="get notifications failed: no result"):
        check(None, "get notifications")
    with pytest.raises(NixlError, match="add remote agent failed: ValueError: bad"):
        call("add remote agent", lambda: (_ for _ in ()).throw(ValueError("bad")))


def _wait(agent, x, timeout=5.0):
    deadline = time.monotonic() + timeout
    while agent.state(x) is XferState.PROC and time.monotonic() < deadline:
        pass
    return agent.state(x)


@pytest.fixture(scope="module")
def agent():
    a = Agent("wrapper-test", progress_thread=True)
    yield a
    a.close()


def test_prepared_and_strided_lists_move_bytes(agent):
    """A loopback READ between prepared lists (the local one a strided Nx5 row) copies the chosen blocks."""
    src = torch.arange(64 * 1024, dtype=torch.int32).view(torch.uint8)  # 256 KiB, 64 blocks of 4 KiB
    dst = torch.zeros(64 * 4096, dtype=torch.uint8)
    regs = [
        agent.register(np.array([[t.data_ptr(), t.numel(), 0]], dtype=np.uint64), "DRAM", what=name)
        for name, t in (("src", src), ("dst", dst))
    ]
    local = agent.prep(None, np.array([[dst.data_ptr(), 4096, 0, 4096, 64]], dtype=np.uint64), "DRAM")
    remote = agent.prep(
        agent.name,
        np.array([[src.data_ptr() + 4096 * i, 4096, 0] for i in range(64)], dtype=np.uint64),
        "DRAM",
    )
    assert (local.count, remote.count) == (64, 64)
    x = agent.make_prepped("READ", local, np.array([0, 1, 2]), remote, np.array([10, 20, 63]))
    assert isinstance(x, Xfer) and agent.post(x) in (XferState.DONE, XferState.PROC)
    assert _wait(agent, x) is XferState.DONE
    got = dst.view(64, 4096)
    want = src.view(64, 4096)
    assert torch.equal(got[0], want[10]) and torch.equal(got[1], want[20]) and torch.equal(got[2], want[63])
    assert int(got[3:].sum()) == 0
    x.release()
    x.release()  # idempotent
    for h in (local, remote, *regs):
        h.release()
    assert agent.live_handles == 0


def test_failures_name_the_operation(agent):
    """Unregistered memory, an unknown peer, a bad operation: NixlError saying which call failed."""
    buf = torch.zeros(4096, dtype=torch.uint8)
    rows = np.array([[buf.data_ptr(), 4096, 0]], dtype=np.uint64)
    with pytest.raises(NixlError, match=r"create READ .* to 'nobody'.*NIXL_ERR"):
        agent.initialize("READ", rows, "DRAM", rows, "DRAM", "nobody")
    with pytest.raises(NixlError, match="send notification to 'nobody' failed: NIXL_ERR_NOT_FOUND"):
        agent.send_notif("nobody", b"hi")
    with pytest.raises(NixlError, match="expected READ or WRITE"):
        agent.initialize("COPY", rows, "DRAM", rows, "DRAM", "nobody")
    with pytest.raises(NixlError, match=r"expected an \(N, 3\)"):
        agent.initialize("READ", rows[:, :2], "DRAM", rows, "DRAM", "nobody")
    with pytest.raises(NixlError, match="add remote agent failed: NIXL_ERR_MISMATCH"):
        agent.add_remote(b"not metadata")
    assert agent.live(Xfer) == [] and agent.remotes == frozenset()


def test_closed_agent_refuses_use():
    """After close() every handle is released and further calls raise NixlError, not AttributeError."""
    a = Agent("closing-test")
    buf = torch.zeros(4096, dtype=torch.uint8)
    a.register(np.array([[buf.data_ptr(), 4096, 0]], dtype=np.uint64), "DRAM")
    assert a.close() == [] and a.live_handles == 0
    assert a.close() == []
    with pytest.raises(NixlError, match="closed"):
        a.metadata()
