"""Requests that end together share one 'done' notification per session (a NotifBatch), between real
NIXL agents in this process: every request still ends at the receiver, with its bytes, and the
sender posts fewer notifications than requests."""

from __future__ import annotations

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
        real = door.send_notif
        door.send_notif = lambda to, m: (sent.append(decode_notif(m)), real(to, m))[1]
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
