"""Completion tracking: what :meth:`KvAgent.poll` reports, and when a request's blocks are safe.

Consumer side, one :class:`Incoming` per request whose bytes land here and that a remote moves
(pull via push; push with :meth:`KvAgent.expect`). It is bound to one remote engine: the one it
was asked of (pull via push: each rank's session too), the producer engine ``expect()`` named, or
else the first engine that answers; and each rank to the session of its first answer. Answers
and staged chunks from any other engine or session are dropped (:mod:`kvlc.runtime.replies`).
Each remote rank ends with a terminal
answer (a ``done``/``failed`` notification, a refusal, a cancel answer, or the loss of its
session, after which it cannot write here any more). The request is

* **finished** when every expected rank answered ``done`` before the deadline;
* **held** at its deadline while some rank has not answered: failed, but a byte may still land,
  so its blocks must not be reused (cancels go out);
* **failed** once every rank answered and something went wrong; a held request moves here
  when the last answer arrives. A request never goes from failed or held to finished.

Producer side, one :class:`Tally` per (remote engine, request) for requests that consumers
read (pull) or asked for (pull via push): **freeable** once every expected consumer rank
answered, or when the lease runs out (the consumer died, timed out, or never asked:
:meth:`KvAgent.offer` starts a lease for a request no consumer has named yet).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvlc.runtime.kinds import Event, Status

FORGET = 1 << 16  # how many ended requests to remember (late messages are ignored, cancels answered)


@dataclass(frozen=True)
class Completions:
    """What :meth:`KvAgent.poll` found since the previous call.

    ``finished``: completed requests. ``failed``: request id → reason, terminal, blocks safe to
    reuse. ``held``: request id → reason, failed but bytes may still land: do not reuse the blocks
    until the id shows up in ``failed``. ``freeable``: producer side, requests whose source blocks
    no consumer will read any more.
    """

    finished: tuple[str, ...] = ()
    failed: Mapping[str, str] = field(default_factory=dict)
    held: Mapping[str, str] = field(default_factory=dict)
    freeable: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.finished or self.failed or self.held or self.freeable)


@dataclass(frozen=True)
class Severing:
    """A session of a producer on another host that ended while it could still write here over TCP."""

    session: Any
    host: str                  # the producer's host, whose TCP sockets this process shut
    sockets: frozenset[str]    # those sockets (``socket:[inode]``): none may be left before its rank answers
    why: str                   # why the session ended


@dataclass(eq=False)
class Incoming:
    """A request whose bytes remote ranks move into this agent (see the module docstring)."""

    req: str
    deadline: float | None
    engine: object = None                                  # RemoteEngine once known
    answers: dict[int, tuple[Status, str]] = field(default_factory=dict)
    cancel_wait: dict[str, object] = field(default_factory=dict)  # conn id → Session asked to cancel
    via: dict[int, tuple] = field(default_factory=dict)  # pull via push: rank → (Session, client)
    producer: str | None = None  # push: the engine id expect() named; no other engine answers or writes
    sessions: dict[int, str] = field(default_factory=dict)  # push: rank → conn id of its first answer
    asked: bool = True  # False: its first answer came before expect() (see settle)
    held: bool = False
    why_held: str = ""
    # conn id → the session that ended while it could still write here over TCP; its rank is answered once
    # none of the sockets shut for it is left (kvlc.runtime.nixl.sever)
    severing: dict[str, Severing] = field(default_factory=dict)

    @property
    def expected(self) -> frozenset[int] | None:
        return None if self.engine is None else self.engine.expected

    def answer(self, rank: int, status: Status, why: str = "") -> None:
        self.answers.setdefault(rank, (Status(status), why))

    def missing(self) -> list[int]:
        exp = self.expected
        return [] if exp is None else sorted(exp - set(self.answers))

    @property
    def complete(self) -> bool:
        if self.engine is None:  # push, no rank heard of yet: complete once every cancel was answered
            return self.held and not self.cancel_wait and not self.severing
        return not self.missing() and not self.cancel_wait and not self.severing

    def reason(self) -> str:
        """Why it failed: why it was held, then the first rank's answer that was not done."""
        for rank, (status, why) in sorted(self.answers.items()):
            if status is not Status.DONE:
                answer = f"rank {rank}: {status.value}" + (f": {why}" if why else "")
                return f"{self.why_held}; then {answer}" if self.why_held else answer
        return self.why_held


@dataclass(eq=False)
class Tally:
    """Producer side: which consumer ranks of one engine are done with one request."""

    req: str
    engine: object
    lease_until: float
    seen: dict[int, tuple[Status, str]] = field(default_factory=dict)

    def add(self, rank: int, status: Status, why: str = "") -> None:
        self.seen.setdefault(rank, (Status(status), why))

    @property
    def complete(self) -> bool:
        return self.engine.expected <= set(self.seen)

    def reason(self) -> str:
        for rank, (status, why) in sorted(self.seen.items()):
            if status is not Status.DONE:
                return f"consumer rank {rank}: {status.value}" + (f": {why}" if why else "")
        return ""


class Events:
    """The queue poll() drains, plus the memory of ended requests (bounded)."""

    def __init__(self):
        self._queue: list[tuple[Event, str, str]] = []
        self.ended: OrderedDict = OrderedDict()  # key → Status

    def emit(self, event: Event, req: str, why: str = "") -> None:
        self._queue.append((event, req, why))

    def end(self, key, status: Status) -> None:
        self.ended[key] = status
        self.ended.move_to_end(key)
        while len(self.ended) > FORGET:
            self.ended.popitem(last=False)

    def retract(self, req: str) -> None:
        """Forget the events of ``req`` that poll() has not reported yet."""
        self._queue[:] = [e for e in self._queue if e[1] != req]

    def drain(self) -> Completions:
        finished, failed, held, freeable = [], {}, {}, []
        for event, req, why in self._queue:
            if event is Event.FINISHED:
                finished.append(req)
            elif event is Event.FAILED:
                failed[req] = why
            elif event is Event.HELD:
                held[req] = why
            else:
                freeable.append(req)
        self._queue.clear()
        return Completions(tuple(finished), failed, held, tuple(freeable))


def settle(inc: Incoming, events: Events) -> bool:
    """Report ``inc`` if it is complete; True when it ended (the caller forgets it)."""
    if not inc.complete:
        return False
    why = inc.reason()
    if why or inc.held:
        events.emit(Event.FAILED, inc.req, why or "failed")
        events.end(inc.req, Status.FAILED)
    else:
        events.emit(Event.FINISHED, inc.req)
        events.end(inc.req, Status.DONE)
    if not inc.asked and inc.engine is not None:  # ended before expect(): by which engine (KvAgent.expect)
        events.end(("unasked", inc.req), inc.engine.engine_id)
    return True


def hold(inc: Incoming, events: Events, why: str) -> None:
    """The deadline passed with answers missing: report the request held (once)."""
    if not inc.held:
        inc.held, inc.why_held = True, why
        events.emit(Event.HELD, inc.req, why)
