"""Restarts: an engine restarted on the same address (what a supervisor does) or a new one is reached
again without restarting its peers, and the first request after it moves its bytes (never a silent
failure); the loss is reported once; nothing leaks across restarts (fds, threads, NIXL handles,
remote agents, sessions, records). Real NIXL agents, one process per engine, every byte checked.
"""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest
from runtime_engines import (TEST_LAYOUTS, TIMEOUT, check_bytes, config, flip, free_port, move, start_one,
                             two_requests)

from kvlc import compile_spec
from kvlc.demo.procs import EngineProcess, stop_engines

pytest.importorskip("torch")
pytest.importorskip("nixl")
pytestmark = pytest.mark.runtime
RESTARTS = 2


@pytest.fixture(scope="module")
def plan():
    return compile_spec(TEST_LAYOUTS / "dense-tp1.yaml")


MODES = ("direct", "prepped", "pull_via_push")


def _pull_checked(cons, plan, peer_id: str, tag: str, options: dict | None = None) -> None:
    """Pull two requests through ``peer_id`` (``options``: more arguments of ``read``) and check every byte
    of the consumer."""
    before = cons.call("dump")
    move(cons, peer_id, "read", two_requests(tag), options=options)
    check_bytes(cons, plan, plan, before, two_requests(tag))


def _assert_flat(first: dict, after: dict) -> None:
    """Nothing piled up between two ``resources`` readings of one engine process."""
    for k in ("remotes", "sessions", "records", "nixl_handles", "incoming", "in_flight"):
        assert after[k] == first[k], (k, first, after)
    assert after["fds"] <= first["fds"] + 2 and after["threads"] <= first["threads"], (first, after)
    assert after["tasks"] <= first["tasks"] + 1, (first, after)


MANY = 20     # restarts of the many-restarts tests
SETTLED = 3   # readings after this many restarts are the baseline: nothing grows after it
KILL_EVERY = 10  # every 10th restart is a kill -9 and a new process; the others a new agent in the process


def _restart(proc, handle, plan, fill: str, eid: str, port: int, i: int, seed: int = 0):
    """Restart the engine of ``handle`` on ``port`` (restart ``i``): every KILL_EVERY-th one kills its process
    (kill -9) and starts a new one; the others close its agent and start a new one (a new epoch, new
    connections) in the same process, which takes 0.15 s instead of 4."""
    if i % KILL_EVERY == 0:
        proc.kill()
        return start_one(plan, fill, eid, port=port, seed=seed)
    handle.call("drop")
    return proc, proc.add(config(plan, 0, fill, seed=seed, engine_id=eid, port=port))


def _figures(who: str, readings: dict[int, dict]) -> None:
    """The readings of the survivor, one line per restart count (pytest -s shows them)."""
    keys = ("fds", "threads", "tasks", "nixl_handles", "remotes", "sessions", "records", "rss_kib")
    for i, r in readings.items():
        print(f"{who} after {i:2d} restarts: " + " ".join(f"{k}={r[k]}" for k in keys))


def test_a_producer_restarted_on_its_address_is_reached_again_in_every_mode(plan):
    """One consumer, one peer per mode, all to one producer that is killed (kill -9) and restarted on
    the same address, twice: each peer reconnects by itself at its next request, which moves every
    byte; each loss is counted once per peer; nothing piles up (remote agents, sessions, handles,
    fds, threads)."""
    port = free_port()
    pproc, prod = start_one(plan, "content", "rp", port=port)
    cproc, cons = start_one(plan, "random", "rc", seed=7)
    try:
        for mode in MODES:
            cons.connect([prod.address], "READ", mode, mode)
        first = None
        for i in range(RESTARTS + 1):
            if i:
                pproc.kill()
                pproc, prod = start_one(plan, "content", "rp", port=port)
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
    pproc, prod = start_one(plan, "content", "rn")
    cproc, cons = start_one(plan, "random", "rnc", seed=8)
    try:
        cons.connect([prod.address], "READ", "direct", "p")
        move(cons, "p", "read", two_requests("n0"))
        first = cons.call("resources")
        for i in range(1, RESTARTS + 1):
            pproc.kill()
            pproc, prod = start_one(plan, "content", "rn")
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
    port = free_port()
    pproc, prod = start_one(plan, "content", "pp-push")
    cproc, cons = start_one(plan, "random", "pc-push", port=port, seed=3)
    try:
        prod.connect([cons.address], "WRITE", "direct", "c")
        for i in range(3):
            if i:
                cproc.kill()
                cproc, cons = start_one(plan, "random", "pc-push", port=port, seed=3 + i)
            before = cons.call("dump")
            move(prod, "c", "write", flip(two_requests(f"w{i}")), waiters=[cons])
            check_bytes(cons, plan, plan, before, two_requests(f"w{i}"))
        assert prod.call("stats").get("sessions_lost") == 2
        assert prod.call("resources")["remotes"] == 1
    finally:
        stop_engines([prod, cons])


def test_a_producer_that_stays_down_refuses_the_request_with_why(plan):
    pproc, prod = start_one(plan, "content", "down-p")
    cproc, cons = start_one(plan, "random", "down-c")
    try:
        cons.connect([prod.address], "READ", "direct", "p")
        pproc.kill()
        errors = cons.call("submit", "p", "read", two_requests("gone"), 5.0)
        assert set(errors) == {"gone-a", "gone-b"}
        assert "lost" in errors["gone-a"] and "connecting again failed" in errors["gone-a"], errors
        assert cons.call("resources")["remotes"] == 0
    finally:
        stop_engines([prod, cons])


def test_asked_pulls_end_soon_after_their_producer_is_killed(plan):
    """Pull via push: the producer is stopped (SIGSTOP) with the consumer's asks queued there, then
    killed (kill -9). Its side channel's loss ends the asked requests failed within a few seconds,
    not at their 30 s deadline, each reported once, with why; nothing lands in the consumer after
    (or at all: the producer never ran again)."""
    pproc, prod = start_one(plan, "content", "killed-p")
    cproc, cons = start_one(plan, "random", "killed-c", seed=8)
    try:
        cons.connect([prod.address], "READ", "pull_via_push", "p")
        move(cons, "p", "read", two_requests("k0"))
        before = cons.call("dump")
        pproc.signal(signal.SIGSTOP)
        asked = [(f"k1-{i}", {"full": [10 + i]}, {"full": [20 + i]}, 16) for i in range(6)]
        assert cons.call("submit", "p", "read", asked, 30.0) == {}
        assert cons.call("wait", [r[0] for r in asked], 0.3)["open"] == [r[0] for r in asked]
        t0 = time.monotonic()
        pproc.kill()
        out = cons.call("wait", [r[0] for r in asked], 30.0)
        took = time.monotonic() - t0
        assert out["open"] == [] and not out["finished"] and set(out["failed"]) == {r[0] for r in asked}, out
        assert took < 5.0, f"the asked requests ended {took:.1f} s after the producer was killed"
        assert all("side channel" in why for why in out["failed"].values()), out["failed"]
        time.sleep(0.5)
        after = cons.call("dump")
        assert all(np.array_equal(before[k], after[k]) for k in before), "bytes landed"
        ev = cons.call("events")
        assert ev["flips"] == [] and not set(ev["finished"]) & {r[0] for r in asked}, ev
    finally:
        stop_engines([prod, cons])


def test_kv_produced_before_a_restart_is_never_read(plan):
    """A read that says when its KV was produced (``produced_at``, the producer's clock) is refused once the
    producer rank restarted after that time, in every mode, even though the address answers again (the
    new epoch's memory holds other bytes): nothing moves. KV produced after the restart is read."""
    port = free_port()
    pproc, prod = start_one(plan, "content", "pa-p", port=port)
    cproc, cons = start_one(plan, "random", "pa-c", seed=5)
    try:
        for mode in MODES:
            cons.connect([prod.address], "READ", mode, mode)
        produced = time.time()
        for mode in MODES:
            _pull_checked(cons, plan, mode, f"{mode}-ok", {"produced_at": produced})
        pproc.kill()
        pproc, prod = start_one(plan, "content", "pa-p", port=port)
        for mode in MODES:
            before = cons.call("dump")
            errors = cons.call("submit", mode, "read", two_requests(f"{mode}-old"), TIMEOUT, 0, {"produced_at": produced})
            assert set(errors) == {f"{mode}-old-a", f"{mode}-old-b"}, errors
            assert "no longer holds it; nothing read" in errors[f"{mode}-old-a"], errors
            after = cons.call("dump")
            assert all(np.array_equal(after[k], before[k]) for k in before), f"{mode}: bytes moved after the refusal"
        fresh = time.time()
        for mode in MODES:
            _pull_checked(cons, plan, mode, f"{mode}-new", {"produced_at": fresh})
    finally:
        stop_engines([prod, cons])


def test_twenty_producer_restarts_leave_the_consumer_flat(plan):
    """Issue 27 F4, 20 times: a consumer with a prepped, a direct and a pull-via-push peer to one producer
    restarted 20 times on its address (kill -9 twice, a new agent in its process otherwise). Every
    request after each restart moves every byte; the consumer's fds, threads (Python's and the OS's),
    live NIXL handles, remote NIXL agents, sessions and remote engine records after the 20th restart
    are what they were after the 3rd (fds within 2): nothing grows per restart."""
    modes = ("prepped", "direct", "pull_via_push")
    port = free_port()
    pproc, prod = start_one(plan, "content", "many-p", port=port)
    cproc, cons = start_one(plan, "random", "many-c", seed=11)
    readings = {}
    try:
        for mode in modes:
            cons.connect([prod.address], "READ", mode, mode)
        for i in range(MANY + 1):
            if i:
                pproc, prod = _restart(pproc, prod, plan, "content", "many-p", port, i)
            for mode in modes:
                _pull_checked(cons, plan, mode, f"{mode}{i}")
            if i in (0, SETTLED, MANY // 2, MANY):
                readings[i] = cons.call("resources")
        _figures("consumer", readings)
        assert cons.call("stats").get("sessions_lost") == MANY * len(modes)
        _assert_flat(readings[SETTLED], readings[MANY])
    finally:
        stop_engines([prod, cons])


def test_twenty_consumer_lifetimes_leave_the_producer_flat(plan):
    """A producer that sees 21 lifetimes of one consumer engine (restarted on its address: kill -9 twice,
    a new agent in its process otherwise): each lifetime pulls directly and through pull via push, and
    the producer's own push peer to it reconnects by itself; every byte is checked. The producer's fds,
    threads, NIXL handles, remote NIXL agents, sessions and remote engine records after the 20th restart
    are what they were after the 3rd."""
    port = free_port()
    pproc, prod = start_one(plan, "content", "life-p")
    cproc, cons = start_one(plan, "random", "life-c", port=port, seed=1)
    readings = {}
    try:
        prod.connect([cons.address], "WRITE", "direct", "c")
        for i in range(MANY + 1):
            if i:
                cproc, cons = _restart(cproc, cons, plan, "random", "life-c", port, i, seed=1 + i)
            for mode in ("direct", "pull_via_push"):
                cons.connect([prod.address], "READ", mode, mode)
                _pull_checked(cons, plan, mode, f"{mode}{i}")
            before = cons.call("dump")
            move(prod, "c", "write", flip(two_requests(f"w{i}")), waiters=[cons])
            check_bytes(cons, plan, plan, before, two_requests(f"w{i}"))
            if i in (0, SETTLED, MANY // 2, MANY):
                readings[i] = prod.call("resources")
        _figures("producer", readings)
        assert prod.call("stats").get("sessions_lost") == MANY
        _assert_flat(readings[SETTLED], readings[MANY])
    finally:
        stop_engines([prod, cons])


def test_a_nixl_agent_kept_for_a_request_in_flight_goes_once_it_ends(plan):
    """A session ends (the engine closes its peer) while a read on it is in flight (the producer is
    stopped, SIGSTOP): the read is held and the producer's NIXL agent stays while NIXL may still land its
    bytes; once the read ends (SIGCONT), it is reported failed once and that NIXL agent is removed too."""
    pproc, prod = start_one(plan, "content", "busy-p")
    # The consumer tells done through NIXL's data endpoint, not the producer's same-host doorbell nor a notes
    # agent of its own: its READs from the stopped producer then stay in flight (UCX's flush at a READ's end
    # waits on the notifications sent on that endpoint before, which the stopped producer does not take); with
    # nothing pending there, UCX reads the stopped process's memory and the READ ends well at once (seen here:
    # finished within 0.3 s).
    cproc = EngineProcess()
    cons = cproc.add(config(plan, 0, "random", seed=4, engine_id="busy-c", ipc="off", notes_agent=False))
    try:
        bare = cons.call("resources")
        cons.connect([prod.address], "READ", "direct", "p")
        move(cons, "p", "read", two_requests("b0"))
        assert cons.call("resources")["remotes"] == 1
        pproc.signal(signal.SIGSTOP)
        try:
            assert cons.call("submit", "p", "read", two_requests("b1"), 30.0) == {}
            assert cons.call("wait", ["b1-a"], 0.3)["open"] == ["b1-a"]  # in flight
            cons.call("peer_close", "p")
            held = cons.call("resources")
            ev = cons.call("events")
        finally:
            pproc.signal(signal.SIGCONT)
        assert held["remotes"] == 1 and held["sessions"] == 0 and held["in_flight"] >= 1, held
        assert "b1-a" in ev["held"] and "b1-a" not in ev["failed"], ev
        out = cons.call("wait", ["b1-a", "b1-b"], 20.0)
        assert set(out["failed"]) == {"b1-a", "b1-b"} and not out["finished"], out
        end = time.monotonic() + 5
        while (res := cons.call("resources"))["remotes"] and time.monotonic() < end:
            time.sleep(0.05)
        assert res["remotes"] == 0 and res["in_flight"] == 0 and res["nixl_handles"] == bare["nixl_handles"], res
        assert cons.call("events")["flips"] == []
    finally:
        stop_engines([prod, cons])
