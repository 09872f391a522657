"""Closed sets of the runtime as str enums: plain strings still compare equal (``ConnectionMode.DIRECT == "direct"``).

>>> Direction("READ") is Direction.READ, ConnectionMode.PULL_VIA_PUSH == "pull_via_push"
(True, True)
"""

from __future__ import annotations

import enum

from kvlc.errors import KvlcError, did_you_mean


class _Choice(str, enum.Enum):
    """A str enum whose :meth:`parse` names the valid values for a wrong one."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value, what: str):
        try:
            return cls(value)
        except ValueError:
            choices = [m.value for m in cls]
            raise KvlcError(f"{what} {value!r}: {did_you_mean(str(value), choices)}") from None


class Direction(_Choice):
    """This side's role in a pairing: ``READ`` consumes bytes, ``WRITE`` produces them."""

    READ = "READ"
    WRITE = "WRITE"

    @property
    def other(self) -> Direction:
        return Direction.WRITE if self is Direction.READ else Direction.READ


class ConnectionMode(_Choice):
    """How a connection moves requests: this side READs/WRITEs rows, prepared lists, or asks the producer."""

    DIRECT = "direct"
    PREPPED = "prepped"
    PULL_VIA_PUSH = "pull_via_push"


class Status(_Choice):
    """A side's terminal answer for one request (notifications and cancel replies)."""

    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"  # it was stopped (or refused before it started): nothing more will move
    UNKNOWN = "unknown"      # never heard of it; now refused for good (a tombstone)
    PENDING = "pending"      # still moving bytes; a terminal notification follows


class Event(_Choice):
    """What :meth:`KvAgent.poll` reports for a request."""

    FINISHED = "finished"
    FAILED = "failed"        # terminal; the request's blocks are safe to reuse
    HELD = "held"            # failed, but bytes may still land: do not reuse the blocks yet
    FREEABLE = "freeable"    # producer: the request's source blocks may be freed
