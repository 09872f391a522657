"""Restarts: an engine restarted on the same address (what a supervisor does) or a new one is reached
again without restarting its peers, and the first request after it moves its bytes (never a silent
failure); the loss is reported once; nothing leaks across restarts (fds, threads, NIXL handles,
remote agents, sessions, records). Real NIXL agents, one process per engine, every byte checked.
"""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
from runtime_engines import TEST_LAYOUTS, TIMEOUT, check_bytes, config, flip, move

from kvlc import compile_spec
from kvlc.demo.procs import EngineProcess, stop_engines

pytest.importorskip("torch")
pytest.importorskip("nixl")
pytestmark = pytest.mark.runtime
RESTARTS = 2


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


MODES = ("direct", "prepped", "pull_via_push")


def _pull_checked(cons, plan, peer_id: str, tag: str) -> None:
    """Pull two requests through ``peer_id`` and check every byte of the consumer."""
    before = cons.call("dump")
    move(cons, peer_id, "read", _reqs(tag))
    check_bytes(cons, plan, plan, before, _reqs(tag))


def _assert_flat(first: dict, after: dict) -> None:
    """Nothing piled up between two ``resources`` readings of one engine process."""
    for k in ("remotes", "sessions", "nixl_handles", "incoming", "in_flight"):
        assert after[k] == first[k], (k, first, after)
    assert after["fds"] <= first["fds"] + 2 and after["threads"] <= first["threads"], (first, after)


def test_a_producer_restarted_on_its_address_is_reached_again_in_every_mode(plan):
    """One consumer, one peer per mode, all to one producer that is killed (kill -9) and restarted on
    the same address, twice: each peer reconnects by itself at its next request, which moves every
    byte; each loss is counted once per peer; nothing piles up (remote agents, sessions, handles,
    fds, threads)."""
    port = _port()
    pproc, prod = _start(plan, "content", "rp", port=port)
    cproc, cons = _start(plan, "random", "rc", seed=7)
    try:
        for mode in MODES:
            cons.connect([prod.address], "READ", mode, mode)
        first = None
        for i in range(RESTARTS + 1):
            if i:
                pproc.kill()
                pproc, prod = _start(plan, "content", "rp", port=port)
            for mode in MODES:
                _pull_checked(cons, plan, mode, f"{mode}{i}")
            first = first or cons.call("resources")
        after = cons.call("resources")
        assert cons.call("stats").get("sessions_lost") == RESTARTS * len(MODES)
        _assert_flat(first, after)
    finally:
        stop_engines([prod, cons])


def test_a_producer_restarted_elsewhere_is_reached_by_connecting_again(plan):
    """On a new address the engine closes the old peer and connects to the new one: bytes move, and
    the old connection leaves nothing behind."""
    pproc, prod = _start(plan, "content", "rn")
    cproc, cons = _start(plan, "random", "rnc", seed=8)
    try:
        cons.connect([prod.address], "READ", "direct", "p")
        move(cons, "p", "read", _reqs("n0"))
        first = cons.call("resources")
        for i in range(1, RESTARTS + 1):
            pproc.kill()
            pproc, prod = _start(plan, "content", "rn")
            cons.call("peer_close", "p")
            cons.connect([prod.address], "READ", "direct", "p")
            _pull_checked(cons, plan, "p", f"n{i}")
        after = cons.call("resources")
        _assert_flat(first, after)
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


def test_kv_produced_before_a_restart_is_never_read(plan):
    """A read that says when its KV was produced (``produced_at``, the producer's clock) is refused once the
    producer rank restarted after that time, in every mode, even though the address answers again (the
    new epoch's memory holds other bytes): nothing moves. KV produced after the restart is read."""
    port = _port()
    pproc, prod = _start(plan, "content", "pa-p", port=port)
    cproc, cons = _start(plan, "random", "pa-c", seed=5)
    try:
        for mode in MODES:
            cons.connect([prod.address], "READ", mode, mode)
        produced = time.time()
        for mode in MODES:
            before = cons.call("dump")
            assert not cons.call("submit", mode, "read", _reqs(f"{mode}-ok"), TIMEOUT, 0, {"produced_at": produced})
            assert cons.call("wait", [r[0] for r in _reqs(f"{mode}-ok")], TIMEOUT)["failed"] == {}
            check_bytes(cons, plan, plan, before, _reqs(f"{mode}-ok"))
        pproc.kill()
        pproc, prod = _start(plan, "content", "pa-p", port=port)
        for mode in MODES:
            before = cons.call("dump")
            errors = cons.call("submit", mode, "read", _reqs(f"{mode}-old"), TIMEOUT, 0, {"produced_at": produced})
            assert set(errors) == {f"{mode}-old-a", f"{mode}-old-b"}, errors
            assert "no longer holds it; nothing read" in errors[f"{mode}-old-a"], errors
            after = cons.call("dump")
            assert all(np.array_equal(after[k], before[k]) for k in before), f"{mode}: bytes moved after the refusal"
        fresh = time.time()
        for mode in MODES:
            _pull = _reqs(f"{mode}-new")
            before = cons.call("dump")
            assert not cons.call("submit", mode, "read", _pull, TIMEOUT, 0, {"produced_at": fresh})
            assert cons.call("wait", [r[0] for r in _pull], TIMEOUT)["failed"] == {}
            check_bytes(cons, plan, plan, before, _pull)
    finally:
        stop_engines([prod, cons])
