"""Fenced timeouts with a stopped peer (SIGSTOP) in every mode, real NIXL agents in two processes.

Contract: a request whose peer is stopped is reported *held* (failed, blocks not reusable) until no
byte can land any more; only then *failed*, or *finished* with every byte right. After a request is
reported failed or finished, nothing in its destination blocks changes again — also not after the
stopped process continues (SIGCONT). A request never goes from held or failed to finished.
"""

from __future__ import annotations

import signal
import time

import pytest
from runtime_engines import TEST_LAYOUTS, check_from_many, config, flip, settle

from kvlc import compile_spec
from kvlc.demo.procs import EngineProcess, stop_engines

pytest.importorskip("torch")
pytest.importorskip("nixl")
pytestmark = pytest.mark.runtime
MODES = ("direct", "prepped", "pull_via_push", "push")
SHORT = 1.0  # the request's timeout, seconds


@pytest.fixture(scope="module")
def plan():
    return compile_spec(TEST_LAYOUTS / "dense-tp1.yaml")


@pytest.fixture(scope="module")
def pair_(plan):
    pp, cp = EngineProcess(), EngineProcess()
    prod = pp.add(config(plan, 0, "content", engine_id="fence-p"))
    cons = cp.add(config(plan, 0, "random", seed=4, engine_id="fence-c"))
    yield pp, cp, prod, cons
    for p in (pp, cp):
        try:
            p.signal(signal.SIGCONT)
        except OSError:
            pass
    stop_engines([prod, cons])


def _connect(prod, cons, mode, tag):
    if mode == "push":
        prod.connect([cons.address], "WRITE", "direct", tag)
    else:
        cons.connect([prod.address], "READ", mode, tag)


def _settle_and_check(cons, plan, before, req, timeout=30.0):
    """Wait for the terminal answer, then prove nothing changes in the request's blocks afterwards."""
    out, snap = settle(cons, req[0], timeout)
    if out["finished"]:
        check_from_many(cons, plan, before, [(plan, [req])], after=snap)
    return out


@pytest.mark.parametrize("mode", MODES)
def test_stopped_producer_holds_then_fails_and_nothing_lands_late(pair_, plan, mode):
    """Producer stopped: read() returns at once, the request is held at its deadline (pull via push and
    push: the producer cannot answer), and after SIGCONT it ends with no byte landing afterwards."""
    pp, cp, prod, cons = pair_
    tag = f"stop-p-{mode}"
    _connect(prod, cons, mode, tag)
    slot = MODES.index(mode)
    req = (f"{tag}-r", {"full": [2 * slot, 2 * slot + 1]}, {"full": [9, 17]}, 20)
    before = cons.call("dump")
    pp.signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        if mode == "push":
            cons.call("expect", req[0], SHORT)
            pp._send("submit", prod.aid, tag, "write", flip([req]), 30.0)  # queued until SIGCONT
        else:
            assert cons.call("submit", tag, "read", [req], SHORT) == {}
            assert time.monotonic() - t0 < SHORT + 4, "read() waited on the stopped producer"
        got = cons.call("wait", [req[0]], SHORT + 3)
        if mode in ("pull_via_push", "push"):
            assert got["finished"] == [] and got["failed"] == {}, got
            assert req[0] in got["held"], got
    finally:
        pp.signal(signal.SIGCONT)
    if mode == "push":
        pp._recv(60)
    out = _settle_and_check(cons, plan, before, req)
    if mode in ("pull_via_push", "push"):
        assert req[0] in out["failed"] and req[0] in out["ever_held"]


@pytest.mark.parametrize("mode", MODES)
def test_stopped_consumer_never_sees_a_late_byte(pair_, plan, mode):
    """Consumer stopped right after asking: after SIGCONT the request ends finished (every byte right)
    or failed, and nothing lands in its blocks afterwards."""
    pp, cp, prod, cons = pair_
    tag = f"stop-c-{mode}"
    _connect(prod, cons, mode, tag)
    slot = 8 + MODES.index(mode)
    req = (f"{tag}-r", {"full": [2 * slot, 2 * slot + 1]}, {"full": [5, 33]}, 20)
    before = cons.call("dump")
    if mode == "push":
        cons.call("expect", req[0], SHORT)
        cp.signal(signal.SIGSTOP)
        try:
            prod.call("submit", tag, "write", flip([req]), SHORT)
            time.sleep(SHORT + 1)
        finally:
            cp.signal(signal.SIGCONT)
    else:
        cp._send("submit", cons.aid, tag, "read", [req], SHORT)
        cp.signal(signal.SIGSTOP)
        time.sleep(SHORT + 1)
        cp.signal(signal.SIGCONT)
        cp._recv(30)
    _settle_and_check(cons, plan, before, req)


def test_cancel_pull_via_push_before_the_producer_acts(pair_, plan):
    """cancel() of a pull-via-push request to a stopped producer: held at once (the frame may already be
    queued there), failed only after the producer's answer, and nothing lands after that."""
    pp, cp, prod, cons = pair_
    tag = "cancel-pvp"
    _connect(prod, cons, "pull_via_push", tag)
    req = (f"{tag}-r", {"full": [40, 41]}, {"full": [1, 2]}, 20)
    before = cons.call("dump")
    pp.signal(signal.SIGSTOP)
    try:
        assert cons.call("submit", tag, "read", [req], 30.0) == {}
        cons.call("cancel", req[0])
        got = cons.call("wait", [req[0]], 1.0)
        assert req[0] in got["held"] and not got["failed"], got
    finally:
        pp.signal(signal.SIGCONT)
    out = _settle_and_check(cons, plan, before, req)
    assert req[0] in out["failed"] and "cancelled" in out["failed"][req[0]]
