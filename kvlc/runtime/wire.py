"""Wire formats: the handshake record, side-channel messages and notifications. Never pickle.

Side-channel frames are msgpack maps validated by strict, frozen pydantic models
(``extra="forbid"``; no coercion: an int is an int, bytes are bytes). The field
``t`` says which message a frame is:

==========  ===================================================================
``fetch``   ask a server for its :class:`Record`
``record``  the :class:`Record`: version, agent name, NIXL agent metadata, plan JSON
            and its digest, rank, every storage's base address, size, memory type, device
``hello``   :class:`Introduce`: a connecting agent's record, engine id, epoch, what it will do,
            and (pull via push, staging on) the :class:`Inbox` it registered for the receiver
``pull``    :class:`PullRequest`: pull-via-push, a consumer rank asks a producer rank to WRITE
``cancel``  :class:`Cancel`: stop a request; the answer says whether bytes can still move
``reply``   :class:`Reply`: ok, or the error text; a status for a cancel; the :class:`Inbox`
            a push consumer registered for the introducing producer (staging on)
==========  ===================================================================

Every frame travels inside an authenticated connection (:mod:`kvlc.runtime.auth`); who
sent a ``pull`` or ``cancel`` is the session introduced on that connection, never a name
inside the frame.

Notifications (NIXL ``send_notif``) are compact JSON, at most
:data:`MAX_NOTIF_BYTES` bytes::

    {"v":1,"req":"<request id>","rank":<sender rank>,"status":"done","tag":"<24 hex>"}
    {"v":1,"req":"<request id>","rank":<sender rank>,"status":"failed","why":"<reason>","tag":"<24 hex>"}

``tag`` is an HMAC over request, rank and status with the key of the side-channel
connection the two agents share (:func:`kvlc.runtime.auth.notif_tag`): a notification
from an agent that only claims a peer's name is dropped.

A sender posts exactly one per request to every peer rank it exchanged bytes
with, after all parts of the request are terminal: ``done`` if every part
succeeded, ``failed`` otherwise (never ``done`` for a failed request). Requests that end
``done`` in the same progress turn and go to the same session share one notification
(:class:`NotifBatch`, at most :data:`MAX_BATCH_NOTIF_BYTES` bytes)::

    {"v":1,"done":["<request id>",...],"rank":<sender rank>,"tag":"<24 hex>"}

whose tag is one HMAC over the marker ``done*``, the rank and the compact JSON of the
list (so no entry can be split, joined, added or dropped without the key).

Decoding refuses, with a :class:`~kvlc.runtime.errors.HandshakeError` that says
why: oversize or truncated input, not msgpack / JSON, wrong version, wrong
types, unknown or missing keys, a digest that does not match the plan JSON, a
plan JSON that is not a kvlc plan, a rank outside the plan's TP size, storages
that do not match the plan's storages. The decoding steps all formats share (size
limit, msgpack, version, error text) live in :mod:`kvlc.runtime.frames`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Literal, Union

import msgpack
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StringConstraints,
    TypeAdapter,
    ValidationError,
)

from kvlc.compiler.plan import Plan
from kvlc.runtime.errors import HandshakeError
from kvlc.runtime.frames import WIRE_VERSION, check_version, explain, unpack

MAX_FRAME_BYTES = 8 << 20  # any side-channel frame
MAX_RECORD_BYTES = 4 << 20  # a handshake record
MAX_METADATA_BYTES = 1 << 20  # NIXL agent metadata inside a record
MAX_PLAN_BYTES = 2 << 20  # plan JSON inside a record
MAX_NOTIF_BYTES = 512
_COMPACT = json.JSONEncoder(separators=(",", ":"))  # json.dumps(..., separators=(",", ":")) without a new encoder
MAX_BATCH_NOTIF_BYTES = 8192  # a NotifBatch: several requests' done in one notification
MAX_BATCH = 256  # requests in one NotifBatch
MAX_BLOCK_IDS = 1 << 20  # per group, per side, in a pull request
MAX_ERROR_CHARS = 4096

AgentName = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:@\-]+$")]
RequestId = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[\x21-\x7e]+$")]
Name = Annotated[str, StringConstraints(min_length=1, max_length=256)]
Rank = Annotated[int, Field(ge=0, lt=1 << 16)]
U63 = Annotated[int, Field(ge=0, lt=1 << 63)]
BlockId = Annotated[int, Field(ge=0, lt=1 << 62)]
BlockIds = Annotated[
    dict[Name, Annotated[tuple[BlockId, ...], Field(max_length=MAX_BLOCK_IDS)]], Field(max_length=256)
]


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class StorageBase(_Strict):
    """Where one storage of the sender lives: base address, registered bytes, memory type, NIXL device."""

    name: Name
    addr: U63
    size: U63
    mem: Literal["DRAM", "VRAM"]
    device: Annotated[int, Field(ge=0, lt=1 << 16)]


class Record(_Strict):
    """A handshake record: everything a peer needs to pair with and reach one agent (one rank)."""

    t: Literal["record"] = "record"
    version: Literal[1] = WIRE_VERSION
    agent: AgentName
    nixl_md: Annotated[bytes, Field(min_length=1, max_length=MAX_METADATA_BYTES)]
    plan_json: Annotated[str, Field(min_length=2, max_length=MAX_PLAN_BYTES)]
    plan_digest: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
    rank: Rank
    engine_id: AgentName
    epoch: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{16,64}$")]
    storages: Annotated[tuple[StorageBase, ...], Field(max_length=1 << 16)]
    _plan: Plan | None = PrivateAttr(default=None)

    @property
    def plan(self) -> Plan:
        """The sender's plan (parsed and checked by :func:`check_record`)."""
        if self._plan is None:
            check_record(self)
        return self._plan

    def bases(self) -> dict[str, tuple[int, int]]:
        """Storage name → (address, device), as :meth:`TransferProgram.instantiate` takes them."""
        return {s.name: (s.addr, s.device) for s in self.storages}


class Inbox(_Strict):
    """Staging: a bounce buffer a receiver registered for one sender (:mod:`kvlc.runtime.staging_agent`)."""

    addr: U63
    slot_bytes: Annotated[int, Field(ge=4096, le=1 << 31)]
    stride: U63
    slots: Annotated[int, Field(ge=1, le=1024)]
    mem: Literal["DRAM", "VRAM"]
    device: Annotated[int, Field(ge=0, lt=1 << 16)]


class Fetch(_Strict):
    t: Literal["fetch"] = "fetch"
    version: Literal[1] = WIRE_VERSION


class Introduce(_Strict):
    """A connecting agent introduces itself: its record, its pairing direction and the mode.

    ``direction`` is the sender's: ``READ`` (it consumes) or ``WRITE`` (it produces).
    ``mode`` is ``direct`` (the sender moves bytes) or ``pull_via_push`` (the sender
    consumes; the receiver WRITEs on request).
    """

    t: Literal["hello"] = "hello"
    version: Literal[1] = WIRE_VERSION
    record: Record
    direction: Literal["READ", "WRITE"]
    mode: Literal["direct", "pull_via_push"]
    address: Annotated[str, StringConstraints(max_length=300)] = ""  # where the sender serves, if it does
    inbox: Inbox | None = None  # pull via push with staging: where the producer stages its WRITEs


class PullRequest(_Strict):
    """Pull via push: the consumer session of this connection asks a producer rank to WRITE a request.

    ``until`` is the consumer's deadline on the *producer's* clock (estimated at the handshake,
    less its uncertainty): the producer never posts a WRITE at or after it, however long the
    frame was queued. ``budget_s`` is what was left when the frame was sent (for messages).
    The request moves tokens ``[start_token, num_tokens)``; the producer checks it again.
    """

    t: Literal["pull"] = "pull"
    version: Literal[1] = WIRE_VERSION
    req: RequestId
    consumer_blocks: BlockIds
    producer_blocks: BlockIds
    num_tokens: Annotated[int, Field(ge=0, lt=1 << 40)]
    start_token: Annotated[int, Field(ge=0, lt=1 << 40)] = 0   # the request moves [start_token, num_tokens)
    until: float
    budget_s: Annotated[float, Field(ge=0, le=86400)]


class Cancel(_Strict):
    """Stop request ``req`` for the sender's session. Over the session's own connection no ``conn``
    is needed; a push consumer cancels over its own connection to the producer, naming the
    producer's connection ``conn`` with ``tag`` = the notification tag of ("cancel", req)."""

    t: Literal["cancel"] = "cancel"
    version: Literal[1] = WIRE_VERSION
    req: RequestId
    conn: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")] | None = None
    tag: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{24}$")] | None = None


class Reply(_Strict):
    t: Literal["reply"] = "reply"
    ok: bool
    error: Annotated[str, Field(max_length=MAX_ERROR_CHARS)] = ""
    status: Literal["", "done", "failed", "cancelled", "unknown", "pending"] = ""
    inbox: Inbox | None = None  # answer to a producer's hello, staging on: where it stages its WRITEs


Message = Annotated[Union[Fetch, Record, Introduce, PullRequest, Cancel, Reply], Field(discriminator="t")]
_MESSAGE = TypeAdapter(Message)


class Notif(_Strict):
    """One notification: request ``req`` is terminal on the sender's (rank ``rank``) side."""

    v: Literal[1] = 1
    req: RequestId
    rank: Rank
    status: Literal["done", "failed"]
    why: Annotated[str, Field(max_length=200)] = ""
    tag: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{24}$")]


class NotifBatch(_Strict):
    """Several requests ended ``done`` on the sender's (rank ``rank``) side, in one notification."""

    v: Literal[1] = 1
    done: Annotated[list[RequestId], Field(min_length=1, max_length=MAX_BATCH)]
    rank: Rank
    tag: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{24}$")]

    def fields(self) -> tuple[str, str, str]:
        """What its tag covers (:func:`batch_fields`)."""
        return batch_fields(self.done, self.rank)


def batch_fields(reqs, rank: int) -> tuple[str, str, str]:
    """The fields a :class:`NotifBatch`'s tag covers: a marker no single notification's status can
    be, the rank, and the compact JSON of the request list (unambiguous, unlike joined ids)."""
    return ("done*", str(rank), _COMPACT.encode(list(reqs)))


# ----------------------------------------------------------------------------- records
def check_record(rec: Record) -> Plan:
    """Facts a schema cannot check: digest, plan, rank and storages agree. Returns the plan."""
    if type(rec.version) is not int:
        raise HandshakeError(
            f"record of agent '{rec.agent}': wire version must be the integer {WIRE_VERSION}"
        )
    digest = hashlib.sha256(rec.plan_json.encode()).hexdigest()
    if digest != rec.plan_digest:
        raise HandshakeError(
            f"record of agent '{rec.agent}': plan digest {rec.plan_digest[:16]}... does not "
            f"match the sha256 of its plan JSON ({digest[:16]}...); refusing a tampered "
            "or truncated plan"
        )
    try:
        plan = Plan.from_json(rec.plan_json)
    except ValidationError as exc:
        raise HandshakeError(
            f"record of agent '{rec.agent}': plan JSON is not a kvlc plan: {explain(exc)}"
        ) from None
    if plan.digest != rec.plan_digest:
        raise HandshakeError(
            f"record of agent '{rec.agent}': plan JSON is not in canonical form "
            f"(its canonical digest is {plan.digest[:16]}...)"
        )
    tp = plan.parallel.tp_size
    if rec.rank >= tp:
        raise HandshakeError(
            f"record of agent '{rec.agent}': rank {rec.rank} outside plan '{plan.name}' (tp_size {tp})"
        )
    want = [s.name for s in plan.storages]
    got = [s.name for s in rec.storages]
    if got != want:
        raise HandshakeError(
            f"record of agent '{rec.agent}': storages {got[:4]}{'...' if len(got) > 4 else ''} "
            f"do not match plan storages {want[:4]}{'...' if len(want) > 4 else ''} "
            f"({len(got)} vs {len(want)})"
        )
    for s, p in zip(rec.storages, plan.storages):
        if s.addr + s.size >= 1 << 63:
            raise HandshakeError(
                f"record of agent '{rec.agent}': storage '{s.name}' ends at byte {s.addr + s.size}, "
                "past 2^63; refusing an address range no registration can have"
            )
        if s.mem != p.mem or s.size < p.size:
            raise HandshakeError(
                f"record of agent '{rec.agent}': storage '{s.name}' is {s.mem} with {s.size} "
                f"bytes; plan needs {p.mem} with {p.size} bytes"
            )
    rec._plan = plan  # private attributes stay assignable on frozen models
    return plan


def make_record(
    agent: str, nixl_md: bytes, plan: Plan, rank: int, storages, engine_id: str, epoch: str
) -> Record:
    """Build and check a record (``storages``: :class:`StorageBase` in plan order)."""
    rec = Record(
        agent=agent,
        nixl_md=nixl_md,
        plan_json=plan.to_json(),
        plan_digest=plan.digest,
        rank=rank,
        engine_id=engine_id,
        epoch=epoch,
        storages=tuple(storages),
    )
    check_record(rec)
    return rec


# ----------------------------------------------------------------------------- frames
def encode(msg: BaseModel) -> bytes:
    """msgpack bytes of a side-channel message.

    >>> decode(encode(Reply(ok=True))) == Reply(ok=True)
    True
    """
    data = msgpack.packb(msg.model_dump(mode="python"), use_bin_type=True)
    if len(data) > MAX_FRAME_BYTES:
        raise HandshakeError(f"{type(msg).__name__} is {len(data)} bytes; the limit is {MAX_FRAME_BYTES}")
    return data


def decode(
    data: bytes, limit: int = MAX_FRAME_BYTES
) -> Fetch | Record | Introduce | PullRequest | Cancel | Reply:
    """Validate a side-channel frame into its message model; records are fully checked."""
    obj = unpack(data, limit, "side-channel message")
    if obj.get("t") != "reply":
        check_version(obj, "version", f"'{str(obj.get('t'))[:20]}' message")
    try:
        msg = _MESSAGE.validate_python(obj, strict=True)
    except ValidationError as exc:
        kind = obj.get("t") if isinstance(obj.get("t"), str) else "?"
        raise HandshakeError(f"'{kind[:20]}' message refused: {explain(exc)}") from None
    if isinstance(msg, Record):
        check_record(msg)
    elif isinstance(msg, Introduce):
        check_record(msg.record)
    return msg


def decode_record(data: bytes) -> Record:
    """Decode and fully check a handshake record (size bound :data:`MAX_RECORD_BYTES`)."""
    obj = unpack(data, MAX_RECORD_BYTES, "handshake record")
    check_version(obj, "version", "handshake record")
    try:
        rec = Record.model_validate(obj, strict=True)
    except ValidationError as exc:
        raise HandshakeError(f"handshake record refused: {explain(exc)}") from None
    check_record(rec)
    return rec


# ----------------------------------------------------------------------------- notifications


def encode_notif(req: str, rank: int, status: str, tag: str, why: str = "") -> bytes:
    """The compact JSON notification (``tag``: :func:`kvlc.runtime.auth.notif_tag` of req, rank, status).

    >>> encode_notif("r1", 0, "done", "0" * 24)
    b'{"v":1,"req":"r1","rank":0,"status":"done","why":"","tag":"000000000000000000000000"}'
    """
    why = why[:200]
    while True:
        n = Notif(req=req, rank=rank, status=str(status), why=why, tag=tag)
        data = _COMPACT.encode({"v": n.v, "req": n.req, "rank": n.rank, "status": n.status, "why": n.why,
                                "tag": n.tag}).encode()  # the fields of n.model_dump(), in order
        if len(data) <= MAX_NOTIF_BYTES:
            return data
        why = why[: len(why) // 2]


def encode_notif_batch(reqs, rank: int, tag: str) -> bytes:
    """One :class:`NotifBatch` (``tag``: :func:`~kvlc.runtime.auth.notif_tag` of :func:`batch_fields`).
    The caller keeps it within :data:`MAX_BATCH` requests and :data:`MAX_BATCH_NOTIF_BYTES`
    (:func:`batches` splits a list so).

    >>> encode_notif_batch(["r1", "r2"], 0, "0" * 24)
    b'{"v":1,"done":["r1","r2"],"rank":0,"tag":"000000000000000000000000"}'
    """
    n = NotifBatch(done=list(reqs), rank=rank, tag=tag)
    data = _COMPACT.encode({"v": n.v, "done": list(n.done), "rank": n.rank, "tag": n.tag}).encode()
    if len(data) > MAX_BATCH_NOTIF_BYTES:
        raise HandshakeError(f"batch notification is {len(data)} bytes; the limit is {MAX_BATCH_NOTIF_BYTES}")
    return data


_BATCH_OVERHEAD = 96  # the JSON around the list, with the largest rank


def batches(reqs: list[str]) -> list[list[str]]:
    """Split request ids into lists that each fit one :class:`NotifBatch`, in order."""
    out: list[list[str]] = [[]]
    size = _BATCH_OVERHEAD
    for r in reqs:
        step = len(_COMPACT.encode(r)) + 1  # the id as JSON, and its comma
        if out[-1] and (size + step > MAX_BATCH_NOTIF_BYTES or len(out[-1]) >= MAX_BATCH):
            out.append([])
            size = _BATCH_OVERHEAD
        out[-1].append(r)
        size += step
    return [b for b in out if b]


def decode_notif(data: bytes) -> Notif | NotifBatch:
    """Validate a notification (one request's, or a :class:`NotifBatch`); raises
    :class:`HandshakeError` for anything else."""
    if not isinstance(data, (bytes, bytearray)) or len(data) > MAX_BATCH_NOTIF_BYTES:
        raise HandshakeError(f"notification refused: not bytes or over {MAX_BATCH_NOTIF_BYTES} bytes")
    try:
        obj = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise HandshakeError(f"notification refused: not JSON ({str(exc)[:60]})") from None
    if not isinstance(obj, dict):
        raise HandshakeError(f"notification refused: expected a JSON object, got {type(obj).__name__}")
    check_version(obj, "v", "notification")
    batch = "done" in obj
    if not batch and len(data) > MAX_NOTIF_BYTES:
        raise HandshakeError(f"notification refused: over {MAX_NOTIF_BYTES} bytes")
    try:
        n = (NotifBatch if batch else Notif).model_validate(obj, strict=True)
    except ValidationError as exc:
        raise HandshakeError(f"{'batch ' if batch else ''}notification refused: {explain(exc)}") from None
    if batch and len(set(n.done)) != len(n.done):
        raise HandshakeError("batch notification refused: a request id appears twice in 'done'")
    return n
