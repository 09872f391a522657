"""The staging protocol's notifications (NIXL ``send_notif``) and the bounce-buffer description.

Three messages, binary, little-endian, all starting with the magic ``KVST``::

    header  <4s B I I H H 12s>  magic, kind, seq, total, slot, len(req), tag   then req (ASCII)
    LANDED  + <Q I> nbytes, nrows      chunk ``seq`` of ``total`` is in bounce slot ``slot``:
                                       ``nbytes`` of data, then (8-aligned) ``nrows`` x (addr u64,
                                       len u64) destination ranges; scatter it, in order, to them
    FREE    (no payload)               the receiver scattered chunk ``seq`` (or dropped it):
                                       slot ``slot`` may be written again
    FAIL    + reason (UTF-8)           the sender gave the request up; scatter nothing more

``tag`` is the HMAC of every other field under the key of the session the two agents share
(:func:`kvlc.runtime.channel.auth.notif_tag`, as for the other notifications): :func:`verify` tells a
receiver whether a message comes from the holder of that key (the standalone pair uses the
empty key).

Decoding refuses, with a :class:`~kvlc.runtime.staging.copy.StagingError`, anything
malformed: wrong magic, unknown kind, truncated header, a payload that is not whole
sizes, a request id that is not printable ASCII. Messages without the magic are not
staging messages (:func:`is_staging`), so one notification stream can carry both.

The destination ranges travel in the same WRITE as the data (after it, in the slot), so a
notification stays a few dozen bytes: large ones take UCX's rendezvous path, which cost
milliseconds per chunk when they carried the ranges.

>>> m = decode(encode(Message(Kind.LANDED, "req-1", seq=0, total=2, slot=1, nbytes=4096, nrows=64), b"k"))
>>> m.slot, m.nbytes, m.nrows, verify(m, b"k"), verify(m, b"other key")
(1, 4096, 64, True, False)
"""

from __future__ import annotations

import enum
import hmac
import re
import struct
from dataclasses import dataclass

from kvlc.runtime.channel.auth import notif_tag
from kvlc.runtime.staging.copy import StagingError

MAGIC = b"KVST"
_HEAD = struct.Struct("<4sBIIHH12s")
_LANDED = struct.Struct("<QI")
MAX_ROWS_PER_CHUNK = 8192  # destination ranges per chunk (128 KiB behind the data in its slot)
ROWS_RESERVE = MAX_ROWS_PER_CHUNK * 16 + 4096  # per slot, behind the data: alignment + the ranges
MAX_REASON = 400
_REQ_OK = re.compile(rb"^[\x21-\x7e]{1,128}$")


class Kind(enum.IntEnum):
    """Staging message kinds."""

    LANDED = 1
    FREE = 2
    FAIL = 3


@dataclass(frozen=True)
class Message:
    """One staging notification; ``nbytes``/``nrows`` only for LANDED, ``reason`` only for FAIL."""

    kind: Kind
    req: str
    seq: int = 0
    total: int = 0
    slot: int = 0
    nbytes: int = 0
    nrows: int = 0
    reason: str = ""
    tag: bytes = b""        # set by decode: the HMAC the message came with


def _tag(m: Message, key: bytes) -> bytes:
    fields = ("staging", int(m.kind), m.req, m.seq, m.total, m.slot, m.nbytes, m.nrows, m.reason)
    return bytes.fromhex(notif_tag(key, *(str(f) for f in fields)))


def verify(m: Message, key: bytes) -> bool:
    """Whether ``m`` was sealed with ``key`` (the session key the two agents share)."""
    return hmac.compare_digest(m.tag, _tag(m, key))


def is_staging(raw: bytes) -> bool:
    """Whether a notification belongs to the staging protocol (starts with the magic)."""
    return bytes(raw[:4]) == MAGIC


def encode(m: Message, key: bytes = b"") -> bytes:
    """The message's bytes, sealed with ``key`` (see the module doc)."""
    if m.kind is Kind.FAIL:
        m = Message(m.kind, m.req, m.seq, m.total, m.slot,
                    reason=m.reason.encode("utf-8", "replace")[:MAX_REASON].decode("utf-8", "replace"))
    req = m.req.encode("ascii")
    head = _HEAD.pack(MAGIC, int(m.kind), m.seq, m.total, m.slot, len(req), _tag(m, key)) + req
    if m.kind is Kind.LANDED:
        return head + _LANDED.pack(m.nbytes, m.nrows)
    if m.kind is Kind.FAIL:
        return head + m.reason.encode("utf-8", "replace")
    return head


def decode(raw: bytes) -> Message:
    """Parse a staging notification; :class:`StagingError` says what is wrong with it."""
    raw = bytes(raw)
    if len(raw) < _HEAD.size:
        raise StagingError(f"staging message truncated: {len(raw)} bytes, the header alone is {_HEAD.size}")
    magic, kind, seq, total, slot, nreq, tag = _HEAD.unpack_from(raw)
    if magic != MAGIC:
        raise StagingError(f"not a staging message (starts with {magic!r}, expected {MAGIC!r})")
    try:
        kind = Kind(kind)
    except ValueError:
        raise StagingError(f"staging message of unknown kind {kind} (known: 1 LANDED, 2 FREE, 3 FAIL)") from None
    req = raw[_HEAD.size:_HEAD.size + nreq]
    if len(req) != nreq or not _REQ_OK.match(req):
        raise StagingError("staging message: request id truncated or not 1-128 printable ASCII characters")
    body = raw[_HEAD.size + nreq:]
    if kind is Kind.LANDED:
        if len(body) != _LANDED.size:
            raise StagingError(f"LANDED message: {len(body)} payload bytes, expected {_LANDED.size}")
        nbytes, nrows = _LANDED.unpack(body)
        if not 0 < nrows <= MAX_ROWS_PER_CHUNK or nbytes < nrows:
            raise StagingError(f"LANDED message: {nrows} ranges of {nbytes} bytes (1..{MAX_ROWS_PER_CHUNK} "
                               f"ranges of at least a byte each)")
        if seq >= total:
            raise StagingError(f"LANDED message: chunk {seq} of {total}")
        return Message(kind, req.decode(), seq, total, slot, nbytes, nrows, tag=tag)
    if kind is Kind.FAIL:
        return Message(kind, req.decode(), seq, total, slot, reason=body.decode("utf-8", "replace"), tag=tag)
    if body:
        raise StagingError(f"FREE message with {len(body)} unexpected payload bytes")
    return Message(kind, req.decode(), seq, total, slot, tag=tag)


@dataclass(frozen=True)
class BounceInfo:
    """Where a receiver's bounce buffer for one sender lies: what the sender WRITEs chunks into."""

    agent: str        # the receiver's NIXL agent name
    addr: int
    slot_bytes: int   # data per slot
    stride: int       # from one slot to the next: data, then the chunk's ranges
    slots: int
    mem: str          # "DRAM" | "VRAM"
    device: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict) -> BounceInfo:
        """Validate a peer's description (types, ranges) before trusting it."""
        want = {"agent": str, "addr": int, "slot_bytes": int, "stride": int, "slots": int, "mem": str,
                "device": int}
        if not isinstance(d, dict) or set(d) != set(want):
            raise StagingError(f"bounce description: expected keys {sorted(want)}, got "
                               f"{sorted(d) if isinstance(d, dict) else type(d).__name__}")
        for k, t in want.items():
            if not isinstance(d[k], t) or isinstance(d[k], bool):
                raise StagingError(f"bounce description: '{k}' must be {t.__name__}, got {d[k]!r:.40}")
        if d["mem"] not in ("DRAM", "VRAM") or d["slots"] < 1 or d["slots"] > 1 << 15 or d["slot_bytes"] < 1:
            raise StagingError(f"bounce description: mem DRAM|VRAM, 1..32768 slots and a positive slot size; "
                               f"got {d['mem']!r}, {d['slots']} slots of {d['slot_bytes']} bytes")
        if d["stride"] < d["slot_bytes"] + ROWS_RESERVE:
            raise StagingError(f"bounce description: stride {d['stride']} leaves no room for the ranges "
                               f"(need slot_bytes + {ROWS_RESERVE})")
        return cls(**d)

    def slot_addr(self, slot: int) -> int:
        return self.addr + slot * self.stride
