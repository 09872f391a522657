"""Wire formats: records, side-channel messages and notifications are validated strictly, never pickled."""

from __future__ import annotations

import json

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from runtime_engines import TEST_LAYOUTS

from kvlc import compile_spec
from kvlc.runtime.errors import HandshakeError
from kvlc.runtime.kinds import Status
from kvlc.runtime.channel.notifs import MAX_NOTIF_BYTES, decode_notif, encode_notif
from kvlc.runtime.channel.wire import (
    MAX_RECORD_BYTES,
    Fetch,
    Introduce,
    Cancel,
    PullRequest,
    Record,
    Reply,
    StorageBase,
    decode,
    decode_record,
    encode,
    make_record,
)

pytestmark = pytest.mark.runtime


@pytest.fixture(scope="module")
def plan():
    return compile_spec(TEST_LAYOUTS / "dense-tp2-hnd-b32.yaml")


@pytest.fixture(scope="module")
def record(plan):
    return make_record(
        "agent-a",
        b"\x01nixl-metadata",
        plan,
        1,
        [
            StorageBase(name=s.name, addr=(i + 1) << 30, size=s.size, mem=s.mem, device=0)
            for i, s in enumerate(plan.storages)
        ],
        "engine-a",
        "0123456789abcdef",
        b"k" * 32,
    )


def _raw(record, **changes):
    d = record.model_dump()
    d.update(changes)
    return msgpack.packb(d, use_bin_type=True)


def test_record_round_trips(record, plan):
    """A record survives encode/decode and yields the sender's plan and bases."""
    back = decode_record(encode(record))
    assert back == record and back.plan == plan
    assert back.bases()["kv.1"] == (2 << 30, 0)


@pytest.mark.parametrize("until", [float("nan"), float("inf"), float("-inf")])
def test_a_pull_request_without_a_finite_deadline_is_refused(until):
    """Issue 27 F5: NaN or an infinite deadline never times out; refused when the frame is read."""
    msg = PullRequest.model_construct(t="pull", version=3, req="r", consumer_blocks={"full": (1,)},
                                      producer_blocks={"full": (1,)}, start=0, stop=16, until=until, budget_s=1.0)
    raw = msgpack.packb(msg.model_dump())
    with pytest.raises(HandshakeError, match="until"):
        decode(raw)


def test_a_pull_request_runs_no_longer_than_its_budget():
    """A deadline far in the future (1e308) is cut to the budget the consumer had when it sent the frame."""
    from kvlc.runtime.server import time_left

    far = PullRequest(req="r", consumer_blocks={"full": (1,)}, producer_blocks={"full": (1,)}, start=0,
                      stop=16, until=1e308, budget_s=2.0)
    assert time_left(far, now=100.0) == 2.0
    near = far.model_copy(update={"until": 101.0})
    assert time_left(near, now=100.0) == 1.0


def test_messages_round_trip(record):
    """Every side-channel message type decodes to what was encoded."""
    msgs = [
        Fetch(),
        Reply(ok=False, error="no"),
        Introduce(record=record, direction="READ", mode="pull_via_push", address="127.0.0.1:5", proof=b"s" * 64),
        PullRequest(
            req="r-1",
            consumer_blocks={"full": (1, 2)},
            producer_blocks={"full": (3, 4)},
            start=0,
            stop=40,
            until=1234.5,
            budget_s=2.5,
        ),
        PullRequest(req="r-2", consumer_blocks={"full": (2,)}, producer_blocks={"full": (1,)}, start=20,
                    stop=40, until=1.0, budget_s=1.0),
        Cancel(req="r-1"),
        Cancel(req="r-1", conn="a" * 32, tag="b" * 24),
        Reply(ok=True, status="cancelled"),
    ]
    for m in msgs:
        assert decode(encode(m)) == m


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(version=1), "wire version 1"),
        (dict(version=True), "wire version True"),
        (dict(plan_digest="0" * 64), "does not match the sha256"),
        (dict(rank=2), "rank 2 outside plan"),
        (dict(rank=-1), "greater than or equal to 0"),
        (dict(rank="0"), "valid integer"),
        (dict(nixl_md="text"), "valid bytes"),
        (dict(agent="bad name!"), "should match pattern"),
        (dict(extra=1), "Extra inputs are not permitted"),
        (dict(storages=()), "do not match plan storages"),
    ],
)
def test_bad_records_are_refused_with_a_reason(record, change, message):
    """Wrong version, digest, rank, types, extra keys or storages: HandshakeError saying which."""
    with pytest.raises(HandshakeError, match=message):
        decode_record(_raw(record, **change))


def test_tampered_plan_is_refused(record):
    """A plan JSON changed after hashing (digest kept) is refused; so is a non-canonical one."""
    with pytest.raises(HandshakeError, match="does not match"):
        decode_record(
            _raw(record, plan_json=record.plan_json.replace('"num_blocks":40', '"num_blocks":4000'))
        )
    spaced = record.plan_json.replace(",", ", ")
    import hashlib

    with pytest.raises(HandshakeError, match="canonical"):
        decode_record(_raw(record, plan_json=spaced, plan_digest=hashlib.sha256(spaced.encode()).hexdigest()))
    junk = '{"not": "a plan"}'
    with pytest.raises(HandshakeError, match="not a kvlc plan"):
        decode_record(_raw(record, plan_json=junk, plan_digest=hashlib.sha256(junk.encode()).hexdigest()))


def test_storage_smaller_than_plan_is_refused(record):
    """A record whose storage is smaller than its plan says is refused."""
    st = [dict(s.model_dump(), size=10) for s in record.storages]
    with pytest.raises(HandshakeError, match="plan needs DRAM with 163840 bytes"):
        decode_record(_raw(record, storages=st))


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "empty"),
        (b"\xc1", "not msgpack"),
        (msgpack.packb([1, 2, 3]), "expected a msgpack map"),
        (msgpack.packb({"t": "fetch", "version": 3}) + b"\x00", "trailing bytes"),
        (b"\x91" * 100000, "not msgpack"),
        (msgpack.packb({"t": "launch", "version": 3}), "does not match any of the expected tags"),
        (msgpack.packb({"t": "fetch", "version": 3, "x": 1}), "Extra inputs"),
        (msgpack.packb({1: 2}), "not msgpack"),
        (
            msgpack.packb(
                {
                    "t": "pull",
                    "version": 3,
                    "req": "r",
                    "agent": "a",
                    "rank": 0,
                    "stop": 1.5,
                    "consumer_blocks": {},
                    "producer_blocks": {},
                }
            ),
            "valid integer",
        ),
        (
            msgpack.packb(
                {
                    "t": "pull",
                    "version": 3,
                    "req": "r",
                    "agent": "a",
                    "rank": 0,
                    "stop": 1,
                    "consumer_blocks": {"g": [-1]},
                    "producer_blocks": {},
                }
            ),
            "greater than or equal to 0",
        ),
    ],
)
def test_hostile_frames_are_refused(data, message):
    """Garbage, deep nesting, unknown types, extra keys, wrong types: refused with a reason, no crash."""
    with pytest.raises(HandshakeError, match=message):
        decode(data)


def test_truncated_and_oversize_records_are_refused(record):
    """A record cut anywhere, or over the size bound, is refused."""
    data = encode(record)
    for cut in (1, 10, len(data) // 2, len(data) - 1):
        with pytest.raises(HandshakeError):
            decode_record(data[:cut])
    with pytest.raises(HandshakeError, match="over the"):
        decode_record(b"\x80" + b"\x00" * MAX_RECORD_BYTES)


def test_decoding_never_unpickles():
    """A pickle payload is just refused bytes."""
    import pickle

    with pytest.raises(HandshakeError):
        decode(pickle.dumps({"t": "fetch", "version": 3}))


T = "0" * 24


def test_notification_format():
    """Notifications are compact JSON with v, req, rank, status, why and the session tag; always
    within MAX_NOTIF_BYTES, however long the reason."""
    done = b'{"v":3,"req":"req-7","rank":3,"status":"done","why":"","tag":"' + T.encode() + b'"}'
    assert encode_notif("req-7", 3, "done", T) == done
    failed = json.loads(encode_notif("req-7", 3, "failed", T, "x" * 500))
    assert failed["status"] == "failed" and len(failed["why"]) == 200
    assert len(encode_notif("r" * 128, 3, "failed", T, "\u2603" * 300)) <= MAX_NOTIF_BYTES
    n = decode_notif(done)
    assert (n.req, n.rank, n.status, n.tag) == ("req-7", 3, "done", T)


_NOTIF_FIELDS = dict(
    req=st.one_of(st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7e), min_size=1, max_size=128),
                  st.text(max_size=140), st.just("req\n"), st.integers()),
    rank=st.one_of(st.integers(-2, 70000), st.booleans(), st.just(1.0)),
    status=st.sampled_from(["done", "failed", "cancelled", Status.DONE, Status.FAILED]),
    tag=st.one_of(st.just(T), st.text("0123456789abcdefABCDEF", min_size=23, max_size=25)),
    why=st.text(max_size=400))


@settings(max_examples=400, deadline=None)
@given(**_NOTIF_FIELDS)
def test_notification_fast_path_equals_the_model(req, rank, status, tag, why):
    """encode_notif's path without the model gives the model's bytes, and refuses what the model refuses."""
    from kvlc.runtime.channel.notifs import _encode_checked

    try:
        want = _encode_checked(req, rank, str(status), tag, why[:200])
    except Exception as exc:  # the model refuses: so does encode_notif, with the same error
        with pytest.raises(type(exc)):
            encode_notif(req, rank, status, tag, why)
        return
    assert encode_notif(req, rank, status, tag, why) == want


def test_batch_notification_format():
    """A batch names its requests in order under one tag over marker, rank and the list's JSON; it
    may exceed a single notification's limit but not MAX_BATCH_NOTIF_BYTES."""
    from kvlc.runtime.channel.auth import notif_tag
    from kvlc.runtime.channel.notifs import MAX_BATCH_NOTIF_BYTES, NotifBatch, batch_fields, batches, encode_notif_batch

    data = encode_notif_batch(["a", 'b"c', "d|e"], 7, T)
    assert data == b'{"v":3,"done":["a","b\\"c","d|e"],"rank":7,"tag":"' + T.encode() + b'"}'
    n = decode_notif(data)
    assert isinstance(n, NotifBatch) and n.done == ["a", 'b"c', "d|e"] and n.rank == 7
    # joined ids would make ["a|b", "c"] and ["a", "b|c"] sign alike; the JSON list does not
    assert notif_tag(b"k", *batch_fields(["a|b", "c"], 0)) != notif_tag(b"k", *batch_fields(["a", "b|c"], 0))
    # nor can a single notification's fields ever equal a batch's
    assert batch_fields(["r"], 0)[2].startswith("[")
    ids = [f"{i:03d}" + "\\" * 60 for i in range(300)]  # each id doubles as JSON
    chunks = batches(ids)
    assert [i for c in chunks for i in c] == ids
    assert all(MAX_NOTIF_BYTES < len(encode_notif_batch(c, 65535, T)) <= MAX_BATCH_NOTIF_BYTES for c in chunks)


@pytest.mark.parametrize(
    "data",
    [
        b'{"v":3,"done":[],"rank":0,"tag":"000000000000000000000000"}',
        b'{"v":3,"done":["a","a"],"rank":0,"tag":"000000000000000000000000"}',
        b'{"v":3,"done":"a","rank":0,"tag":"000000000000000000000000"}',
        b'{"v":3,"done":["a",1],"rank":0,"tag":"000000000000000000000000"}',
        b'{"v":3,"done":["has space"],"rank":0,"tag":"000000000000000000000000"}',
        b'{"v":3,"done":["a"],"rank":0,"status":"done","tag":"000000000000000000000000"}',
        b'{"v":3,"done":["a"],"rank":0}',
        b'{"v":1,"done":["a"],"rank":0,"tag":"000000000000000000000000"}',
        b'{"v":3,"done":["a"],"rank":-1,"tag":"000000000000000000000000"}',
        b'{"v":3,"done":[' + b",".join(b'"%d"' % i for i in range(257)) + b'],"rank":0,"tag":"000000000000000000000000"}',
        b'{"v":3,"done":["' + b"r" * 9000 + b'"],"rank":0,"tag":"000000000000000000000000"}',
    ],
)
def test_bad_batch_notifications_are_refused(data):
    """Empty, repeated, mistyped, over-long or untagged batches raise HandshakeError."""
    with pytest.raises(HandshakeError, match="notification refused"):
        decode_notif(data)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not json",
        b"[1]",
        b'{"v":1,"req":"r","rank":0,"status":"done","tag":"000000000000000000000000"}',
        b'{"v":3,"req":"r","rank":0,"status":"ok","tag":"000000000000000000000000"}',
        b'{"v":3,"req":"r","rank":"0","status":"done","tag":"000000000000000000000000"}',
        b'{"v":3,"req":"r","rank":0,"status":"done","tag":"000000000000000000000000","x":1}',
        b'{"v":3,"req":"has space","rank":0,"status":"done","tag":"000000000000000000000000"}',
        b'{"v":3,"req":"r","rank":0,"status":"done"}',
        b'{"v":3,"req":"r","rank":0,"status":"done","tag":"zz"}',
        b"x" * (MAX_NOTIF_BYTES + 1),
        b"\xff\xfe",
    ],
)
def test_bad_notifications_are_refused(data):
    """Anything but a valid notification raises HandshakeError."""
    with pytest.raises(HandshakeError):
        decode_notif(data)


def test_record_type_is_frozen(record):
    """Records are immutable values."""
    with pytest.raises(Exception):
        record.rank = 0
    assert isinstance(record, Record)
