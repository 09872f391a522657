"""Requests that end together share one 'done' notification per session (a NotifBatch), between real
NIXL agents in this process: every request still ends at the receiver, with its bytes, and the
sender posts fewer notifications than requests. What a stranger rings on a same-host doorbell is checked
as a NIXL notification is."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from runtime_engines import SECRET, TEST_LAYOUTS

from kvlc import compile_spec
from kvlc.runtime.settings import AgentSettings
from kvlc.runtime.channel.notifs import NotifBatch, decode_notif

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")
pytestmark = pytest.mark.runtime


def test_pushes_ending_in_one_turn_arrive_as_one_batch_with_their_bytes():
    """Eight pushes posted back to back with no progress in between, then polled: the producer sends
    fewer 'done' notifications than requests (at least one batch); the consumer finishes all eight
    and every destination byte is the producer's (nothing else changed)."""
    from kvlc.runtime import KvAgent, allocate
    from kvlc.demo.content import expected_bytes, fill

    plan = compile_spec(TEST_LAYOUTS / "dense-tp1.yaml")
    tp, tc = allocate(plan), allocate(plan)
    fill(plan, 0, {n: t.numpy() for n, t in tp.items()})
    for t in tc.values():
        t.fill_(0x5A)
    prod = KvAgent(plan, 0, tp, AgentSettings(secret=SECRET, progress="manual", engine_id="batch-p"))
    cons = KvAgent(plan, 0, tc, AgentSettings(secret=SECRET, progress="manual", engine_id="batch-c"))
    try:
        peer = prod.connect(cons.serve(), direction="WRITE")
        sent = []
        door = prod.executor.agent  # what the executor tells through: NIXL, or the same-host route (its doorbells)
        real = door.send_done  # (how a `done` leaves: the doorbell, the notes agent or the data agent)
        door.send_done = lambda to, m: (sent.append(decode_notif(m)), real(to, m))[1]
        reqs = {f"b{i}": ([2 * i, 2 * i + 1], [40 + 2 * i, 41 + 2 * i]) for i in range(8)}
        for req in reqs:
            cons.expect(req, 30.0)
        for req, (src, dst) in reqs.items():
            peer.write(req, {"full": src}, {"full": dst}, 32)
        time.sleep(0.2)  # let the WRITEs complete before the producer looks at any of them
        finished: set[str] = set()
        deadline = time.monotonic() + 20
        while finished != set(reqs) and time.monotonic() < deadline:
            prod.poll()
            finished |= set(cons.poll().finished)
            time.sleep(0.001)
        assert finished == set(reqs)
        told = [r for n in sent for r in (n.done if isinstance(n, NotifBatch) else [n.req])]
        assert sorted(told) == sorted(reqs)  # each request told exactly once
        assert any(isinstance(n, NotifBatch) for n in sent) and len(sent) < len(reqs), sent
        untouched = {n: np.ones(t.numel(), dtype=bool) for n, t in tc.items()}
        for req, (src, dst) in reqs.items():
            for storage, idx, vals in expected_bytes(plan, 0, plan, {"full": dst}, {"full": src}, 32):
                assert (tc[storage].numpy()[idx] == vals).all(), f"{req}: wrong bytes in {storage}"
                untouched[storage][idx] = False
        for storage, t in tc.items():
            assert (t.numpy()[untouched[storage]] == 0x5A).all(), f"bytes outside the requests changed in {storage}"
    finally:
        prod.close()
        cons.close()


def test_what_is_rung_on_a_doorbell_is_checked_as_nixl_notifications_are():
    """Two agents of this host: the consumer's answer to the producer's hello carries a doorbell, which the
    producer maps. Messages a stranger rings there (a bad tag, another rank's tag, not a notification at all)
    are dropped and counted and end nothing; the producer's real ``done`` ends the request, once."""
    from kvlc.runtime import KvAgent, allocate
    from kvlc.runtime.channel.auth import notif_tag
    from kvlc.runtime.channel.notifs import encode_notif
    from kvlc.runtime.ipc import bell as _bell
    from kvlc.runtime.ipc.bell import BellWriter

    if _bell.library() is None:
        pytest.skip(f"bell.c: {_bell.status()}")
    plan = compile_spec(TEST_LAYOUTS / "dense-tp1.yaml")
    prod = KvAgent(plan, 0, allocate(plan), AgentSettings(secret=SECRET, progress="manual", engine_id="bell-p"))
    cons = KvAgent(plan, 0, allocate(plan), AgentSettings(secret=SECRET, progress="manual", engine_id="bell-c"))
    try:
        peer = prod.connect(cons.serve(), direction="WRITE")
        (bell,) = cons._res.bells[prod.name]  # the doorbell offered for this session, mapped by the producer
        stranger = BellWriter(os.getpid(), bell.offer())  # any process of this user could open it the same way
        key = next(iter(peer.sessions.values())).notif_key
        cons.expect("r1", 30.0)
        dropped = cons.stats["dropped_notifs"]
        for m in (encode_notif("r1", 0, "done", "0" * 24),                           # a tag no key made
                  encode_notif("r1", 1, "done", notif_tag(key, "r1", "1", "done")),   # a rank it has no session of
                  b"not a notification"):
            assert stranger.ring(m)
        cons.poll()
        assert cons.stats["dropped_notifs"] == dropped + 3 and cons.stats["bell_taken"] == 3
        assert "r1" in cons.incoming  # still waiting: nothing ended
        peer.write("r1", {"full": [0, 1]}, {"full": [2, 3]}, 32)
        finished: set[str] = set()
        deadline = time.monotonic() + 20
        while "r1" not in finished and time.monotonic() < deadline:
            prod.poll()
            finished |= set(cons.poll().finished)
        assert finished == {"r1"} and prod.stats["bell_rung"] == 1 and cons.stats["bell_taken"] == 4
        stranger.close()
    finally:
        prod.close()
        cons.close()
