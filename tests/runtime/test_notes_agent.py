"""`done` through a second NIXL agent (kvlc.runtime.nixl.notes), on real UCX agents: it arrives under the
peer's data agent name, a wrong notes agent is refused, the handshake carries it, and agents with and without
one work together, every byte checked."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvlc import compile_spec
from kvlc.runtime.errors import NixlError
from kvlc.runtime.nixl.core import Agent
from kvlc.runtime.nixl.notes import SUFFIX
from kvlc.runtime.settings import AgentSettings
from runtime_engines import SECRET, TEST_LAYOUTS

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")
pytestmark = pytest.mark.runtime


def _notes_until(agent: Agent, sender: Agent, count: int, timeout: float = 5.0) -> list[bytes]:
    """What ``agent`` received from ``sender`` (by its data agent's name) until ``count`` came; both progress
    (two agents of one process: no thread moves the sender's messages out but its own calls)."""
    got: list[bytes] = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        got += agent.notifs().get(sender.name, [])
        sender.notifs()
    return got


@pytest.fixture
def pair():
    a, b = Agent("notes-a", notes=True), Agent("notes-b", notes=True)
    yield a, b
    a.close()
    b.close()


def test_done_goes_through_the_notes_agents_and_comes_back_under_the_data_agents_name(pair):
    """With the receiver's notes agent loaded, send_done travels between the notes agents (the receiver loaded
    nothing of the sender); the receiver sees it under the sender's data agent name, with what the data agent
    sent (send_notif stays on the data agents)."""
    a, b = pair
    assert a.notes.name == "notes-a" + SUFFIX
    a.add_remote(b.metadata())
    assert not a.notes.reaches("notes-b")
    a.add_remote_notes("notes-b", b.notes_metadata())
    assert a.notes.reaches("notes-b")
    a.send_done("notes-b", b"done-1")
    a.send_notif("notes-b", b"failed-1")
    got = _notes_until(b, a, 2)
    assert sorted(got) == [b"done-1", b"failed-1"]
    assert (a.notes.sent, b.notes.taken, b.notes.sent, a.notes.taken) == (1, 1, 0, 0)
    assert "notes-a" + SUFFIX not in b.notifs()  # (never under the notes agent's own name)


def test_a_notes_agent_that_is_not_the_peers_is_refused_and_nothing_is_loaded(pair):
    """Loading, as B's notes agent, metadata that is B's data agent (or any other agent) fails with the names
    said; done then goes through the data agents, and a peer whose data agent is not loaded is refused too."""
    a, b = pair
    a.add_remote(b.metadata())
    with pytest.raises(NixlError, match=r"expected 'notes-b\.notes'"):
        a.add_remote_notes("notes-b", b.metadata())
    assert not a.notes.reaches("notes-b") and a.remotes == {"notes-b"}
    with pytest.raises(NixlError, match="its data agent is not loaded"):
        a.add_remote_notes("stranger", b.notes_metadata())
    a.send_done("notes-b", b"done-plain")
    assert _notes_until(b, a, 1) == [b"done-plain"]


def test_a_peer_whose_notes_metadata_is_another_peers_leaves_that_peers_notes_agent_loaded(pair):
    """Peer C's record naming B's notes agent as its own is refused, and B's notes agent, loaded for B, stays:
    B is still told through it."""
    a, b = pair
    c = Agent("notes-c", notes=True)
    try:
        a.add_remote(b.metadata())
        a.add_remote_notes("notes-b", b.notes_metadata())
        a.add_remote(c.metadata())
        with pytest.raises(NixlError, match=r"its metadata is agent 'notes-b\.notes', expected 'notes-c\.notes'"):
            a.add_remote_notes("notes-c", b.notes_metadata())
        assert a.notes.reaches("notes-b") and not a.notes.reaches("notes-c")
        a.send_done("notes-b", b"done-b")
        assert _notes_until(b, a, 1) == [b"done-b"] and b.notes.taken == 1
    finally:
        c.close()


def test_removing_a_peer_forgets_its_notes_agent(pair):
    """remove_remote forgets the peer's notes agent too: a later done to it fails like any send to an unknown
    agent (NIXL's error, the operation named), nothing sent."""
    a, b = pair
    a.add_remote(b.metadata())
    a.add_remote_notes("notes-b", b.notes_metadata())
    a.remove_remote("notes-b")
    assert not a.notes.reaches("notes-b") and a.remotes == frozenset()
    with pytest.raises(NixlError, match="send notification to 'notes-b'"):
        a.send_done("notes-b", b"late")
    assert _notes_until(b, a, 1, timeout=0.3) == []


def test_an_agent_without_notes_has_none():
    a = Agent("notes-none")
    try:
        assert a.notes is None and a.notes_metadata() is None
        with pytest.raises(NixlError, match="this agent has no notes agent"):
            a.add_remote_notes("x", b"md")
    finally:
        a.close()


def _push(prod_notes: bool, cons_notes: bool):
    """One push between two agents (each with or without a notes agent, NIXL only); returns what the producer's
    notes agent reaches, the requests the consumer finished and whether every byte is right."""
    from kvlc.demo.content import expected_bytes, fill
    from kvlc.runtime import KvAgent, allocate

    plan = compile_spec(TEST_LAYOUTS / "dense-tp1.yaml")
    tp, tc = allocate(plan), allocate(plan)
    fill(plan, 0, {n: t.numpy() for n, t in tp.items()})
    for t in tc.values():
        t.fill_(0x5A)
    prod = KvAgent(plan, 0, tp, AgentSettings(secret=SECRET, progress="manual", ipc="off", notes_agent=prod_notes))
    cons = KvAgent(plan, 0, tc, AgentSettings(secret=SECRET, progress="manual", ipc="off", notes_agent=cons_notes))
    try:
        assert (prod.record.notes_md is not None, cons.record.notes_md is not None) == (prod_notes, cons_notes)
        peer = prod.connect(cons.serve(), direction="WRITE")
        reached = prod.nixl.notes is not None and prod.nixl.notes.reaches(cons.name)
        taken = cons.nixl.notes.taken if cons.nixl.notes is not None else 0
        reqs = {f"n{i}": ([2 * i, 2 * i + 1], [40 + 2 * i, 41 + 2 * i]) for i in range(6)}
        finished: set[str] = set()
        for req, (src, dst) in reqs.items():  # one at a time: each WRITE follows the previous request's `done`
            cons.expect(req, 30.0)
            peer.write(req, {"full": src}, {"full": dst}, 32)
            deadline = time.monotonic() + 20
            while req not in finished and time.monotonic() < deadline:
                prod.poll()
                finished |= set(cons.poll().finished)
        untouched = {n: np.ones(t.numel(), dtype=bool) for n, t in tc.items()}
        right = True
        for req, (src, dst) in reqs.items():
            for storage, idx, vals in expected_bytes(plan, 0, plan, {"full": dst}, {"full": src}, 32):
                right &= bool((tc[storage].numpy()[idx] == vals).all())
                untouched[storage][idx] = False
        right &= all(bool((t.numpy()[untouched[n]] == 0x5A).all()) for n, t in tc.items())
        taken = (cons.nixl.notes.taken if cons.nixl.notes is not None else 0) - taken
        if reached:  # (what an operator sees of it)
            assert prod.stats["notes_sent"] >= 6 and cons.stats["notes_taken"] >= 6
        return reached, taken, finished == set(reqs), right, prod.stats.get("sessions_lost", 0)
    finally:
        prod.close()
        cons.close()


@pytest.mark.parametrize("prod_notes,cons_notes", [(True, True), (True, False), (False, True)],
                         ids=["both", "producer-only", "consumer-only"])
def test_pushes_finish_with_every_byte_whichever_side_has_a_notes_agent(prod_notes, cons_notes):
    """The handshake record carries the notes agent's metadata where an agent has one; the producer sends its
    `done` there only when both sides have one, else through the data agents as before; either way the consumer
    finishes every push, one at a time, every destination byte right and nothing else changed."""
    reached, taken, all_finished, right, lost = _push(prod_notes, cons_notes)
    assert reached == (prod_notes and cons_notes)
    assert taken == (6 if reached else 0)  # each push's `done` through the notes agents, or none of them
    assert all_finished and right and lost == 0


def _pushed(prod, cons, peer, req: str) -> bool:
    """Push ``req`` (blocks 0, 1 to 2, 3) and poll both sides until the consumer finished it (True) or 20 s."""
    peer.write(req, {"full": [0, 1]}, {"full": [2, 3]}, 32)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        prod.poll()
        if req in cons.poll().finished:
            return True
    return False


def test_a_record_whose_notes_agent_is_another_agent_is_connected_without_it(caplog):
    """A record whose ``notes_md`` is not its agent's notes agent (here: its data agent's metadata again) is
    still connected: the notes agent is not loaded (a warning says why) and `done` goes through the data agents;
    the push finishes with every byte."""
    from kvlc.runtime import KvAgent, allocate

    plan = compile_spec(TEST_LAYOUTS / "dense-tp1.yaml")
    prod = KvAgent(plan, 0, allocate(plan), AgentSettings(secret=SECRET, progress="manual", ipc="off"))
    cons = KvAgent(plan, 0, allocate(plan), AgentSettings(secret=SECRET, progress="manual", ipc="off"))
    try:
        cons.record = cons.record.model_copy(update={"notes_md": cons.record.nixl_md})
        with caplog.at_level("WARNING", logger="kvlc.runtime.agent"):
            peer = prod.connect(cons.serve(), direction="WRITE")
        assert not prod.nixl.notes.reaches(cons.name)
        assert any("notes agent was not loaded" in r.getMessage() for r in caplog.records)
        cons.expect("w", 30.0)
        assert _pushed(prod, cons, peer, "w")
    finally:
        prod.close()
        cons.close()


def test_a_forged_done_to_the_notes_agent_is_dropped_and_ends_nothing():
    """A stranger that read the consumer's record (its notes agent's metadata is there) and names itself as the
    producer's notes agent sends `done` for a request the consumer expects: dropped and counted, the request
    still open; the producer's real push then finishes it."""
    from kvlc.runtime import KvAgent, allocate
    from kvlc.runtime.channel.notifs import encode_notif

    plan = compile_spec(TEST_LAYOUTS / "dense-tp1.yaml")
    prod = KvAgent(plan, 0, allocate(plan), AgentSettings(secret=SECRET, progress="manual", ipc="off",
                                                          notes_agent=False))  # (its notes name is free)
    cons = KvAgent(plan, 0, allocate(plan), AgentSettings(secret=SECRET, progress="manual", ipc="off"))
    stranger = Agent(prod.name + SUFFIX)
    try:
        peer = prod.connect(cons.serve(), direction="WRITE")
        cons.expect("r1", 30.0)
        stranger.add_remote(cons.record.notes_md)
        dropped = cons.stats["dropped_notifs"]
        stranger.send_notif(cons.name + SUFFIX, encode_notif("r1", 0, "done", "0" * 24))
        deadline = time.monotonic() + 5
        while cons.stats["dropped_notifs"] == dropped and time.monotonic() < deadline:
            stranger.notifs()
            assert "r1" not in cons.poll().finished
        assert cons.stats["dropped_notifs"] == dropped + 1 and "r1" in cons.incoming
        assert _pushed(prod, cons, peer, "r1")
    finally:
        stranger.close()
        prod.close()
        cons.close()
