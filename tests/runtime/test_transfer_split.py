"""Split / barrier / failure logic of the Executor, on real transfer programs with VRAM partitions.

A fake agent stands in for NIXL here only (scripted states, recorded calls); the same logic
runs against real NIXL agents in the multi-process tests.
"""

from __future__ import annotations

import json
from collections import deque

import pytest
from runtime_engines import LAYOUTS
from fake import Clock, FakeAgent

from kvlc import compile_spec
from kvlc.compiler.pairing.pair import pair
from kvlc.runtime.errors import NixlError
from kvlc.runtime.nixl.core import XferState
from kvlc.runtime.channel.auth import notif_tag
from kvlc.runtime.transfer import Executor, Target
from kvlc import bind, instantiate

pytestmark = pytest.mark.runtime

DONE, PROC, ERR = XferState.DONE, XferState.PROC, XferState.ERR
KEY = b"k" * 32  # a session's notification key


def _bases(plan, tag):
    return {s.name: ((tag << 40) + (i << 32), s.device) for i, s in enumerate(plan.storages)}


@pytest.fixture(scope="module")
def mixed():
    """Consumer rank 3 of a host-offload engine (latent in DRAM, indexer in VRAM) reading from
    rank 3 of an all-VRAM engine: two parts, DRAM<-VRAM and VRAM<-VRAM."""
    cons = compile_spec(LAYOUTS / "deepseek-v3.2-hisparse-tp8.yaml")
    prod = compile_spec(LAYOUTS / "deepseek-v3.2-tp8.yaml")
    prog = pair(cons, prod, local_rank=3, direction="READ")
    ids_c = {"mla": [1, 2], "indexer": [5, 6, 7, 8]}
    ids_p = {"mla": [9, 10, 11, 12], "indexer": [3, 4, 5, 6]}
    parts = instantiate(bind(prog, _bases(cons, 1), {3: _bases(prod, 2)}), ids_c, ids_p, 250)
    return prog, parts


def _submit(ex, parts, req="r1", timeout=None, op="READ"):
    agents = {k.peer_rank: f"peer{k.peer_rank}" for k in parts}
    targets = {r: Target(name, KEY) for r, name in agents.items()}
    return ex.submit(("direct", req), req, op, parts, agents, targets, timeout)


def _notifs(agent):
    return [(name, json.loads(m)) for name, m in agent.sent]


def test_one_nixl_request_per_part_with_its_memory_types(mixed):
    """Each (peer, local mem, remote mem) part becomes exactly one NIXL request with those memory types."""
    prog, parts = mixed
    assert {(k.local_mem, k.remote_mem) for k in parts} == {("DRAM", "VRAM"), ("VRAM", "VRAM")}
    agent = FakeAgent()
    ex = Executor(agent, rank=3)
    out = _submit(ex, parts)
    assert len(agent.created) == len(parts)
    for x in agent.created:
        key = next(k for k in parts if str(k) in x.what)
        assert (x.local_mem, x.remote_mem, x.remote_agent) == (key.local_mem, key.remote_mem, "peer3")
        assert (x.local == parts[key].local).all() and (x.remote == parts[key].remote).all()
        assert x.op == "READ"
    assert ex.progress() == [out] and out.status == "done"
    assert out.rows == sum(len(p) for p in parts.values())


def test_notification_only_after_every_part_is_done(mixed):
    """A part done first sends nothing; one 'done' per peer rank follows the last part, after release."""
    _, parts = mixed
    agent = FakeAgent()
    agent.states = {("peer3", "DRAM", "VRAM"): [DONE], ("peer3", "VRAM", "VRAM"): [PROC, PROC, DONE]}
    ex = Executor(agent, rank=3)
    out = _submit(ex, parts)
    assert ex.progress() == [] and agent.sent == []
    assert ex.progress() == [out]
    tag = notif_tag(KEY, "r1", "3", "done")
    assert _notifs(agent) == [("peer3", {"v": 3, "req": "r1", "rank": 3, "status": "done", "why": "", "tag": tag})]
    kinds = [e[0] for e in agent.log]
    assert kinds.index("notif") > max(i for i, k in enumerate(kinds) if k == "release")
    assert agent.live_handles == 0


def test_failed_part_waits_for_the_others_then_fails_without_done(mixed):
    """One part errors: the request stays open until every part is terminal, then every handle is
    released, the request fails with the reason, and no 'done' notification is sent."""
    _, parts = mixed
    agent = FakeAgent()
    agent.states = {
        ("peer3", "DRAM", "VRAM"): [PROC, ERR],
        ("peer3", "VRAM", "VRAM"): [PROC, PROC, PROC, DONE],
    }
    ex = Executor(agent, rank=3)
    out = _submit(ex, parts)
    assert ex.progress() == [] and ex.progress() == []
    assert agent.live_handles == 2 and agent.sent == []
    assert ex.progress() == [out]
    assert out.status == "failed" and "REMOTE_DISCONNECT" in out.reason and "DRAM->VRAM" in out.reason
    assert agent.live_handles == 0
    assert [n["status"] for _, n in _notifs(agent)] == ["failed"]


def test_failed_post_starts_no_further_part(mixed):
    """A part whose post fails stops the remaining parts from being posted; all handles are released."""
    _, parts = mixed
    agent = FakeAgent()
    first = next(iter(parts))
    agent.states = {("peer3", first.local_mem, first.remote_mem): [ERR]}
    ex = Executor(agent, rank=3)
    out = _submit(ex, parts)
    assert sum(x.posted for x in agent.created) == 1
    assert ex.progress() == [out] and out.status == "failed" and agent.live_handles == 0


def test_create_failure_releases_what_was_created_and_posts_nothing(mixed):
    """If NIXL cannot create one part's request, the created ones are released and nothing is posted."""
    _, parts = mixed
    agent = FakeAgent()
    agent.fail_create = {("peer3", "VRAM", "VRAM")}
    ex = Executor(agent, rank=3)
    with pytest.raises(NixlError, match="NOT_FOUND"):
        _submit(ex, parts)
    assert agent.live_handles == 0 and not any(x.posted for x in agent.created) and not ex.active


def test_timeout_holds_parts_in_flight_until_nixl_ends_them(mixed):
    """Past its deadline a request fails, but a posted part in flight is not released (that would not
    recall bytes the transport queued): it is held until NIXL says the part ended, then released and
    reported failed, with one 'failed' notification and no 'done'."""
    _, parts = mixed
    agent = FakeAgent()
    agent.states = {k: [PROC] for k in [("peer3", "DRAM", "VRAM"), ("peer3", "VRAM", "VRAM")]}
    clock = Clock()
    ex = Executor(agent, rank=3, clock=clock)
    out = _submit(ex, parts, timeout=5.0)
    clock.t = 4.9
    assert ex.progress() == []
    clock.t = 5.0
    for _ in range(3):
        assert ex.progress() == [] and agent.live_handles == 2 and out.status == "active"
    assert "timed out after 5s" in out.reason and not agent.sent
    agent.created[0].script = deque([DONE])
    agent.created[1].script = deque([ERR])
    assert ex.progress() == [out]
    assert out.status == "failed" and "timed out after 5s" in out.reason
    assert agent.live_handles == 0 and [n["status"] for _, n in _notifs(agent)] == ["failed"]


def test_cancel_that_nixl_refuses_is_retried_before_reporting(mixed):
    """A part NIXL cannot release yet (after it ended) keeps the request open; it is reported only once
    no handle is left."""
    _, parts = mixed
    agent = FakeAgent()
    agent.states = {k: [PROC, ERR] for k in [("peer3", "DRAM", "VRAM"), ("peer3", "VRAM", "VRAM")]}
    clock = Clock()
    ex = Executor(agent, rank=3, clock=clock)
    out = _submit(ex, parts, timeout=1.0)
    agent.created[0].refuse_release = 2
    clock.t = 2.0
    assert ex.progress() == [] and agent.live_handles == 1
    assert ex.progress() == [] and agent.live_handles == 1
    assert ex.progress() == [out] and agent.live_handles == 0 and out.status == "failed"


def test_failed_notification_fails_the_request(mixed):
    """All bytes moved but a peer cannot be told: the request is failed, not done."""
    _, parts = mixed
    agent = FakeAgent()
    agent.fail_notif = {"peer3"}
    ex = Executor(agent, rank=3)
    out = _submit(ex, parts)
    assert ex.progress() == [out]
    assert out.status == "failed" and "notifying rank 3 failed" in out.reason


def test_cancel_all_releases_in_flight_requests(mixed):
    """Closing cancels every in-flight request: handles released, requests failed, no 'done' sent."""
    _, parts = mixed
    agent = FakeAgent()
    agent.states = {k: [PROC] for k in [("peer3", "DRAM", "VRAM"), ("peer3", "VRAM", "VRAM")]}
    ex = Executor(agent, rank=3)
    outs = [_submit(ex, parts, req=f"r{i}") for i in range(3)]
    cancelled = ex.cancel_all("agent closed")
    assert sorted(o.req for o in cancelled) == sorted(o.req for o in outs)
    assert all(o.status == "failed" and o.reason == "agent closed" for o in outs)
    assert agent.live_handles == 0 and not ex.active
    assert {n["status"] for _, n in _notifs(agent)} == {"failed"}


def test_hetero_tp_one_notification_per_peer_rank():
    """TP4 consumer rank reading from two TP8 producer ranks: one request per peer, one 'done' to each."""
    cons = compile_spec(LAYOUTS / "llama-3.1-70b-hnd-tp4.yaml")
    prod = compile_spec(LAYOUTS / "llama-3.1-70b-hnd-tp8.yaml")
    prog = pair(cons, prod, local_rank=1, direction="READ")
    assert prog.peer_ranks == (2, 3)
    parts = instantiate(bind(prog, _bases(cons, 1), {2: _bases(prod, 2), 3: _bases(prod, 3)}),
                        {"full": [4, 5]}, {"full": [7, 8]}, 20
    )
    agent = FakeAgent()
    agent.states = {("peer2", "VRAM", "VRAM"): [PROC, DONE], ("peer3", "VRAM", "VRAM"): [PROC, PROC, DONE]}
    ex = Executor(agent, rank=1)
    out = _submit(ex, parts)
    assert len(agent.created) == 2
    assert ex.progress() == [] and agent.sent == []
    assert ex.progress() == [out]
    assert sorted(name for name, _ in agent.sent) == ["peer2", "peer3"]
    tag = notif_tag(KEY, "r1", "1", "done")
    assert all(n == {"v": 3, "req": "r1", "rank": 1, "status": "done", "why": "", "tag": tag}
               for _, n in _notifs(agent))


def _hetero():
    cons = compile_spec(LAYOUTS / "llama-3.1-70b-hnd-tp4.yaml")
    prod = compile_spec(LAYOUTS / "llama-3.1-70b-hnd-tp8.yaml")
    prog = pair(cons, prod, local_rank=1, direction="READ")
    return instantiate(bind(prog, _bases(cons, 1), {2: _bases(prod, 2), 3: _bases(prod, 3)}),
                       {"full": [4, 5]}, {"full": [7, 8]}, 20
    )


def test_requests_ending_together_share_one_notification_per_peer():
    """Five requests that end in the same progress turn: one batch notification to each peer rank
    naming all five in submission order, tagged over the whole list; a failed one in the same turn
    is told apart and is not in the batch."""
    parts = _hetero()
    agent = FakeAgent()
    agent.states = {("peer2", "VRAM", "VRAM"): [PROC, PROC, DONE], ("peer3", "VRAM", "VRAM"): [PROC, PROC, DONE]}
    ex = Executor(agent, rank=1)
    outs = [_submit(ex, parts, req=f"req-{i}") for i in range(5)]
    agent.states = {("peer2", "VRAM", "VRAM"): [PROC, PROC, ERR], ("peer3", "VRAM", "VRAM"): [PROC, PROC, DONE]}
    bad = _submit(ex, parts, req="bad")
    assert ex.progress() == [] and agent.sent == []
    assert set(o.req for o in ex.progress()) == {o.req for o in outs} | {"bad"}
    assert [o.status for o in outs] == ["done"] * 5 and bad.status == "failed"
    reqs = [o.req for o in outs]
    tag = notif_tag(KEY, "done*", "1", json.dumps(reqs, separators=(",", ":")))
    batches = [(name, n) for name, n in _notifs(agent) if "done" in n]
    assert sorted(batches, key=lambda b: b[0]) == [
        ("peer2", {"v": 3, "done": reqs, "rank": 1, "tag": tag}),
        ("peer3", {"v": 3, "done": reqs, "rank": 1, "tag": tag}),
    ]
    failed = [(name, n["req"], n["status"]) for name, n in _notifs(agent) if "done" not in n]
    assert sorted(failed) == [("peer2", "bad", "failed"), ("peer3", "bad", "failed")]
    assert all(o.notified == (2, 3) for o in outs) and bad.notified == ()


def test_a_batch_that_cannot_be_sent_fails_its_requests_only_where_untold():
    """The batch to one peer cannot be sent: every request in it fails; the other peer, told 'done'
    first, is not told 'failed' as well; the unreachable one is told 'failed' (best effort)."""
    parts = _hetero()
    agent = FakeAgent()
    agent.fail_notif = {"peer3"}
    ex = Executor(agent, rank=1)
    outs = [_submit(ex, parts, req=f"req-{i}") for i in range(3)]
    assert len(ex.progress()) == 3
    assert all(o.status == "failed" and "notifying rank 3 failed" in o.reason for o in outs)
    assert all(o.notified == (2,) for o in outs)
    sent = _notifs(agent)
    assert [name for name, _ in sent] == ["peer2"] and sent[0][1]["done"] == [o.req for o in outs]


def test_batches_stay_within_the_notification_limit():
    """Hundreds of long request ids ending together: several batch notifications, none over the
    limit, every request named exactly once, in order."""
    from kvlc.runtime.channel.notifs import MAX_BATCH_NOTIF_BYTES, decode_notif

    parts = _hetero()
    agent = FakeAgent()
    ex = Executor(agent, rank=1)
    outs = [_submit(ex, parts, req=f"{i:04d}-" + "r" * 120) for i in range(300)]
    assert len(ex.progress()) == 300 and all(o.status == "done" for o in outs)
    for peer in ("peer2", "peer3"):
        msgs = [m for name, m in agent.sent if name == peer]
        assert len(msgs) > 1 and all(len(m) <= MAX_BATCH_NOTIF_BYTES for m in msgs)
        assert [r for m in msgs for r in decode_notif(m).done] == [o.req for o in outs]


def test_parts_are_asked_oldest_first_and_per_peer_until_one_is_in_flight():
    """Four requests to two peers: within a turn, once a part to a peer is still in flight, later
    requests' parts to that peer are not asked (NIXL checks cost microseconds each); a request that
    finished out of order is seen at the next sweep (SWEEP_S), and one past its deadline is always
    asked (and held until its parts end)."""
    parts = _hetero()
    agent = FakeAgent()
    clock = Clock()
    ex = Executor(agent, rank=1, clock=clock)
    checks = []
    real = agent.state
    agent.state = lambda x: (checks.append(x.what.split("'")[1]), real(x))[1]
    slow = {("peer2", "VRAM", "VRAM"): [PROC], ("peer3", "VRAM", "VRAM"): [PROC]}
    agent.states = slow
    first = _submit(ex, parts, req="first")  # stays in flight to both peers
    agent.states = {k: [PROC, PROC, DONE] for k in slow}  # done at their second check
    later = [_submit(ex, parts, req=f"later-{i}") for i in range(2)]
    agent.states = slow
    timed = _submit(ex, parts, req="timed", timeout=1.0)
    assert ex.progress() == [] and len(checks) == 8  # the first turn sweeps: every part asked once
    checks.clear()
    clock.t = ex.SWEEP_S / 2
    assert ex.progress() == [] and checks == ["first", "first"]  # both peers busy with the oldest
    checks.clear()
    clock.t = ex.SWEEP_S
    assert sorted(o.req for o in ex.progress()) == ["later-0", "later-1"]  # the sweep sees them done
    assert checks.count("later-0") == 2 and checks.count("later-1") == 2
    assert all(o.status == "done" for o in later) and first.status == timed.status == "active"
    checks.clear()
    clock.t = 1.0 + ex.SWEEP_S / 4  # past timed's deadline (not a sweep turn): it is asked regardless
    assert ex.progress() == [] and checks == ["first", "first", "timed", "timed"]
    assert timed.status == "active" and "timed out" in timed.reason  # held: its parts are in flight
    for x in agent.created[-2:]:
        x.script = deque([ERR])
    assert ex.progress() == [timed] and timed.status == "failed" and "timed out" in timed.reason


def test_done_is_built_while_the_bytes_move_and_sent_as_built():
    """A request still in flight at a progress turn has its `done` built then, one per target: the bytes
    Target.done builds; its end sends exactly those bytes (the same object), nothing built again."""
    parts = _hetero()
    agent = FakeAgent()
    agent.states = {("peer2", "VRAM", "VRAM"): [PROC, PROC, DONE], ("peer3", "VRAM", "VRAM"): [PROC, PROC, DONE]}
    ex = Executor(agent, rank=1)
    out = _submit(ex, parts, req="moving")
    assert out.ready is None  # nothing built at submit: the copy has not been seen in flight yet
    assert ex.progress() == [] and agent.sent == []
    assert sorted(t.agent for t in out.ready) == ["peer2", "peer3"]
    assert all(msg == t.done(["moving"], 1) for t, msg in out.ready.items())
    built = {t.agent: msg for t, msg in out.ready.items()}
    assert ex.progress() == [out] and out.status == "done"
    assert sorted(agent.sent) == sorted(built.items())
    assert all(msg is built[name] for name, msg in agent.sent)


def test_with_several_in_flight_only_the_last_one_left_builds_its_done():
    """Requests in flight together may end together (one batch notification): none builds a single `done` while
    another is in flight; once it is the only one left it does, and its end sends those bytes."""
    parts = _hetero()
    agent = FakeAgent()
    agent.states = {("peer2", "VRAM", "VRAM"): [PROC, PROC, DONE], ("peer3", "VRAM", "VRAM"): [PROC, PROC, DONE]}
    ex = Executor(agent, rank=1)
    first = _submit(ex, parts, req="first")
    agent.states = {("peer2", "VRAM", "VRAM"): [PROC] * 4 + [DONE], ("peer3", "VRAM", "VRAM"): [PROC] * 4 + [DONE]}
    last = _submit(ex, parts, req="last")
    assert ex.progress() == [] and first.ready is None and last.ready is None
    assert ex.progress() == [first]  # first ends: from then on last is alone in flight
    assert last.status == "active" and last.ready
    built = {t.agent: msg for t, msg in last.ready.items()}
    while ex.active:
        ex.progress()
    assert last.status == "done"
    assert all(msg is built[name] for name, msg in agent.sent if json.loads(msg).get("req") == "last")


def test_a_request_that_fails_after_its_done_was_built_never_sends_it():
    """The `done` built in flight is kept back when a part then fails: only `failed` goes out."""
    parts = _hetero()
    agent = FakeAgent()
    agent.states = {("peer2", "VRAM", "VRAM"): [PROC, PROC, ERR], ("peer3", "VRAM", "VRAM"): [PROC, PROC, DONE]}
    ex = Executor(agent, rank=1)
    out = _submit(ex, parts, req="breaks")
    ex.progress()
    assert out.ready  # built while in flight
    assert ex.progress() == [out] and out.status == "failed"
    assert {n["status"] for _, n in _notifs(agent)} == {"failed"}


def test_members_of_a_batch_build_no_done_of_their_own():
    """Requests that share their parts end together and are told in one batch notification: none builds a
    single `done` while in flight."""
    from kvlc.runtime.transfer import Member

    parts = _hetero()
    agent = FakeAgent()
    moving = [PROC] * 8 + [DONE]  # the members share these parts: each asks them in a turn
    agent.states = {("peer2", "VRAM", "VRAM"): moving, ("peer3", "VRAM", "VRAM"): moving}
    ex = Executor(agent, rank=1)
    agents = {k.peer_rank: f"peer{k.peer_rank}" for k in parts}
    targets = {r: Target(name, KEY) for r, name in agents.items()}
    members = [Member(("direct", f"b{i}"), f"b{i}", 1, 1) for i in range(3)]
    outs = ex.submit_many(members, "READ", parts, agents, targets)
    assert ex.progress() == [] and all(o.ready == {} for o in outs)
    while ex.active:
        ex.progress()
    assert all(o.status == "done" and o.ready == {} for o in outs)
    assert sorted(n["done"] for _, n in _notifs(agent)) == [["b0", "b1", "b2"]] * 2
