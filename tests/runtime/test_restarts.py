"""Restarts: an engine restarted on the same address (what a supervisor does) or a new one is reached
again without restarting its peers, and the first request after it moves its bytes (never a silent
failure); the loss is reported once; nothing leaks across restarts (fds, threads, NIXL handles,
remote agents, sessions, records). Real NIXL agents, one process per engine, every byte checked.
"""

from __future__ import annotations

import socket

import pytest
from runtime_engines import TEST_LAYOUTS, check_bytes, config, flip, move

from kvlc import compile_spec
from kvlc.demo.procs import EngineProcess, stop_engines

pytest.importorskip("torch")
pytest.importorskip("nixl")
pytestmark = pytest.mark.runtime
RESTARTS = 3


@pytest.fixture(scope="module")
def plan():
    return compile_spec(TEST_LAYOUTS / "dense-tp1.yaml")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reqs(tag: str) -> list:
    return [(f"{tag}-a", {"full": [1, 2]}, {"full": [5, 6]}, 30), (f"{tag}-b", {"full": [9]}, {"full": [3]}, 16)]


def _start(plan, fill: str, eid: str, port: int = 0, seed: int = 0):
    proc = EngineProcess()
    return proc, proc.add(config(plan, 0, fill, seed=seed, engine_id=eid, port=port))


@pytest.mark.parametrize("mode, where", [("direct", "same"), ("prepped", "same"), ("pull_via_push", "same"),
                                         ("direct", "new")])
def test_a_restarted_producer_is_reached_again(plan, mode, where):
    """The consumer's one peer keeps working across producer restarts (kill -9): on the same address it
    reconnects by itself; on a new one the engine closes the old peer and connects to the new address.
    The first request after each restart moves every byte; nothing piles up."""
    port = _port()
    pproc, prod = _start(plan, "content", f"rp-{mode}", port=port)
    cproc, cons = _start(plan, "random", f"rc-{mode}", seed=7)
    try:
        cons.connect([prod.address], "READ", mode, "p")
        before = cons.call("dump")
        move(cons, "p", "read", _reqs("r0"))
        check_bytes(cons, plan, plan, before, _reqs("r0"))
        first = cons.call("resources")
        for i in range(1, RESTARTS + 1):
            pproc.kill()
            pproc, prod = _start(plan, "content", f"rp-{mode}", port=port if where == "same" else 0)
            if where == "new":
                cons.call("peer_close", "p")
                cons.connect([prod.address], "READ", mode, "p")
            before = cons.call("dump")
            move(cons, "p", "read", _reqs(f"r{i}"))
            check_bytes(cons, plan, plan, before, _reqs(f"r{i}"))
        after = cons.call("resources")
        stats = cons.call("stats")
        if where == "same":
            assert stats.get("sessions_lost") == RESTARTS
        for k in ("remotes", "sessions", "nixl_handles", "incoming", "in_flight"):
            assert after[k] == first[k], (k, first, after)
        assert after["fds"] <= first["fds"] + 2 and after["threads"] <= first["threads"], (first, after)
    finally:
        stop_engines([prod, cons])


def test_a_restarted_consumer_is_pushed_to_again(plan):
    """Push: the producer's peer reconnects to a consumer restarted on the same address, whose memory is
    new; the first write after it lands every byte."""
    port = _port()
    pproc, prod = _start(plan, "content", "pp-push")
    cproc, cons = _start(plan, "random", "pc-push", port=port, seed=3)
    try:
        prod.connect([cons.address], "WRITE", "direct", "c")
        for i in range(3):
            if i:
                cproc.kill()
                cproc, cons = _start(plan, "random", "pc-push", port=port, seed=3 + i)
            before = cons.call("dump")
            move(prod, "c", "write", flip(_reqs(f"w{i}")), waiters=[cons])
            check_bytes(cons, plan, plan, before, _reqs(f"w{i}"))
        assert prod.call("stats").get("sessions_lost") == 2
        assert prod.call("resources")["remotes"] == 1
    finally:
        stop_engines([prod, cons])


def test_a_producer_that_stays_down_refuses_the_request_with_why(plan):
    pproc, prod = _start(plan, "content", "down-p")
    cproc, cons = _start(plan, "random", "down-c")
    try:
        cons.connect([prod.address], "READ", "direct", "p")
        pproc.kill()
        errors = cons.call("submit", "p", "read", _reqs("gone"), 5.0)
        assert set(errors) == {"gone-a", "gone-b"}
        assert "lost" in errors["gone-a"] and "connecting again failed" in errors["gone-a"], errors
        assert cons.call("resources")["remotes"] == 0
    finally:
        stop_engines([prod, cons])
