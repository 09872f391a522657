"""Hostile parties against real NIXL agents (in this process): nothing unauthenticated is accepted, and an
authenticated party can only ever make a producer write into memory that its own session declared.

Each test is named by the contract it proves; "outsider" = no secret, "insider" = holds the secret but is
another engine than the one it attacks.
"""

from __future__ import annotations

import socket

import msgpack
import numpy as np
import pytest
from runtime_engines import KEY, SECRET, TEST_LAYOUTS, signed_hello
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlc import compile_spec
from kvlc.runtime.settings import AgentSettings
from kvlc.runtime import AuthError, HandshakeError, KvAgent, allocate
from kvlc.runtime.channel.auth import resolve_secret
from kvlc.runtime.channel.client import ChannelClient
from kvlc.runtime.channel.tcp import Limits, write_frame
from kvlc.runtime.nixl.core import Agent, Xfer
from kvlc.runtime.channel.auth import notif_tag
from kvlc.runtime.channel.notifs import batch_fields, encode_notif, encode_notif_batch
from kvlc.runtime.channel.identity import Identity
from kvlc.runtime.channel.wire import Fetch, Introduce, Record, decode, encode

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")
pytestmark = pytest.mark.runtime
OUTSIDER = resolve_secret("not-the-secret-0123456789")


@pytest.fixture(scope="module")
def plan():
    return compile_spec(TEST_LAYOUTS / "dense-tp1.yaml")


def _agent(plan, engine, fill=None, **kw):
    t = allocate(plan)
    if fill is not None:
        for i, x in enumerate(t.values()):
            x[:] = torch.from_numpy(np.random.default_rng(fill + i).integers(0, 256, x.numel(), dtype=np.uint8))
    return KvAgent(plan, 0, t, AgentSettings(secret=SECRET, engine_id=engine, limits=Limits(max_per_address=8), **kw)), t


@pytest.fixture(scope="module")
def producer(plan):
    a, t = _agent(plan, "hostile-producer", fill=1)
    a.serve()
    yield a, t
    a.close()


@pytest.fixture
def victim(plan, producer):
    a, t = _agent(plan, "victim", fill=2)
    a.serve()
    yield a, t
    a.close()


def _state(agent):
    return (len(agent.sessions.all()), sorted(agent.nixl.remotes), len(agent.executor.active),
            len(agent.tallies), len(agent.incoming), agent.stats["requests"])


def _memory(tensors):
    return {k: v.clone() for k, v in tensors.items()}


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def test_outsider_gets_no_record_and_no_metadata(producer):
    """Without the secret, no frame reaches the server's handler: no record, no NIXL metadata."""
    a, _ = producer
    before = _state(a)
    with pytest.raises(AuthError):
        ChannelClient(a.address, OUTSIDER, timeout=3).request(encode(Fetch()))
    s = socket.create_connection(tuple(a.address.split(":")[:1]) + (int(a.address.split(":")[1]),), timeout=3)
    write_frame(s, encode(Fetch()))  # a plain frame, no handshake
    s.settimeout(3)
    got = s.recv(1 << 16)
    assert a.record.nixl_md not in got and b"nixl_md" not in got
    s.close()
    assert _state(a) == before


def test_insider_pull_request_writes_only_into_its_own_declared_memory(plan, producer, victim):
    """An authenticated engine's pull request names no victim: the producer writes only into the bases
    that session declared (its own memory), never into the victim's, and the victim hears nothing."""
    prod, _ = producer
    vic, vt = victim
    attacker, at = _agent(plan, "attacker", fill=3)
    with attacker:
        before_v, before_a = _memory(vt), _memory(at)
        peer = attacker.connect(prod.address, mode="pull_via_push")
        peer.read("steal-1", {"full": [0, 1]}, {"full": [5, 6]}, 20)
        assert attacker.wait(["steal-1"], timeout=20).finished == ("steal-1",)
        assert _same(vt, before_v), "the victim's memory changed"
        assert not _same(at, before_a)  # the bytes went to the attacker's own blocks
        assert not vic.poll()


def test_record_replacement_within_an_epoch_is_refused(plan, producer, victim):
    """A hello carrying the victim's record with bases moved by a block (or its name on other NIXL
    metadata) is refused while the victim's session lives; the victim's next request lands right."""
    prod, pt = producer
    vic, vt = victim
    peer = vic.connect(prod.address, mode="pull_via_push")
    me = Identity.generate()  # the insider signs with its own key (it has no other)
    moved = vic.record.model_copy(update={"key": me.public, "storages": tuple(
        s.model_copy(update={"addr": s.addr + 4096}) for s in vic.record.storages)})
    with ChannelClient(prod.address, KEY) as c:
        reply = decode(c.request(encode(signed_hello(c, prod.name, moved, me))))
    assert not reply.ok and "cannot change within an epoch" in reply.error
    before = _memory(vt)
    peer.read("v-1", {"full": [10, 11]}, {"full": [3, 4]}, 32)
    assert vic.wait(["v-1"], timeout=20).finished == ("v-1",)
    for name in ("kv.0", "kv.1"):
        got, want = vt[name].numpy(), pt[name].numpy()
        assert (got[10 * 4096:12 * 4096] == np.concatenate([want[3 * 4096:4 * 4096], want[4 * 4096:5 * 4096]])).all()
        assert (got[:10 * 4096] == before[name].numpy()[:10 * 4096]).all()


def test_a_replayed_record_on_another_connection_opens_no_session(plan, producer, victim):
    """F3: an insider fetches the victim's record from the victim and introduces it on its own connection
    to the producer, with no proof, with a forged one, and with the victim's real signature captured
    from another connection: every hello is refused before anything is paired or loaded (no session,
    no NIXL remote), a pull request on that connection is refused, and the victim's memory and its own
    session are untouched."""
    prod, _ = producer
    vic, vt = victim
    with ChannelClient(vic.address, KEY) as c:
        rec = decode(c.request(encode(Fetch())))  # the victim hands its record to any holder of the secret
    assert isinstance(rec, Record) and rec == vic.record
    with ChannelClient(prod.address, KEY) as elsewhere:  # a hello the victim signed, on another connection
        captured = vic.hello(elsewhere, prod.name, "READ", "pull_via_push").proof
    before, refused, mem = _state(prod), prod.stats["refused_hellos"], _memory(vt)
    for proof in (b"\0" * 64, Identity.generate().sign(b"anything"), captured):
        with ChannelClient(prod.address, KEY) as c:
            hello = Introduce(record=rec, direction="READ", mode="pull_via_push", proof=proof)
            reply = decode(c.request(encode(hello)))
            assert not reply.ok and "did not prove it holds its record's key" in reply.error
            pull = decode(c.request(msgpack.packb({"t": "pull", "version": 3, "req": "stolen", "start": 0, "stop": 16,
                                                   "consumer_blocks": {"full": [1]}, "producer_blocks": {"full": [1]},
                                                   "until": 1e12, "budget_s": 5.0})))
            assert not pull.ok and "no session on this connection" in pull.error
    assert _state(prod) == before and prod.stats["refused_hellos"] == refused + 3
    assert vic.name not in prod.nixl.remotes
    peer = vic.connect(prod.address, mode="pull_via_push")  # the victim's own introduction still holds
    peer.read("own-1", {"full": [30]}, {"full": [2]}, 16)
    assert vic.wait(["own-1"], timeout=20).finished == ("own-1",)
    with ChannelClient(prod.address, KEY) as c:  # and a replay next to its live session is refused too
        reply = decode(c.request(encode(Introduce(record=rec, direction="READ", mode="pull_via_push", proof=captured))))
    assert not reply.ok and len(prod.sessions.live(vic.name)) == 1
    changed = {k: int((vt[k] != mem[k]).sum()) for k in vt}
    outside = [k for k in vt if not (torch.equal(vt[k][:30 * 4096], mem[k][:30 * 4096])
                                      and torch.equal(vt[k][31 * 4096:], mem[k][31 * 4096:]))]
    assert sum(changed.values()) > 0 and outside == []  # only block 30, which the victim asked for, changed


def test_identity_hijack_by_another_engine_is_refused(plan, producer, victim):
    """A NIXL agent created under the victim's name by another engine (even one holding the secret) is
    refused: the name belongs to the victim's session; the producer's NIXL remote is not swapped."""
    prod, _ = producer
    vic, _ = victim
    vic.connect(prod.address, mode="pull_via_push")
    t = allocate(plan)
    impostor = KvAgent(plan, 0, t, AgentSettings(secret=SECRET, engine_id="impostor", name=vic.name))
    try:
        with pytest.raises(HandshakeError, match="already belongs to rank 0 of engine 'victim'"):
            impostor.connect(prod.address, mode="pull_via_push")
        assert vic.name in prod.nixl.remotes
        s = prod.sessions.live(vic.name)
        assert s and all(x.engine_id == "victim" for x in s)
    finally:
        impostor.close()


def test_forged_notification_from_a_name_twin_is_dropped(plan, producer, victim):
    """A NIXL agent that takes the producer's name and sends the victim a 'done' for its request is
    dropped (no session key signs it); the request still ends on the real producer's answer."""
    prod, _ = producer
    vic, _ = victim
    peer = vic.connect(prod.address, mode="pull_via_push")
    twin = Agent(prod.name)
    try:
        twin.add_remote(vic.record.nixl_md)
        vic.expect("forged", 30.0)
        twin.send_notif(vic.name, encode_notif("forged", 0, "done", "0" * 24))
        dropped = vic.stats["dropped_notifs"]
        for _ in range(300):
            twin.notifs()  # progresses the twin's worker, so its message goes out
            vic.poll()
            if vic.stats["dropped_notifs"] > dropped:
                break
            __import__("time").sleep(0.01)
        assert vic.stats["dropped_notifs"] > dropped
        assert "forged" in vic.incoming  # still waiting, not finished
    finally:
        twin.close()
    peer.read("after-forge", {"full": [20]}, {"full": [1]}, 16)
    assert vic.wait(["after-forge"], timeout=20).finished == ("after-forge",)


def test_forged_or_altered_batch_notifications_are_dropped(plan, producer, victim):
    """Batch 'done' notifications from the producer's name twin are dropped when unsigned, when their
    list differs from the one the session key signed (a request added, the list reordered), and when
    signed for another rank; the requests they name stay open, and the real producer's batches still count."""
    prod, _ = producer
    vic, _ = victim
    peer = vic.connect(prod.address, mode="pull_via_push")
    (s,) = vic.sessions.live(prod.name)
    signed = notif_tag(s.notif_key, *batch_fields(["b1"], 0))
    forgeries = [
        encode_notif_batch(["b1", "b2"], 0, "0" * 24),  # no key
        encode_notif_batch(["b1", "b2"], 0, signed),  # b2 added to a list signed as [b1]
        encode_notif_batch(["b2", "b1"], 0, notif_tag(s.notif_key, *batch_fields(["b1", "b2"], 0))),
        encode_notif_batch(["b1"], 1, signed),  # another rank
    ]
    twin = Agent(prod.name)
    try:
        twin.add_remote(vic.record.nixl_md)
        for req in ("b1", "b2"):
            vic.expect(req, 30.0)
        dropped = vic.stats["dropped_notifs"]
        for m in forgeries:
            twin.send_notif(vic.name, m)
        for _ in range(300):
            twin.notifs()
            vic.poll()
            if vic.stats["dropped_notifs"] >= dropped + len(forgeries):
                break
            __import__("time").sleep(0.01)
        assert vic.stats["dropped_notifs"] == dropped + len(forgeries)
        assert {"b1", "b2"} <= set(vic.incoming)  # still waiting, not finished
    finally:
        twin.close()
    reqs = [f"after-batch-{i}" for i in range(6)]
    for i, req in enumerate(reqs):
        peer.read(req, {"full": [20 + i]}, {"full": [1 + i]}, 16)
    assert sorted(vic.wait(reqs, timeout=20).finished) == reqs


def test_bases_past_2_63_are_refused_in_records(producer):
    """A record whose storage reaches past 2^63 is refused when decoded; nothing is kept."""
    a, _ = producer
    bad = a.record.model_dump()
    bad["storages"] = tuple(dict(s, addr=(1 << 63) - 8) for s in bad["storages"])
    with pytest.raises(HandshakeError, match="past 2\\^63|less than"):
        decode(msgpack.packb(bad, use_bin_type=True))


def test_state_from_many_connections_is_bounded_and_dies_with_them(plan, producer):
    """Authenticated connections beyond the per-address cap are refused; each session lives only as long as
    its connection: after the clients close, the producer keeps none of them."""
    prod, _ = producer
    other, _ = _agent(plan, "many")

    def theirs() -> list:  # the sessions of this test's agent (an earlier test's may end meanwhile)
        return [s for s in prod.sessions.all() if s.agent == other.name]

    with other:
        clients, refused = [], 0
        for _ in range(20):
            c = ChannelClient(prod.address, KEY, timeout=3)
            try:
                assert decode(c.request(encode(other.hello(c, prod.name, "READ", "direct")))).ok
                clients.append(c)
            except Exception:
                refused += 1
        assert refused > 0 and 0 < len(theirs()) <= prod.limits.max_per_address
        for c in clients:
            c.close()
        for _ in range(200):
            if not theirs():
                break
            __import__("time").sleep(0.02)
        assert theirs() == []


_FIELDS = st.dictionaries(st.sampled_from(["t", "version", "req", "record", "until", "budget_s", "conn", "tag",
                                            "consumer_blocks", "producer_blocks", "start", "stop", "agent"]),
                          st.one_of(st.integers(-(1 << 63), (1 << 64) - 1), st.text(max_size=20), st.binary(max_size=20),
                                    st.sampled_from(["fetch", "hello", "pull", "cancel", "record"])), max_size=8)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(frames=st.lists(st.one_of(st.binary(max_size=80), _FIELDS.map(lambda d: msgpack.packb(d))),
                       min_size=1, max_size=4),
       handshake=st.sampled_from(["none", "hello-only", "bad-proof"]))
def test_no_frames_from_an_unauthenticated_party_change_state_or_move_a_byte(producer, frames, handshake):
    """Any sequence of frames from a party without the secret (no handshake, half a handshake, or a
    wrong proof) leaves the agent's sessions, NIXL remotes, transfers, tallies and memory as they were."""
    from kvlc.runtime.channel import auth

    a, t = producer
    before, mem = _state(a), _memory(t)
    host, port = a.address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=3)
    try:
        if handshake != "none":
            write_frame(s, auth.client_hello(auth.new_nonce()))
            if handshake == "bad-proof":
                write_frame(s, b"\1" * auth.TAG)
        for f in frames:
            write_frame(s, f)
    except OSError:
        pass
    finally:
        s.close()
    a.poll()
    assert _state(a) == before and _same(t, mem)
    assert a.nixl.live(Xfer) == []


def test_agent_without_a_secret_refuses_to_start_unless_insecure(plan, monkeypatch, caplog):
    """No secret= and no $KVLC_SECRET / $KVLC_SECRET_FILE: the agent refuses to start, naming the fix;
    insecure=True starts it with a logged warning, and it still refuses peers that use a real secret."""
    monkeypatch.delenv("KVLC_SECRET", raising=False)
    monkeypatch.delenv("KVLC_SECRET_FILE", raising=False)
    with pytest.raises(AuthError, match="no side-channel secret: pass secret="):
        KvAgent(plan, 0, allocate(plan))
    with caplog.at_level("WARNING"):
        open_agent = KvAgent(plan, 0, allocate(plan), AgentSettings(insecure=True))
    try:
        assert "INSECURE" in caplog.text
        with pytest.raises(AuthError):
            ChannelClient(open_agent.serve(), KEY, timeout=3).request(encode(Fetch()))
    finally:
        open_agent.close()


def _pump_until(agents, cond, tries: int = 500) -> bool:
    for _ in range(tries):
        for a in agents:
            a.poll()
        if cond():
            return True
        __import__("time").sleep(0.01)
    return False


@pytest.mark.parametrize("staging", ["off", "on"])
def test_a_push_request_ends_only_by_the_producer_it_is_expected_from(plan, staging):
    """F2: a consumer expects request 'x' from producer P; another engine holding the secret, in its own
    push session with the consumer, sends correctly signed 'failed' and 'done' for 'x' and pushes an 'x'
    of its own (staged chunks, staging on). None of it ends or flips 'x' (each dropped and counted, no
    staged chunk scattered); 'x' finishes only on P's push, with P's bytes, and nothing lands after."""
    from kvlc.runtime.channel.auth import notif_tag
    from kvlc.runtime.staging.endpoint import StagingPolicy

    policy = StagingPolicy(mode="always", slot_bytes=4096, slots=2, peers=2) if staging == "on" else StagingPolicy.never()
    cons, ct = _agent(plan, f"f2-consumer-{staging}", fill=4, staging=policy)
    prod, pt = _agent(plan, f"f2-producer-{staging}", fill=5, staging=policy)
    evil, _ = _agent(plan, f"f2-other-{staging}", fill=6, staging=policy)
    with cons, prod, evil:
        cons.serve()
        to_c = prod.connect(cons.address, direction="WRITE")
        forger = evil.connect(cons.address, direction="WRITE")
        cons.expect("x", 30.0, producer=prod.engine_id)
        key = forger.sessions[0].notif_key
        dropped, fenced = cons.stats["dropped_notifs"], cons.stats["fenced_chunks"]
        for status in ("failed", "done"):
            evil.nixl.send_notif(cons.name, encode_notif("x", 0, status, notif_tag(key, "x", "0", status), "forged"))
        forger.write("x", {"full": [7]}, {"full": [40]}, 16)  # a real push of its own, signed 'done' at its end
        assert _pump_until([cons, evil], lambda: cons.stats["dropped_notifs"] >= dropped + 3)
        assert cons.stats["dropped_notifs"] == dropped + 3
        assert staging == "off" or cons.stats["fenced_chunks"] > fenced  # its chunks were not scattered
        c = cons.poll()
        assert "x" in cons.incoming and not c.finished and not c.failed and not c.held
        before = _memory(ct)
        to_c.write("x", {"full": [3, 4]}, {"full": [10, 11]}, 32)
        assert cons.wait(["x"], timeout=20).finished == ("x",)
        for name in ("kv.0", "kv.1"):
            got, want = ct[name].numpy(), pt[name].numpy()
            assert (got[10 * 4096:12 * 4096] == want[3 * 4096:5 * 4096]).all()
        at_end = _memory(ct)
        assert _pump_until([cons, prod, evil], lambda: False, tries=50) is False
        assert _same(ct, at_end) and not _same(ct, before)


def test_a_push_request_ended_by_another_engine_before_it_was_expected_is_opened_again(plan):
    """F2, early: another engine's signed 'failed' for 'y' arrives before the consumer expects 'y' from P
    and ends it there (unasked); expect('y', producer=P) drops that end (counted, and poll() never
    reports it) and 'y' finishes on P's push with P's bytes."""
    from kvlc.runtime.channel.auth import notif_tag

    cons, ct = _agent(plan, "f2e-consumer", fill=7)
    prod, pt = _agent(plan, "f2e-producer", fill=8)
    evil, _ = _agent(plan, "f2e-other", fill=9)
    with cons, prod, evil:
        cons.serve()
        to_c = prod.connect(cons.address, direction="WRITE")
        key = evil.connect(cons.address, direction="WRITE").sessions[0].notif_key
        evil.nixl.send_notif(cons.name, encode_notif("y", 0, "failed", notif_tag(key, "y", "0", "failed"), "forged"))
        for _ in range(500):  # the progress thread reads it; the engine has not polled
            evil.nixl.notifs()
            if cons.ended(("unasked", "y")) is not None:
                break
            __import__("time").sleep(0.01)
        assert cons.ended(("unasked", "y")) == "f2e-other"
        dropped = cons.stats["dropped_notifs"]
        cons.expect("y", 30.0, producer=prod.engine_id)
        assert cons.stats["dropped_notifs"] == dropped + 1 and "y" in cons.incoming
        to_c.write("y", {"full": [2]}, {"full": [12]}, 16)
        out = cons.wait(["y"], timeout=20)
        assert out.finished == ("y",) and "y" not in out.failed and "y" not in out.held
        for name in ("kv.0", "kv.1"):
            assert (ct[name].numpy()[12 * 4096:13 * 4096] == pt[name].numpy()[2 * 4096:3 * 4096]).all()


def test_a_server_replaying_another_agents_record_is_refused_at_connect(plan, producer):
    """An insider's server that hands out the producer's record (a forged registry entry pointing at it,
    say) and accepts every hello cannot sign the answer with the producer's key: connect refuses it,
    and the connecting agent keeps no session and no NIXL remote."""
    from kvlc.runtime.channel.tcp import ChannelServer
    from kvlc.runtime.channel.wire import Reply

    prod, _ = producer
    fake = ChannelServer(lambda conn, frame: encode(prod.record) if isinstance(decode(frame), Fetch)
                         else encode(Reply(ok=True)), lambda text: b"", KEY)
    cons, _ = _agent(plan, "fooled")
    try:
        host, port = fake.address
        for mode in ("direct", "pull_via_push"):
            with pytest.raises(HandshakeError, match="did not prove it holds the key of the record it sent"):
                cons.connect(f"{host}:{port}", mode=mode, warm=False)
            assert cons.sessions.all() == [] and cons.nixl.remotes == frozenset()
    finally:
        fake.close()
        cons.close()
