"""KvAgent contracts that need no bytes moved: binding, registration lifetime, refusing hostile or
incompatible peers before anything is added to NIXL, and block ids checked before any request exists.

These agents are real NIXL (UCX) agents in this process; transfers run in the multi-process tests.
"""

from __future__ import annotations

import time

import msgpack
import pytest
from runtime_engines import KEY, LAYOUTS, SECRET, TEST_LAYOUTS, signed_hello

from kvlc import compile_spec
from kvlc.errors import CompatError, TransferError
from kvlc.runtime.settings import AgentSettings
from kvlc.runtime import BindingError, BlockRequest, HandshakeError, KvAgent, allocate
from kvlc.runtime.channel.client import ChannelClient
from kvlc.runtime.channel.tcp import ChannelServer
from kvlc.runtime.errors import ChannelError
from kvlc.runtime.nixl.core import Registration, Xfer
from kvlc.runtime.staging.endpoint import StagingPolicy
from kvlc.runtime.channel.identity import Identity
from kvlc.runtime.channel.wire import Fetch, Record, Reply, decode, encode

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")
pytestmark = pytest.mark.runtime

L = TEST_LAYOUTS


@pytest.fixture(scope="module")
def plans():
    return {n: compile_spec(L / f"{n}.yaml") for n in ("dense-tp1", "dense-tp2-hnd-b32", "hybrid-tp1")}


@pytest.fixture(scope="module")
def producer(plans):
    with KvAgent(plans["dense-tp1"], 0, allocate(plans["dense-tp1"]), AgentSettings(name="local-producer", secret=SECRET)) as a:
        a.serve()
        yield a


@pytest.fixture
def consumer(plans):
    with KvAgent(plans["dense-tp1"], 0, allocate(plans["dense-tp1"]), AgentSettings(secret=SECRET)) as a:
        yield a


def _nothing_added(agent):
    assert agent.nixl.remotes == frozenset()
    assert agent.nixl.live(Xfer) == []


# ----------------------------------------------------------------------------- binding
def test_binding_names_every_problem(plans):
    """Missing, too small, non-contiguous and unknown tensors are all reported, naming storage and values."""
    plan = plans["dense-tp1"]
    tensors = {"kv.0": torch.zeros(100, dtype=torch.uint8), "extra": torch.zeros(4)}
    with pytest.raises(BindingError) as err:
        KvAgent(plan, 0, tensors, AgentSettings(secret=SECRET))
    text = str(err.value)
    assert "storage 'kv.1': no tensor given" in text
    assert "storage 'kv.0': plan needs 262144 bytes; tensor has 100" in text
    assert "tensor(s) ['extra'] match no storage" in text
    bad = {
        "kv.0": torch.zeros(262144 * 2, dtype=torch.uint8)[::2],
        "kv.1": torch.zeros(262144, dtype=torch.uint8),
    }
    with pytest.raises(BindingError, match="storage 'kv.0': tensor must be contiguous"):
        KvAgent(plan, 0, bad, AgentSettings(secret=SECRET))


def test_vram_storage_needs_a_cuda_tensor():
    """A VRAM storage bound to a CPU tensor is refused with both memory types named."""
    plan = compile_spec(LAYOUTS / "llama-3.1-8b.yaml")
    fake = {s.name: torch.zeros(1, dtype=torch.uint8).expand(s.size) for s in plan.storages[:1]}
    with pytest.raises(
        BindingError, match=r"storage 'kv.0': plan says VRAM on device 0, so a cuda:0 tensor; got"
    ):
        KvAgent(plan, 0, fake, AgentSettings(secret=SECRET))


def test_rank_outside_plan_is_refused(plans):
    """A rank outside the plan's TP size is refused before anything is registered."""
    with pytest.raises(Exception, match="rank 2 outside plan"):
        KvAgent(plans["dense-tp2-hnd-b32"], 2, allocate(plans["dense-tp2-hnd-b32"]), AgentSettings(secret=SECRET))


def test_one_registration_per_storage_released_on_close(plans):
    """Each storage is registered once (plus, with staging on, one pool of staging inboxes); close()
    deregisters everything and is idempotent."""
    plan = plans["dense-tp1"]
    a = KvAgent(plan, 0, allocate(plan), AgentSettings(secret=SECRET, staging=StagingPolicy.always()))
    assert len(a.nixl.live(Registration)) == len(plan.storages) + 1 and a.stager is not None
    off = KvAgent(plan, 0, allocate(plan), AgentSettings(secret=SECRET, staging=StagingPolicy.never()))
    assert len(off.nixl.live(Registration)) == len(plan.storages) and off.stager is None
    off.close()
    a.serve()
    a.close()
    a.close()
    assert a.nixl.live_handles == 0 and a.address is None
    with pytest.raises(TransferError, match="closed"):
        a.connect("127.0.0.1:1")


# ----------------------------------------------------------------------------- hostile peers
def _ask(agent, payload: bytes):
    with ChannelClient(agent.address, KEY) as c:
        return decode(c.request(payload))


@pytest.mark.parametrize(
    "payload, why",
    [
        (b"\xc1garbage", "not msgpack"),
        (msgpack.packb({"t": "hello", "version": 3}), "Field required"),
        (msgpack.packb({"t": "fetch", "version": 9}), "wire version 9"),
        (msgpack.packb({"t": "reply", "ok": True}), "unexpected 'reply' message"),
        (
            msgpack.packb(
                {
                    "t": "pull",
                    "version": 3,
                    "req": "r",
                    "start": 0,
                    "stop": 16,
                    "consumer_blocks": {"full": [1]},
                    "producer_blocks": {"full": [1]},
                    "until": 1e12,
                    "budget_s": 1.0,
                }
            ),
            "no session on this connection",
        ),
    ],
)
def test_served_agent_refuses_hostile_frames(producer, payload, why):
    """Malformed or unexpected frames get an error reply, nothing is added to NIXL, the server serves on."""
    reply = _ask(producer, payload)
    assert isinstance(reply, Reply) and not reply.ok and why in reply.error
    _nothing_added(producer)
    assert isinstance(_ask(producer, encode(Fetch())), Record)


def test_introduction_with_foreign_metadata_is_refused(producer, plans):
    """A record whose NIXL metadata belongs to another agent name is refused; the agent is removed again."""
    with KvAgent(plans["dense-tp1"], 0, allocate(plans["dense-tp1"]), AgentSettings(name="real-name", secret=SECRET)) as other:
        me = Identity.generate()  # the impostor signs with its own key: the proof holds, the metadata does not
        impostor = other.record.model_copy(update={"agent": "impostor", "key": me.public})
        with ChannelClient(producer.address, KEY) as c:
            reply = decode(c.request(encode(signed_hello(c, producer.name, impostor, me))))
    assert not reply.ok and "NIXL metadata is agent 'real-name'" in reply.error
    _nothing_added(producer)


def test_introduction_from_incompatible_plan_is_refused(producer, plans):
    """An introduction whose plan does not pair reports the compatibility errors; nothing is added."""
    with KvAgent(plans["hybrid-tp1"], 0, allocate(plans["hybrid-tp1"]), AgentSettings(secret=SECRET)) as other:
        with ChannelClient(producer.address, KEY) as c:
            reply = decode(c.request(encode(other.hello(c, producer.name, "READ", "pull_via_push"))))
    assert not reply.ok and "error [" in reply.error
    _nothing_added(producer)


@pytest.fixture
def hostile():
    """A side-channel server whose answer the test chooses."""
    answer = {}
    server = ChannelServer(lambda conn, frame: answer["bytes"], lambda text: b"", KEY)
    yield server, answer
    server.close()


def test_connect_refuses_hostile_records(consumer, producer, hostile):
    """Garbage, refusals, tampered or forged records, oversize replies: refused at connect, nothing added."""
    server, answer = hostile
    good = producer.record
    tampered = msgpack.packb(dict(good.model_dump(), plan_digest="f" * 64), use_bin_type=True)
    bigger = good.plan_json.replace('"num_blocks":64', '"num_blocks":6400')
    forged = msgpack.packb(dict(good.model_dump(), plan_json=bigger), use_bin_type=True)
    cases = [
        (b"\x92\x01\x02", HandshakeError, "expected a msgpack map"),
        (encode(Reply(ok=False, error="go away")), HandshakeError, "go away"),
        (tampered, HandshakeError, "does not match the sha256"),
        (forged, HandshakeError, "does not match the sha256"),
        (encode(Fetch()), HandshakeError, "not a record"),
        (b"x" * (9 << 20), ChannelError, "side channel .* connection closed"),
    ]
    for data, kind, why in cases:
        answer["bytes"] = data
        with pytest.raises(kind, match=why):
            consumer.connect(server.address, timeout=5)
        _nothing_added(consumer)


def test_incompatible_plans_fail_at_connect(plans, producer):
    """Pairing errors surface at connect time as CompatError, with nothing added to NIXL."""
    with KvAgent(plans["hybrid-tp1"], 0, allocate(plans["hybrid-tp1"]), AgentSettings(secret=SECRET)) as other:
        with pytest.raises(CompatError):
            other.connect(producer.address)
        _nothing_added(other)


def test_missing_remote_rank_fails_at_connect(plans):
    """A TP1 consumer reading from a TP2 engine needs both producer ranks' addresses."""
    tp2 = plans["dense-tp2-hnd-b32"]
    with (
        KvAgent(tp2, 0, allocate(tp2), AgentSettings(secret=SECRET)) as r0,
        KvAgent(plans["dense-tp1"], 0, allocate(plans["dense-tp1"]), AgentSettings(secret=SECRET)) as c,
    ):
        with pytest.raises(HandshakeError, match=r"no address serves rank\(s\) \[1\]"):
            c.connect(r0.serve())
        _nothing_added(c)


# ----------------------------------------------------------------------------- block ids
def test_out_of_range_block_ids_are_refused_before_any_request(producer, consumer):
    """An id beyond a region's capacity raises TransferError naming region, id and capacity; no NIXL
    request is created, nothing is counted, the producer hears nothing."""
    peer = consumer.connect(producer.address)
    cases = [
        ({"full": [0, 1]}, {"full": [63, 64]}, "remote block id 64 out of range for region 'layer.0'"),
        ({"full": [64, 1]}, {"full": [0, 1]}, "local block id 64 out of range"),
        ({"full": [-1, 1]}, {"full": [0, 1]}, "local block id -1"),
        ({"full": [0]}, {"full": [0, 1]}, "1 local block ids for 20 tokens; expected 2"),
        ({}, {"full": [0, 1]}, "no block ids for group 'full'"),
    ]
    for lids, rids, why in cases:
        with pytest.raises(TransferError, match=why):
            peer.read("bad", lids, rids, 20)
    assert "capacity 64" in str(
        pytest.raises(TransferError, peer.read, "bad", {"full": [0, 1]}, {"full": [0, 99]}, 20).value
    )
    assert consumer.stats["requests"] == 0 and consumer.nixl.live(Xfer) == []
    with pytest.raises(TransferError, match="request id"):
        peer.read("has space", {"full": [0]}, {"full": [0]}, 1)
    with pytest.raises(TransferError, match="direction='WRITE'"):
        peer.write("w", {"full": [0]}, {"full": [0]}, 1)
    assert not producer.poll()


def test_a_connection_builds_what_its_requests_use_before_the_first(producer, consumer):
    """connect() binds the program and builds the packed table its requests' rows are written from (with the C
    libraries loaded), so the first request does not: the same table object serves every request after."""
    from kvlc.compiler.request import native
    from kvlc.compiler.request.native_rows import native_table

    peer = consumer.connect(producer.address)
    bound = consumer.bound_program(peer.engine)
    built = bound.memo.get("native_table", lambda: None)
    if native.library() is None:
        pytest.skip(f"no C rows here: {native.status()}")
    assert built is not None and built.array is not None  # made and packed at connect
    peer.read("first", {"full": [0, 1]}, {"full": [2, 3]}, 20)
    assert native_table(bound) is built
    assert list(_finish(consumer, producer, "first").finished) == ["first"]


def _finish(consumer, producer, req, timeout=10.0):
    """Poll the consumer only: the producer, never polled here, progresses through its progress thread
    (UCX needs the target's worker to progress for a READ between two agents of one process)."""
    return consumer.wait([req], timeout=timeout)


@pytest.mark.parametrize("mode", ["direct", "pull_via_push"])
def test_a_timeout_that_cannot_end_or_has_ended_is_refused_at_once(producer, consumer, mode):
    """NaN, infinity, more than a day, zero, less, a bool or a string: TransferError naming the value, from the
    call (a pull-via-push ask's frame carries at most a day; NaN would never time out), nothing asked, moved or
    kept in flight; the same id then moves with a good timeout."""
    peer = consumer.connect(producer.address, mode=mode)
    for bad in (float("nan"), float("inf"), 86401, 1e9, 0, -1.0, True, "5"):
        with pytest.raises(TransferError, match=r"timeout .*: give seconds, more than 0 and at most 86400"):
            peer.read("t", {"full": [0, 1]}, {"full": [2, 3]}, 20, timeout=bad)
        with pytest.raises(TransferError, match=r"timeout .*: give seconds"):
            consumer.expect("t", timeout=bad)
        with pytest.raises(TransferError, match=r"timeout .*: give seconds"):
            peer.read_many([BlockRequest("t", {"full": [0, 1]}, {"full": [2, 3]}, 20)], timeout=bad)
    assert consumer.in_flight == 0 and consumer.stats["requests"] == 0 and not consumer.incoming
    peer.read("t", {"full": [0, 1]}, {"full": [2, 3]}, 20, timeout=86400)
    assert list(_finish(consumer, producer, "t").finished) == ["t"]


def test_same_request_id_twice_in_flight_is_refused(producer, plans):
    """A request id already in flight is refused; once it finished, the id may be used again."""
    consumer = KvAgent(plans["dense-tp1"], 0, allocate(plans["dense-tp1"]), AgentSettings(secret=SECRET, progress="manual"))
    peer = consumer.connect(producer.address)
    peer.read("dup", {"full": [1]}, {"full": [2]}, 16)
    with pytest.raises(TransferError, match="already in flight"):
        peer.read("dup", {"full": [3]}, {"full": [4]}, 16)
    assert _finish(consumer, producer, "dup").finished == ("dup",)
    peer.read("dup", {"full": [3]}, {"full": [4]}, 16)
    assert _finish(consumer, producer, "dup").finished == ("dup",)
    assert consumer.nixl.live(Xfer) == []
    consumer.close()


def test_pull_via_push_asks_that_come_in_together_take_one_progress_step(producer, plans, monkeypatch):
    """Asks written while the producer is busy come in together: its server thread serves them one after
    another and takes one progress step (and one wake of its progress thread) after the last, not one each;
    every request still finishes (the bytes of pull via push: tests/runtime/test_e2e_modes.py)."""
    consumer = KvAgent(plans["dense-tp1"], 0, allocate(plans["dense-tp1"]), AgentSettings(secret=SECRET))
    steps = []
    served = producer._served
    monkeypatch.setattr(producer, "_served", lambda: (steps.append(1), served())[1])
    peer = consumer.connect(producer.address, mode="pull_via_push")
    reqs = [f"together-{i}" for i in range(6)]
    with producer._lock:  # the server thread waits at the first ask; the others queue behind it
        for i, req in enumerate(reqs):
            peer.read(req, {"full": [i]}, {"full": [10 + i]}, 16)
        time.sleep(0.2)
    got = consumer.wait(reqs, timeout=10)
    assert sorted(got.finished) == reqs and not got.failed
    assert 1 <= len(steps) <= 2  # the first ask alone (or with some of the rest), then every other one at once
    before = len(steps)
    for i in range(3):  # one at a time: a step each
        peer.read(f"alone-{i}", {"full": [i]}, {"full": [20 + i]}, 16)
        assert consumer.wait([f"alone-{i}"], timeout=10).finished == (f"alone-{i}",)
    assert len(steps) == before + 3
    consumer.close()


def test_bind_and_advertise_are_separate_and_a_wildcard_is_never_advertised(plans):
    """serve() binds where it is told and gives peers the advertised host: binding 0.0.0.0 alone is refused
    (peers cannot reach a wildcard) before anything is bound; with advertise= a peer connects through it."""
    from kvlc.errors import KvlcError

    plan = plans["dense-tp1"]
    with KvAgent(plan, 0, allocate(plan), AgentSettings(secret=SECRET, host="0.0.0.0")) as prod:
        for wildcard in (None, "0.0.0.0", "::", "[::]"):
            with pytest.raises(KvlcError, match="wildcard: peers cannot connect to it.*advertise="):
                prod.serve(advertise=wildcard)
        assert prod.address is None
        address = prod.serve(advertise="127.0.0.1")
        assert address.startswith("127.0.0.1:") and address == prod.address
        with KvAgent(plan, 0, allocate(plan), AgentSettings(secret=SECRET)) as cons:
            peer = cons.connect(address)
            peer.read("adv-1", {"full": [1]}, {"full": [2]}, 16)
            assert cons.wait(["adv-1"], 20).finished == ("adv-1",)


def test_engines_that_come_and_go_leave_a_bounded_record(plans):
    """Issue 27 F4: a producer serving consumer engines that each live once, under a new engine id,
    keeps at most IDLE_ENGINES records of engines with no session (and pairs each plan once)."""
    plan = plans["dense-tp1"]
    with KvAgent(plan, 0, allocate(plan), AgentSettings(secret=SECRET, engine_id="bounded-p")) as prod:
        prod.serve()
        prod.sessions.IDLE_ENGINES = 2
        programs = set()
        for i in range(6):
            with KvAgent(plan, 0, allocate(plan), AgentSettings(secret=SECRET, engine_id=f"lifetime-{i}")) as c:
                c.connect(prod.address, warm=False).close()
            programs |= {id(e.program) for e in prod.sessions.engines.values()}
        assert _wait(lambda: not prod.sessions.all())
        idle = [e for e in prod.sessions.engines.values() if not e.current]
        assert len(idle) <= 3 and len(prod.sessions.engines) <= 3, list(prod.sessions.engines)
        assert len(programs) == 1  # one pairing for one plan, shared by every engine of it


def _wait(pred, timeout: float = 10.0) -> bool:
    import time

    end = time.monotonic() + timeout
    while not pred() and time.monotonic() < end:
        time.sleep(0.05)
    return pred()
