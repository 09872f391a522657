"""Lifetimes and leases with real NIXL agents in this process: a dropped agent is collected and releases
everything; a producer reports source blocks freeable when the lease runs out; a push consumer's cancel
fences a producer that has not written yet."""

from __future__ import annotations

import gc
import socket
import threading
import time
import weakref

import pytest
from runtime_engines import SECRET, TEST_LAYOUTS

from kvlc import compile_spec
from kvlc.errors import TransferError
from kvlc.runtime.settings import AgentSettings
from kvlc.runtime import KvAgent, allocate

pytest.importorskip("torch")
pytest.importorskip("nixl")
pytestmark = pytest.mark.runtime


@pytest.fixture(scope="module")
def plans():
    return {"tp1": compile_spec(TEST_LAYOUTS / "dense-tp1.yaml"),
            "tp2": compile_spec(TEST_LAYOUTS / "dense-tp2-hnd-b32.yaml")}


def _until(pred, timeout=10.0):
    end = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.01)


def test_dropped_agent_is_collected_and_releases_everything(plans):
    """An agent dropped without close() is garbage-collected: its progress thread ends, its side-channel
    port closes, its NIXL handles are released (weakref progress loop + finalizer)."""
    a = KvAgent(plans["tp1"], 0, allocate(plans["tp1"]), AgentSettings(secret=SECRET))
    host, port = a.serve().rsplit(":", 1)
    nixl = a.nixl
    names = {t.name for t in threading.enumerate()}
    assert f"kvlc-progress-{a.name}" in names
    ref = weakref.ref(a)
    thread_name = f"kvlc-progress-{a.name}"
    del a
    # The progress thread holds the agent strongly only while one pump step runs: collected at the
    # first collection after that step.
    assert _until(lambda: gc.collect() is not None and ref() is None)
    assert _until(lambda: thread_name not in {t.name for t in threading.enumerate()})
    assert nixl.live_handles == 0 and nixl.closed
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=2).close()


def test_lease_frees_blocks_no_consumer_asked_for(plans):
    """offer(): a request no consumer ever names is reported freeable once its lease runs out, once."""
    with KvAgent(plans["tp1"], 0, allocate(plans["tp1"]), AgentSettings(secret=SECRET, lease=0.3)) as p:
        p.offer("never-asked")
        assert "never-asked" not in p.poll().freeable
        assert _until(lambda: "never-asked" in p.poll().freeable, 5)
        time.sleep(0.4)
        assert "never-asked" not in p.poll().freeable


def test_lease_frees_blocks_a_consumer_rank_never_finished(plans):
    """TP1 producer, TP2 consumer engine: rank 0 reads, rank 1 never does (dead): the producer reports the
    request finished only when both are done, so here freeable after the lease, and not as finished."""
    tp1, tp2 = plans["tp1"], plans["tp2"]
    with (KvAgent(tp1, 0, allocate(tp1), AgentSettings(secret=SECRET, lease=1.0)) as p,
          KvAgent(tp2, 0, allocate(tp2), AgentSettings(secret=SECRET, engine_id="half")) as c0):
        peer = c0.connect(p.serve())
        p.offer("half-read")
        peer.read("half-read", {"full": [1]}, {"full": [2, 3]}, 20)
        assert c0.wait(["half-read"], timeout=20).finished == ("half-read",)
        seen = []
        assert _until(lambda: bool(seen.extend(p.poll().freeable) or "half-read" in seen), 10)
        assert "half-read" in seen


def test_push_cancel_fences_a_producer_that_has_not_written(plans):
    """A push consumer's expect() runs out before the producer wrote: the consumer cancels, the producer
    answers 'unknown' and refuses a later write of that request; the consumer reports failed, not held."""
    tp1 = plans["tp1"]
    with (KvAgent(tp1, 0, allocate(tp1), AgentSettings(secret=SECRET, engine_id="push-p")) as p,
          KvAgent(tp1, 0, allocate(tp1), AgentSettings(secret=SECRET, engine_id="push-c")) as c):
        p.serve()
        w = p.connect(c.serve(), direction="WRITE")
        c.expect("late", 0.2)
        got = c.wait(["late"], timeout=10)
        assert "late" in got.failed and "late" in got.held
        with pytest.raises(TransferError, match="cancelled by consumer"):
            w.write("late", {"full": [1]}, {"full": [2]}, 16)


def test_closed_peer_ends_its_sessions_on_both_sides(plans):
    """Peer.close() ends its sessions: the producer forgets them and removes the consumer's NIXL agent,
    and reads on the closed peer are refused."""
    tp1 = plans["tp1"]
    with (KvAgent(tp1, 0, allocate(tp1), AgentSettings(secret=SECRET)) as p,
          KvAgent(tp1, 0, allocate(tp1), AgentSettings(secret=SECRET)) as c):
        peer = c.connect(p.serve(), mode="pull_via_push")
        assert _until(lambda: c.name in p.nixl.remotes)
        peer.close()
        assert _until(lambda: not p.sessions.all() and c.name not in p.nixl.remotes)
        with pytest.raises(TransferError, match="closed"):
            peer.read("x", {"full": [1]}, {"full": [1]}, 1)


def test_restart_under_the_same_name_replaces_only_that_ranks_session(plans):
    """A rank restarted with the same engine id and agent name (new epoch) replaces its old session at the
    producer: the old agent's requests are refused and end failed, the new one's land, others are untouched."""
    tp1 = plans["tp1"]
    with (KvAgent(tp1, 0, allocate(tp1), AgentSettings(secret=SECRET, engine_id="restart-p")) as p,
          KvAgent(tp1, 0, allocate(tp1), AgentSettings(secret=SECRET, engine_id="bystander")) as other):
        addr = p.serve()
        keep = other.connect(addr, mode="pull_via_push")
        old = KvAgent(tp1, 0, allocate(tp1), AgentSettings(secret=SECRET, engine_id="E", name="fixed-name"))
        try:
            stale = old.connect(addr, mode="pull_via_push")
            new = KvAgent(tp1, 0, allocate(tp1), AgentSettings(secret=SECRET, engine_id="E", name="fixed-name"))
            with new:
                fresh = new.connect(addr, mode="pull_via_push")
                assert {s.epoch for s in p.sessions.live("fixed-name")} == {new.epoch}
                stale.read("old-epoch", {"full": [1]}, {"full": [2]}, 16, timeout=10)
                assert "old-epoch" in old.wait(["old-epoch"], timeout=20).failed
                fresh.read("new-epoch", {"full": [1]}, {"full": [2]}, 16)
                keep.read("bystander", {"full": [1]}, {"full": [2]}, 16)
                assert new.wait(["new-epoch"], timeout=20).finished == ("new-epoch",)
                assert other.wait(["bystander"], timeout=20).finished == ("bystander",)
        finally:
            old.close()
