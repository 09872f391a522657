"""Wire formats: the handshake record, side-channel messages and notifications. Never pickle.

Side-channel frames are msgpack maps validated by strict, frozen pydantic models
(``extra="forbid"``; no coercion: an int is an int, bytes are bytes). The field
``t`` says which message a frame is:

==========  ===================================================================
``fetch``   ask a server for its :class:`Record`
``record``  the :class:`Record`: version, agent name, NIXL agent metadata, plan JSON
            and its digest, rank, every storage's base address, size, memory type, device,
            the Ed25519 public key of the agent's epoch
``hello``   :class:`Introduce`: a connecting agent's record, engine id, epoch, what it will do,
            (pull via push, staging on) the :class:`Inbox` it registered for the receiver, and
            the record key's signature over this connection (:mod:`kvlc.runtime.channel.identity`)
``pull``    :class:`PullRequest`: pull-via-push, a consumer rank asks a producer rank to WRITE
``cancel``  :class:`Cancel`: stop a request; the answer says whether bytes can still move
``reply``   :class:`Reply`: ok, or the error text; a status for a cancel; the :class:`Inbox`
            a push consumer registered for the introducing producer (staging on); to a hello,
            the server's record key's signature over this connection (:meth:`Reply.welcomed`)
==========  ===================================================================

Every frame travels inside an authenticated connection (:mod:`kvlc.runtime.channel.auth`); who
sent a ``pull`` or ``cancel`` is the session introduced on that connection, never a name
inside the frame.

Notifications (NIXL ``send_notif``) are compact JSON: :mod:`kvlc.runtime.channel.notifs`.

Decoding refuses, with a :class:`~kvlc.runtime.errors.HandshakeError` that says
why: oversize or truncated input, not msgpack / JSON, wrong version, wrong
types, unknown or missing keys, a digest that does not match the plan JSON, a
plan JSON that is not a kvlc plan, a rank outside the plan's TP size, storages
that do not match the plan's storages. The decoding steps all formats share (size
limit, msgpack, version, error text) live in :mod:`kvlc.runtime.channel.frames`.
"""

from __future__ import annotations

import hashlib
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

from kvlc.compiler.plan.model import Plan
from kvlc.runtime.errors import HandshakeError
from kvlc.runtime.channel.frames import WIRE_VERSION, check_version, explain, unpack
from kvlc.runtime.channel.identity import PUBLIC_BYTES, SIGNATURE_BYTES, introduction, verify

MAX_FRAME_BYTES = 8 << 20  # any side-channel frame
MAX_RECORD_BYTES = 4 << 20  # a handshake record
MAX_METADATA_BYTES = 1 << 20  # NIXL agent metadata inside a record
MAX_PLAN_BYTES = 2 << 20  # plan JSON inside a record
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
    version: Literal[3] = WIRE_VERSION
    agent: AgentName
    nixl_md: Annotated[bytes, Field(min_length=1, max_length=MAX_METADATA_BYTES)]
    plan_json: Annotated[str, Field(min_length=2, max_length=MAX_PLAN_BYTES)]
    plan_digest: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
    rank: Rank
    engine_id: AgentName
    epoch: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{16,64}$")]
    storages: Annotated[tuple[StorageBase, ...], Field(max_length=1 << 16)]
    key: Annotated[bytes, Field(min_length=PUBLIC_BYTES, max_length=PUBLIC_BYTES)]  # Ed25519, this epoch's
    # when this epoch started (the sender's time.time()): its memory holds nothing produced before (0: unknown)
    started_at: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    # the metadata of its notes agent (kvlc.runtime.nixl.notes), where `done` notifications to it go and come from
    notes_md: Annotated[bytes, Field(min_length=1, max_length=MAX_METADATA_BYTES)] | None = None
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
    """Staging: a bounce buffer a receiver registered for one sender (:mod:`kvlc.runtime.staging.agent`)."""

    addr: U63
    slot_bytes: Annotated[int, Field(ge=4096, le=1 << 31)]
    stride: U63
    slots: Annotated[int, Field(ge=1, le=1024)]
    mem: Literal["DRAM", "VRAM"]
    device: Annotated[int, Field(ge=0, lt=1 << 16)]


class SharedStorage(_Strict):
    """One storage a same-host peer may map (:mod:`kvlc.runtime.ipc`): where it lives in the sender's
    address space (``addr``, ``size``), and how to open it: a CUDA IPC handle of the allocation
    holding it (VRAM) or the sender's shared-memory file descriptor (DRAM), ``offset`` bytes in."""

    name: Name
    addr: U63
    size: U63
    mem: Literal["DRAM", "VRAM"]
    device: Annotated[int, Field(ge=0, lt=1 << 16)]
    handle: Annotated[bytes, Field(max_length=128)] = b""  # VRAM: the CUDA IPC memory handle (64 bytes)
    fd: Annotated[int, Field(ge=0, lt=1 << 31)] = 0  # DRAM: the sender's memfd, opened at /proc/<pid>/fd/<fd>
    offset: U63 = 0  # where ``addr`` lies in the allocation (VRAM) or the file (DRAM)
    gpu: Annotated[str, StringConstraints(max_length=64)] = ""  # VRAM: the GPU's UUID


class SharedBell(_Strict):
    """A doorbell (:mod:`kvlc.runtime.ipc.bell`): a ring in the sender's shared-memory file ``fd`` (opened at
    /proc/<pid>/fd/<fd>) of ``size`` bytes, made for the one peer it is offered to, which writes its
    notifications there instead of sending them through NIXL."""

    fd: Annotated[int, Field(ge=0, lt=1 << 31)]
    size: Annotated[int, Field(ge=256, le=1 << 26)]


class Shared(_Strict):
    """Storages a peer on the same host may map into its own address space and copy to or from
    directly: handed over an authenticated connection only, after its hello, and mapped only by
    an agent on the same ``host`` (boot and PID namespace) as the sender ``pid``; and a doorbell
    of the session's own, where the sender has one (``bell``)."""

    host: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    pid: Annotated[int, Field(ge=1, lt=1 << 31)]
    storages: Annotated[tuple[SharedStorage, ...], Field(max_length=1 << 16)]
    bell: SharedBell | None = None


class Fetch(_Strict):
    t: Literal["fetch"] = "fetch"
    version: Literal[3] = WIRE_VERSION


class Introduce(_Strict):
    """A connecting agent introduces itself: its record, its pairing direction and the mode, and
    ``proof``, its record key's signature over this connection (:meth:`proven`).

    ``direction`` is the sender's: ``READ`` (it consumes) or ``WRITE`` (it produces).
    ``mode`` is ``direct`` (the sender moves bytes) or ``pull_via_push`` (the sender
    consumes; the receiver WRITEs on request).
    """

    t: Literal["hello"] = "hello"
    version: Literal[3] = WIRE_VERSION
    record: Record
    direction: Literal["READ", "WRITE"]
    mode: Literal["direct", "pull_via_push"]
    address: Annotated[str, StringConstraints(max_length=300)] = ""  # where the sender serves, if it does
    inbox: Inbox | None = None  # pull via push with staging: where the producer stages its WRITEs
    host: Annotated[str, StringConstraints(max_length=128)] = ""  # same-host copies on: the sender's host key
    shared: Shared | None = None  # pull via push, same host: the consumer storages the producer may map
    proof: Annotated[bytes, Field(min_length=SIGNATURE_BYTES, max_length=SIGNATURE_BYTES)]  # see proven()

    def proven(self, binding: bytes, server_agent: str) -> bool:
        """Whether the record's own key signed this hello for this connection (``binding``) and this
        server (:func:`kvlc.runtime.channel.identity.introduction`): a record replayed on another
        connection, or to another server, is not."""
        msg = introduction(binding, server_agent, self.record.agent, self.direction, self.mode)
        return verify(self.record.key, self.proof, msg)


class PullRequest(_Strict):
    """Pull via push: the consumer session of this connection asks a producer rank to WRITE a request.

    ``until`` is the consumer's deadline on the *producer's* clock (estimated at the handshake,
    less its uncertainty): the producer never posts a WRITE at or after it, however long the
    frame was queued. ``budget_s`` is what was left when the frame was sent (for messages).
    The request moves tokens ``[start, stop)``; the producer checks it again.
    """

    t: Literal["pull"] = "pull"
    version: Literal[3] = WIRE_VERSION
    req: RequestId
    consumer_blocks: BlockIds
    producer_blocks: BlockIds
    start: Annotated[int, Field(ge=0, lt=1 << 40)]
    stop: Annotated[int, Field(ge=0, lt=1 << 40)]
    until: Annotated[float, Field(allow_inf_nan=False)]
    budget_s: Annotated[float, Field(ge=0, le=86400)]


MAX_PULLS = 64  # pull requests one Pulls frame carries


class Pulls(_Strict):
    """Several :class:`PullRequest` of one session in one frame: the consumer had them queued together
    (one round trip instead of one each). The producer handles them in order, each as if it came
    alone (one refusal refuses only its own), and answers with one :class:`Replies`, in order."""

    t: Literal["pulls"] = "pulls"
    version: Literal[3] = WIRE_VERSION
    items: Annotated[tuple[PullRequest, ...], Field(min_length=2, max_length=MAX_PULLS)]


class Cancel(_Strict):
    """Stop request ``req`` for the sender's session. Over the session's own connection no ``conn``
    is needed; a push consumer cancels over its own connection to the producer, naming the
    producer's connection ``conn`` with ``tag`` = the notification tag of ("cancel", req)."""

    t: Literal["cancel"] = "cancel"
    version: Literal[3] = WIRE_VERSION
    req: RequestId
    conn: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")] | None = None
    tag: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{24}$")] | None = None


class Reply(_Strict):
    t: Literal["reply"] = "reply"
    ok: bool
    error: Annotated[str, Field(max_length=MAX_ERROR_CHARS)] = ""
    status: Literal["", "done", "failed", "cancelled", "unknown", "pending"] = ""
    inbox: Inbox | None = None  # answer to a producer's hello, staging on: where it stages its WRITEs
    shared: Shared | None = None  # answer to a same-host hello (direct modes): storages the sender may map
    proof: Annotated[bytes, Field(min_length=SIGNATURE_BYTES, max_length=SIGNATURE_BYTES)] | None = None  # welcomed()

    def welcomed(self, binding: bytes, server: Record, client_agent: str) -> bool:
        """Whether this answer to a hello is signed by ``server``'s record key for this connection and
        this client (a party serving another agent's record cannot sign it)."""
        msg = introduction(binding, client_agent, server.agent, "welcome", "")
        return self.proof is not None and verify(server.key, self.proof, msg)


class Replies(_Strict):
    """The answers to a :class:`Pulls`, one per request, in its order."""

    t: Literal["replies"] = "replies"
    items: Annotated[tuple[Reply, ...], Field(min_length=2, max_length=MAX_PULLS)]


Message = Annotated[Union[Fetch, Record, Introduce, PullRequest, Pulls, Cancel, Reply, Replies],
                    Field(discriminator="t")]
_MESSAGE = TypeAdapter(Message)


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
    n = plan.parallel.ranks  # tp_size x pcp_size
    if rec.rank >= n:
        raise HandshakeError(
            f"record of agent '{rec.agent}': rank {rec.rank} outside plan '{plan.name}' "
            f"({n} ranks: tp_size {plan.parallel.tp_size} x pcp_size {plan.parallel.pcp_size})"
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
    agent: str, nixl_md: bytes, plan: Plan, rank: int, storages, engine_id: str, epoch: str, key: bytes,
    started_at: float = 0.0, notes_md: bytes | None = None,
) -> Record:
    """Build and check a record (``storages``: :class:`StorageBase` in plan order; ``key``: the
    epoch's Ed25519 public key, :class:`~kvlc.runtime.channel.identity.Identity`; ``started_at``: when
    the epoch started, wall clock)."""
    rec = Record(
        agent=agent,
        nixl_md=nixl_md,
        plan_json=plan.to_json(),
        plan_digest=plan.digest,
        rank=rank,
        engine_id=engine_id,
        epoch=epoch,
        storages=tuple(storages),
        key=key,
        started_at=started_at,
        notes_md=notes_md,
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
) -> Fetch | Record | Introduce | PullRequest | Pulls | Cancel | Reply | Replies:
    """Validate a side-channel frame into its message model; records are fully checked."""
    obj = unpack(data, limit, "side-channel message")
    if obj.get("t") not in ("reply", "replies"):
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
