"""Decoding steps every kvlc wire format shares (see :mod:`kvlc.runtime.channel.wire`).

Bytes are unpacked as msgpack under a size limit, the wire version is checked, and
pydantic validation errors are turned into one short line that names each bad key.
Each refusal is a :class:`~kvlc.runtime.errors.HandshakeError` that says why.
"""

from __future__ import annotations

import msgpack
from pydantic import ValidationError

from kvlc.runtime.errors import HandshakeError

WIRE_VERSION = 3  # 2: a pull request carries its token range as start, stop; 3: records carry an
#   Ed25519 key, a hello its signature over the connection (kvlc.runtime.channel.identity)


def explain(exc: ValidationError, limit: int = 5) -> str:
    """The first ``limit`` errors of a validation, each as ``key: message (got value)``, on one line."""
    parts = []
    for e in exc.errors()[:limit]:
        loc = ".".join(str(x) for x in e["loc"]) or "<root>"
        got = e.get("input")
        shown = repr(got)
        if len(shown) > 60:
            shown = shown[:57] + "..."
        parts.append(f"{loc}: {e['msg']} (got {shown})")
    more = len(exc.errors()) - limit
    if more > 0:
        parts.append(f"... and {more} more")
    return "; ".join(parts)


def unpack(data: bytes, limit: int, what: str) -> dict:
    """The msgpack map in ``data`` (at most ``limit`` bytes); ``what`` names the input in errors."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise HandshakeError(f"{what}: expected bytes, got {type(data).__name__}")
    if len(data) > limit:
        raise HandshakeError(f"{what} refused: {len(data)} bytes is over the {limit}-byte limit")
    if not data:
        raise HandshakeError(f"{what} refused: empty")
    try:
        obj = msgpack.unpackb(bytes(data), raw=False, use_list=False, strict_map_key=True)
    except msgpack.ExtraData:
        raise HandshakeError(f"{what} refused: trailing bytes after the message") from None
    except (ValueError, msgpack.UnpackException, TypeError, RecursionError) as exc:
        reason = "truncated" if "Unpack failed" in str(exc) or "incomplete" in str(exc) else "not msgpack"
        raise HandshakeError(f"{what} refused: {reason} ({type(exc).__name__}: {str(exc)[:80]})") from None
    if not isinstance(obj, dict):
        raise HandshakeError(f"{what} refused: expected a msgpack map, got {type(obj).__name__}")
    return obj


def check_version(obj: dict, key: str, what: str) -> None:
    """Refuse ``obj`` unless its ``key`` holds this kvlc's :data:`WIRE_VERSION`."""
    v = obj.get(key, None)
    if type(v) is not int or v != WIRE_VERSION:
        raise HandshakeError(
            f"{what} refused: wire version {v!r:.20}; this kvlc speaks version {WIRE_VERSION} "
            "(upgrade the older side)"
        )
