"""NIXL notifications: a request's end on one side, told to the other side's rank.

Notifications (NIXL ``send_notif``) are compact JSON, at most
:data:`MAX_NOTIF_BYTES` bytes::

    {"v":3,"req":"<request id>","rank":<sender rank>,"status":"done","tag":"<24 hex>"}
    {"v":3,"req":"<request id>","rank":<sender rank>,"status":"failed","why":"<reason>","tag":"<24 hex>"}

``tag`` is an HMAC over request, rank and status with the key of the side-channel
connection the two agents share (:func:`kvlc.runtime.channel.auth.notif_tag`): a notification
from an agent that only claims a peer's name is dropped.

A sender posts exactly one per request to every peer rank it exchanged bytes
with, after all parts of the request are terminal: ``done`` if every part
succeeded, ``failed`` otherwise (never ``done`` for a failed request). Requests that end
``done`` in the same progress turn and go to the same session share one notification
(:class:`NotifBatch`, at most :data:`MAX_BATCH_NOTIF_BYTES` bytes)::

    {"v":3,"done":["<request id>",...],"rank":<sender rank>,"tag":"<24 hex>"}

whose tag is one HMAC over the marker ``done*``, the rank and the compact JSON of the
list (so no entry can be split, joined, added or dropped without the key).

Decoding refuses anything else with a :class:`~kvlc.runtime.errors.HandshakeError` that says why
(oversize, not JSON, wrong version or types, unknown or missing keys, a batch naming a request twice).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, ValidationError

from kvlc.runtime.channel.auth import notif_tag
from kvlc.runtime.errors import HandshakeError, NixlError
from kvlc.runtime.channel.frames import WIRE_VERSION, check_version, explain
from kvlc.runtime.kinds import Status
from kvlc.runtime.channel.wire import Rank, RequestId, _Strict

MAX_NOTIF_BYTES = 512
MAX_BATCH_NOTIF_BYTES = 8192  # a NotifBatch: several requests' done in one notification
MAX_BATCH = 256  # requests in one NotifBatch
_COMPACT = json.JSONEncoder(separators=(",", ":"))  # json.dumps(..., separators=(",", ":")) without a new encoder


class Notif(_Strict):
    """One notification: request ``req`` is terminal on the sender's (rank ``rank``) side."""

    v: Literal[3] = WIRE_VERSION
    req: RequestId
    rank: Rank
    status: Literal["done", "failed"]
    why: Annotated[str, Field(max_length=200)] = ""
    tag: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{24}$")]


class NotifBatch(_Strict):
    """Several requests ended ``done`` on the sender's (rank ``rank``) side, in one notification."""

    v: Literal[3] = WIRE_VERSION
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


def encode_notif(req: str, rank: int, status: str, tag: str, why: str = "") -> bytes:
    """The compact JSON notification (``tag``: :func:`kvlc.runtime.channel.auth.notif_tag` of req, rank, status).

    >>> encode_notif("r1", 0, "done", "0" * 24)
    b'{"v":3,"req":"r1","rank":0,"status":"done","why":"","tag":"000000000000000000000000"}'
    """
    why, status = why[:200], str(status)
    if _plain(req, rank, status, tag, why):  # fields a Notif takes as they are: no model to build (the hot path)
        data = _COMPACT.encode({"v": WIRE_VERSION, "req": req, "rank": rank, "status": status, "why": why,
                                "tag": tag}).encode()
        if len(data) <= MAX_NOTIF_BYTES:
            return data
    return _encode_checked(req, rank, status, tag, why)


_PLAIN_REQ = re.compile(r"[\x21-\x7e]{1,128}")  # RequestId
_PLAIN_TAG = re.compile(r"[0-9a-f]{24}")


def _plain(req, rank, status: str, tag, why) -> bool:
    """Whether :class:`Notif` would take these fields unchanged (exact types, every constraint met)."""
    return (type(req) is str and _PLAIN_REQ.fullmatch(req) is not None and type(rank) is int
            and 0 <= rank < 1 << 16 and status in ("done", "failed") and type(tag) is str
            and _PLAIN_TAG.fullmatch(tag) is not None and type(why) is str and len(why) <= 200)


def _encode_checked(req, rank, status: str, tag, why: str) -> bytes:
    """:func:`encode_notif` through the :class:`Notif` model (what it refuses raises; ``why`` halved until
    the notification fits): the reference the hot path equals."""
    while True:
        n = Notif(req=req, rank=rank, status=status, why=why, tag=tag)
        data = _COMPACT.encode({"v": n.v, "req": n.req, "rank": n.rank, "status": n.status, "why": n.why,
                                "tag": n.tag}).encode()  # the fields of n.model_dump(), in order
        if len(data) <= MAX_NOTIF_BYTES:
            return data
        why = why[: len(why) // 2]


def encode_notif_batch(reqs, rank: int, tag: str) -> bytes:
    """One :class:`NotifBatch` (``tag``: :func:`~kvlc.runtime.channel.auth.notif_tag` of :func:`batch_fields`).
    The caller keeps it within :data:`MAX_BATCH` requests and :data:`MAX_BATCH_NOTIF_BYTES`
    (:func:`batches` splits a list so).

    >>> encode_notif_batch(["r1", "r2"], 0, "0" * 24)
    b'{"v":3,"done":["r1","r2"],"rank":0,"tag":"000000000000000000000000"}'
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


# ----------------------------------------------------------------------------- sending
@dataclass(frozen=True)
class Target:
    """Where a notification goes: the peer's NIXL agent name and the session's notification key."""

    agent: str
    key: bytes

    def notif(self, req: str, rank: int, status: Status, why: str = "") -> bytes:
        return encode_notif(req, rank, status, notif_tag(self.key, req, str(rank), str(status)), why)

    def done(self, reqs: list[str], rank: int) -> bytes:
        """``done`` for one request, or one batch notification for several."""
        if len(reqs) == 1:
            return self.notif(reqs[0], rank, Status.DONE)
        return encode_notif_batch(reqs, rank, notif_tag(self.key, *batch_fields(reqs, rank)))


def agents_of(notify: Mapping[int, Target]) -> dict[int, str]:
    """Remote rank → the NIXL agent name its notifications go to."""
    return {r: t.agent for r, t in notify.items()}


def _by_target(outs: list) -> dict[Target, list[tuple[Any, int]]]:
    """Target → (request, remote rank) pairs, in the order the requests came."""
    groups: dict[Target, list[tuple[Any, int]]] = {}
    for out in outs:
        for r, target in out.notify.items():
            groups.setdefault(target, []).append((out, r))
    return groups


def _done_bytes(target: Target, share: list, chunk: list[str], rank: int) -> bytes:
    """The ``done`` of ``chunk`` to ``target``: a request alone in it sends what its ``ready`` holds for the target
    (built while its bytes moved), else it is built now."""
    ready = getattr(share[0][0], "ready", None) if len(share) == 1 else None
    got = ready.get(target) if ready else None
    return got if got is not None else target.done(chunk, rank)


def tell_done(agent: Any, rank: int, outs: list) -> None:
    """Send ``done`` for every request in ``outs`` (each with ``req``, ``notify``: remote rank →
    :class:`Target`, ``reason``, ``notified``) from this agent's rank ``rank``: one notification
    per target for all of them, split to fit (:func:`batches`), through ``agent.send_done`` (every byte
    they speak of landed: the agent may take a path of its own for them, :mod:`kvlc.runtime.nixl.notes`).
    Sets each request's ``notified`` (the ranks told) and, where a send failed, its ``reason``; a request
    with a reason is not told ``done`` by the targets after it. A request alone in its notification sends the
    bytes its ``ready`` holds for that target where it has them (built while its bytes moved: the same bytes
    :meth:`Target.done` builds)."""
    told: dict[int, list[int]] = {id(o): [] for o in outs}
    for target, members in _by_target(outs).items():
        members = [(o, r) for o, r in members if not o.reason]
        at = 0
        ids = [o.req for o, _ in members]
        for chunk in (batches(ids) if len(ids) > 1 else [ids] if ids else []):  # (one id: one notification)
            share, at = members[at:at + len(chunk)], at + len(chunk)
            try:
                agent.send_done(target.agent, _done_bytes(target, share, chunk, rank))
            except NixlError as exc:
                for o, r in share:
                    o.reason = f"all parts done, but notifying rank {r} failed: {exc}"
                continue
            for o, r in share:
                told[id(o)].append(r)
    for out in outs:
        out.notified = tuple(told[id(out)])
