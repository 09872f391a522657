"""Several requests sharing their NIXL requests (Executor.submit_many): they end together.

A fake agent stands in for NIXL here only (scripted states, recorded calls), as in
test_transfer_split.py; real NIXL agents move batches in test_batch_e2e.py.
"""

from __future__ import annotations

import json
from collections import deque

import numpy as np
import pytest
from fake import Clock, FakeAgent
from runtime_engines import LAYOUTS

from kvlc import compile_spec
from kvlc.compiler.pairing.pair import pair
from kvlc.compiler.pairing.program import join_parts
from kvlc.runtime.nixl.core import XferState
from kvlc.runtime.transfer import Executor, Member, Target
from kvlc import bind, instantiate

pytestmark = pytest.mark.runtime

DONE, PROC, ERR = XferState.DONE, XferState.PROC, XferState.ERR
KEY = b"k" * 32


@pytest.fixture(scope="module")
def batch():
    """Three requests of a DeepSeek-V3.2 HiSparse consumer rank (DRAM and VRAM parts) reading
    from an all-VRAM producer rank, each with its own blocks."""
    cons = compile_spec(LAYOUTS / "deepseek-v3.2-hisparse-tp8.yaml")
    prod = compile_spec(LAYOUTS / "deepseek-v3.2-tp8.yaml")
    prog = pair(cons, prod, local_rank=3, direction="READ")
    bound = bind(prog, {s.name: ((1 << 40) + (i << 32), s.device) for i, s in enumerate(cons.storages)},
                      {3: {s.name: ((2 << 40) + (i << 32), s.device) for i, s in enumerate(prod.storages)}})
    reqs = []
    for i in range(3):
        ids_c = {"mla": [10 * i + 1, 10 * i + 2], "indexer": [10 * i + k for k in range(4)]}
        ids_p = {"mla": [10 * i + k for k in range(4)], "indexer": [20 + 10 * i + k for k in range(4)]}
        reqs.append(instantiate(bound, ids_c, ids_p, 200 + 20 * i))
    return reqs


def _members(reqs):
    return [Member(("read", f"r{i}"), f"r{i}", sum(int(p.nbytes) for p in parts.values()),
                   sum(len(p) for p in parts.values())) for i, parts in enumerate(reqs)]


def _submit(ex, reqs, timeout=None):
    joined = join_parts(reqs)
    agents = {k.peer_rank: f"peer{k.peer_rank}" for k in joined}
    targets = {r: Target(name, KEY) for r, name in agents.items()}
    return ex.submit_many(_members(reqs), "READ", joined, agents, targets, timeout)


def _statuses(agent):
    return [json.loads(m) for _, m in agent.sent]


def test_join_keeps_every_request_row_in_request_order(batch):
    """join_parts: one part per key, each request's rows one after another, nothing merged or lost."""
    joined = join_parts(batch)
    assert set(joined) == set(batch[0])
    for key, part in joined.items():
        assert np.array_equal(part.local, np.concatenate([r[key].local for r in batch]))
        assert np.array_equal(part.remote, np.concatenate([r[key].remote for r in batch]))
        assert part.nbytes == sum(r[key].nbytes for r in batch)


def test_one_nixl_request_per_part_for_the_whole_batch_and_one_done_notification(batch):
    """Three requests, two parts: two NIXL requests; when both are done every request is done, and
    the peer hears one batch notification naming all three."""
    agent = FakeAgent()
    agent.states = {("peer3", "DRAM", "VRAM"): [PROC, DONE], ("peer3", "VRAM", "VRAM"): [PROC, PROC, DONE]}
    ex = Executor(agent, rank=3)
    outs = _submit(ex, batch)
    assert len(agent.created) == 2 and len(outs) == 3
    assert [o.rows for o in outs] == [sum(len(p) for p in r.values()) for r in batch]
    assert [o.nbytes for o in outs] == [sum(p.nbytes for p in r.values()) for r in batch]
    ended = []
    for _ in range(5):  # until the first turn that ends anything: it ends all three
        ended = ended or ex.progress()
    assert sorted(o.req for o in ended) == ["r0", "r1", "r2"]
    assert all(o.status == "done" for o in outs) and agent.live_handles == 0
    sent = _statuses(agent)
    assert len(sent) == 1 and sorted(sent[0]["done"]) == ["r0", "r1", "r2"]


def test_a_failed_part_fails_every_request_of_the_batch(batch):
    """One shared part errors: every request fails with its reason, none hears 'done'."""
    agent = FakeAgent()
    agent.states = {("peer3", "DRAM", "VRAM"): [PROC, ERR], ("peer3", "VRAM", "VRAM"): [PROC, DONE]}
    ex = Executor(agent, rank=3)
    outs = _submit(ex, batch)
    ended = ex.progress() + ex.progress() + ex.progress()
    assert sorted(o.req for o in ended) == ["r0", "r1", "r2"]
    assert all(o.status == "failed" and "DRAM->VRAM" in o.reason for o in outs)
    assert agent.live_handles == 0
    assert {s["status"] for s in _statuses(agent)} == {"failed"} and len(_statuses(agent)) == 3


def test_cancelling_one_request_cancels_the_batch_and_no_one_hears_done(batch):
    """A cancel of one member gives the shared NIXL requests up: it is held while they are in flight
    (releasing them would not recall queued bytes), and once NIXL ends them every member fails (even
    where they ended DONE), each after every handle is gone."""
    agent = FakeAgent()
    agent.states = {k: [PROC] for k in [("peer3", "DRAM", "VRAM"), ("peer3", "VRAM", "VRAM")]}
    ex = Executor(agent, rank=3)
    outs = _submit(ex, batch)
    assert ex.cancel(("read", "r1"), "cancelled by this engine") is None
    assert ex.progress() == [] and agent.live_handles == 2 and outs[1].status == "active"
    for x in agent.created:
        x.script = deque([XferState.DONE])
    rest = ex.progress()
    assert sorted(o.req for o in rest) == ["r0", "r1", "r2"] and agent.live_handles == 0
    assert all(o.status == "failed" and "cancelled" in o.reason for o in rest)
    assert all(s["status"] == "failed" for s in _statuses(agent)) and not ex.active


def test_a_batch_shares_one_deadline(batch):
    """Past the batch's deadline every member fails with the timeout, once NIXL ended the shared parts;
    the handles are released once."""
    agent = FakeAgent()
    agent.states = {k: [PROC] for k in [("peer3", "DRAM", "VRAM"), ("peer3", "VRAM", "VRAM")]}
    clock = Clock()
    ex = Executor(agent, rank=3, clock=clock)
    outs = _submit(ex, batch, timeout=2.0)
    clock.t = 1.9
    assert ex.progress() == []
    clock.t = 2.0
    assert ex.progress() == [] and agent.live_handles == 2  # held: the shared parts are in flight
    for x in agent.created:
        x.script = deque([XferState.ERR])
    assert sorted(o.req for o in ex.progress()) == ["r0", "r1", "r2"]
    assert all(o.status == "failed" for o in outs) and "timed out after 2s" in outs[0].reason
    assert agent.live_handles == 0 and sum(e[0] == "release" for e in agent.log) == 2


def test_a_failed_post_fails_every_member_and_posts_nothing_more(batch):
    agent = FakeAgent()
    first = next(iter(join_parts(batch)))
    agent.states = {("peer3", first.local_mem, first.remote_mem): [ERR]}
    ex = Executor(agent, rank=3)
    outs = _submit(ex, batch)
    assert sum(x.posted for x in agent.created) == 1
    assert sorted(o.req for o in ex.progress()) == ["r0", "r1", "r2"] and agent.live_handles == 0
    assert all(o.status == "failed" and o.reason for o in outs)
    assert {s["status"] for s in _statuses(agent)} == {"failed"}


def test_a_member_already_in_flight_refuses_the_whole_batch(batch):
    agent = FakeAgent()
    agent.states = {k: [PROC] for k in [("peer3", "DRAM", "VRAM"), ("peer3", "VRAM", "VRAM")]}
    ex = Executor(agent, rank=3)
    _submit(ex, batch[1:2])  # one request, submitted as "r0"
    with pytest.raises(Exception, match="'r0'.*in flight"):
        _submit(ex, batch)
    assert len(agent.created) == 2 and len(ex.active) == 1
