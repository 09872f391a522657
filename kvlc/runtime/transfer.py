"""Transfer execution: split a request into NIXL requests, barrier, notify, fail cleanly.

The runtime does no layout arithmetic: a request arrives as the parts that
:meth:`kvlc.compiler.pairing.pair.TransferProgram.instantiate` built (one per peer rank and pair of
memory types, row-aligned (N, 3) descriptors). :class:`Executor`

1. creates one NIXL request per non-empty part (rows through ``initialize``, or a
   :class:`PreparedPart`'s indices into lists prepared at connect through ``make_prepped``),
   none with a notification of its own; if creating one fails, none is kept or posted;
2. posts them; polls their states without blocking;
3. once every part is terminal, releases every handle; then, if every part is DONE, sends
   exactly one ``done`` notification to each involved remote rank (requests that end in the
   same :meth:`Executor.progress` and go to one session share one batch notification);
   otherwise fails the request with the first reason and sends ``failed`` (never ``done``),
   only after all parts are terminal, so no byte moves after the peer hears of its end;
4. on a deadline (or a cancel), fails the request but *holds* it while a posted part is in
   flight: a released NIXL request does not recall bytes the transport queued (UCX over TCP
   lands them after the release), so parts are polled until NIXL says DONE or ERR; then every
   handle is released (one NIXL refuses is retried on later polls) and the request is reported
   failed. Only :meth:`Executor.cancel_all` (the agent closing) releases parts in flight.

Parts the agent's :class:`~kvlc.runtime.staging.agent.Stager` picks (fragmented WRITEs or ones
across memory types) go through bounce buffers instead: one staged send per peer rank, whose
state follows the staging events. Several requests of one connection may share their NIXL
requests (:meth:`Executor.submit_many`, :mod:`kvlc.runtime.batch`); they then end together.

A request is never created or posted at or after its deadline; it reports ``held``
(:attr:`Outgoing.held`) while a part past its deadline cannot be released yet. Every
notification carries the tag of the session it goes to (:class:`Target`). NIXL is reached
only through the :class:`~kvlc.runtime.nixl.core.Agent` interface, so a fake agent drives it in unit tests.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from kvlc.errors import TransferError
from kvlc.runtime.errors import NixlError
from kvlc.runtime.kinds import Status
from kvlc.runtime.nixl.core import XferState
from kvlc.runtime.channel.notifs import Target, tell_done

log = logging.getLogger("kvlc.runtime.transfer")


class Step(enum.Enum):
    """Where a request stands after a turn of :meth:`Executor._advance`, in the order it passes them."""

    IN_FLIGHT = "in flight"  # before its deadline, a part still moves bytes
    HELD = "held"            # past its deadline (or cancelled): a posted part is in flight until NIXL ends it
    RELEASING = "releasing"  # every part ended; NIXL would not release a handle yet
    ENDED = "ended"          # every handle released: failed now, or done at the end of the turn


@dataclass(frozen=True)
class PreparedPart:
    """A part given as int32 indices into two lists prepared once per connection (strided rows)."""

    key: Any                 # the PartKey it moves bytes for
    local: Any               # Prepped handle of the local list
    local_idx: Any
    remote: Any              # Prepped handle of the peer's list
    remote_idx: Any
    nbytes: int

    def __len__(self) -> int:
        return len(self.local_idx)


@dataclass
class PartRun:
    """One NIXL request of a transfer: its part key, handle, size and state."""

    key: Any
    xfer: Any
    rows: int
    nbytes: int
    state: XferState = XferState.PROC
    error: str | None = None
    posted: bool = False
    staged: str = ""  # staged through bounce buffers to this NIXL agent (no handle of its own)
    peer: str = ""  # the NIXL agent its bytes go to or come from
    stopped: bool = False  # given up in flight (deadline or cancel): it ends ERR "cancelled", even if DONE


@dataclass(frozen=True)
class Member:
    """One request of a submission (:meth:`Executor.submit_many`): key, id, tag, its own bytes and rows."""

    key: Hashable
    req: str
    nbytes: int
    rows: int
    tag: Any = None


@dataclass
class Outgoing:
    """A request this agent moves bytes for (it initiated the READs or WRITEs)."""

    key: Hashable
    req: str
    op: str
    notify: Mapping[int, Target]  # remote rank → where its one notification goes
    parts: list[PartRun]
    started: float
    deadline: float | None
    tag: Any = None
    status: str = "active"  # active | done | failed
    reason: str = ""
    finished: float | None = None
    notified: tuple[int, ...] = ()
    held: bool = False  # reported held: past the deadline with a part not released yet
    nbytes: int = 0  # this request's own bytes and rows (its parts may be shared with a batch)
    rows: int = 0
    ready: dict[Target, bytes] | None = None  # its `done` per target, built while its bytes move (see _step)

    @property
    def terminal(self) -> bool:
        return self.status in ("done", "failed")

    @property
    def settled(self) -> bool:
        """No part is in flight any more (as last seen)."""
        return not any(r.state is XferState.PROC for r in self.parts)


class Executor:
    """Runs split transfers for one agent. Not thread-safe: the caller holds its lock."""

    SWEEP_S = 0.002  # every part in flight is asked at least this often (see progress)

    def __init__(self, agent, rank: int, clock: Callable[[], float] = time.monotonic, stager: Any = None):
        self.agent = agent
        self.rank = rank
        self.clock = clock
        self.stager = stager
        self.active: dict[Hashable, Outgoing] = {}
        self.stuck: list[Any] = []  # handles NIXL refused to release; retried on progress/close
        self._staged: dict[tuple[str, str], tuple[Outgoing, PartRun]] = {}  # (req, peer agent) → its part
        self._done: list[Outgoing] = []  # every part done, its done notifications not sent yet
        self._swept = float("-inf")  # when progress last asked every part

    def _stage(self, req: str, staged: dict[int, list], parts, agents, notify, timeout) -> list[PartRun]:
        """Start one staged send per peer rank; if one cannot start, the ones started are given up."""
        runs: list[PartRun] = []
        try:
            for rank, keys in staged.items():
                chosen = [parts[k] for k in keys]
                self.stager.send(req, agents[rank], chosen, notify[rank].key, timeout)
                runs.append(PartRun(("staged", rank), None, sum(len(p.local) for p in chosen),
                                    sum(int(p.nbytes) for p in chosen), staged=agents[rank], posted=True))
        except BaseException:
            for r in runs:
                self.stager.abort(req, r.staged, "another staged part could not start")
            raise
        return runs

    # ------------------------------------------------------------------ submit
    def submit(self, key: Hashable, req: str, op: str, parts: Mapping[Any, Any], agents: Mapping[int, str],
               notify: Mapping[int, Target], timeout: float | None = None, tag: Any = None,
               staged: Mapping[int, list] | None = None) -> Outgoing:
        """Create and post one NIXL request per non-empty part; the parts ``staged`` names (peer rank →
        keys, :meth:`~kvlc.runtime.staging.agent.Stager.pick`) go through bounce buffers instead.
        Raises :class:`NixlError` if a request cannot be created (nothing is posted then); a failed
        post makes the request fail. A ``timeout`` of zero or less is refused with
        :class:`TransferError` (nothing is created)."""
        own = [p for p in parts.values() if len(p)]
        member = Member(key, req, sum(int(p.nbytes) for p in own), sum(len(p) for p in own), tag)
        return self.submit_many([member], op, parts, agents, notify, timeout, staged)[0]

    def submit_many(self, members: list[Member], op: str, parts: Mapping[Any, Any], agents: Mapping[int, str],
                    notify: Mapping[int, Target], timeout: float | None = None,
                    staged: Mapping[int, list] | None = None) -> list[Outgoing]:
        """:meth:`submit` for several requests whose ``parts`` were joined: one NIXL request per part
        carries all of them, so they end together (a failure, timeout or cancel of one fails every
        member; none is told ``done`` before all bytes landed). Staged parts take one member only."""
        dup = next((m for m in members if m.key in self.active), None)
        if dup is not None:
            raise NixlError(f"submit request '{dup.req}'", "duplicate", "a request with this id is in flight")
        req = members[0].req
        if timeout is not None and timeout <= 0:
            raise TransferError(f"request '{req}': its deadline has passed ({timeout:.3g}s left); nothing posted")
        staged = staged or {}
        if staged and len(members) > 1:
            raise TransferError(f"request '{req}': staged parts cannot be shared by {len(members)} requests")
        runs = self._create(req, op, parts, agents, staged, notify, timeout)
        now = self.clock()
        deadline = None if timeout is None else now + timeout
        alone = None if len(members) == 1 else {}  # members of a batch end together: one batch notification
        outs = [Outgoing(m.key, m.req, op, dict(notify), runs, now, deadline, m.tag, nbytes=m.nbytes, rows=m.rows,
                         ready=alone) for m in members]
        self.active.update((o.key, o) for o in outs)
        self._post(outs[0], runs)  # the other members see its failed parts: progress fails them too
        return outs

    def _create(self, req: str, op: str, parts: Mapping[Any, Any], agents: Mapping[int, str], staged,
                notify, timeout) -> list[PartRun]:
        """NIXL requests of the non-empty parts, staged sends of ``staged``; after a failure none is kept."""
        skip = {k for keys in staged.values() for k in keys}
        runs: list[PartRun] = []
        try:
            for pk, part in parts.items():
                key = part.key if isinstance(part, PreparedPart) else pk  # prepared: keyed ("prepped", key)
                if pk not in skip and len(part):
                    runs.append(self._one(req, op, key, part, agents[key.peer_rank]))
            runs += self._stage(req, staged, parts, agents, notify, timeout) if staged else []
        except BaseException:
            for r in runs:
                self._release(r)
            raise
        return runs

    def _one(self, req: str, op: str, pk, part, peer: str) -> PartRun:
        """The NIXL request of one part (``pk``: its PartKey) to ``peer``."""
        if isinstance(part, PreparedPart):
            x = self.agent.make_prepped(op, part.local, part.local_idx, part.remote, part.remote_idx,
                                        what=f"request '{req}' part {pk} (prepared)")
        else:
            x = self._by_blocks(req, op, pk, part, peer)
            if x is None:
                x = self.agent.initialize(op, part.local, pk.local_mem, part.remote, pk.remote_mem, peer,
                                          what=f"request '{req}' part {pk}")
        return PartRun(pk, x, len(part), int(part.nbytes), peer=peer)

    def _by_blocks(self, req: str, op: str, pk, part, peer: str) -> Any:
        """The same-host copy of a part by its block form (its rows are not built), where it has one and the
        agent takes it; else None."""
        blocks = getattr(part, "blocks", None)
        by_blocks = getattr(self.agent, "initialize_blocks", None)
        if blocks is None or by_blocks is None:
            return None
        return by_blocks(op, blocks, pk.local_mem, pk.remote_mem, peer, len(part), what=f"request '{req}' part {pk}")

    def _post(self, out: Outgoing, runs: list[PartRun]) -> None:
        """Post every part (a staged one is running already); after a failure, post no more."""
        for r in runs:
            if r.staged:
                self._staged[(out.req, r.staged)] = (out, r)
                continue
            if out.deadline is not None and self.clock() >= out.deadline and not out.reason:
                out.reason = "deadline passed before every part was posted"
            if out.reason:  # an earlier part failed to post: do not start more
                r.state, r.error = XferState.ERR, "not posted: an earlier part failed"
                continue
            r.state = self.agent.post(r.xfer)
            r.posted = True
            if r.state is XferState.ERR:
                r.error = r.xfer.error or "post failed"
                out.reason = f"part {r.key}: {r.error}"
        if out.reason:  # the request fails: its staged parts stop too
            for r in runs:
                if r.staged:
                    self.stager.abort(out.req, r.staged, out.reason)

    # ------------------------------------------------------------------ progress
    def progress(self) -> list[Outgoing]:
        """Advance every active request without blocking; return those that became terminal.

        Parts are asked for their state oldest first, and per peer only until one is still in
        flight: a later part to that peer waits for the next turn (a NIXL check costs microseconds
        and 32 requests in flight would pay 32 per turn). Every :attr:`SWEEP_S` seconds, and for a
        request past its deadline, every part is asked, so a part that finished out of order is
        seen within that time."""
        self._retry_stuck()
        if self.stager is not None:
            for ev in self.stager.progress():
                self._stage_event(ev)
        now = self.clock()
        sweep = now - self._swept >= self.SWEEP_S
        if sweep:
            self._swept = now
        busy: set[str] | None = None if sweep else set()
        done = []
        for again in (False, True):  # again: members of a batch whose shared parts ended after they were asked
            for key in [k for k, o in self.active.items() if not again or o.settled]:
                if self._advance(self.active[key], now, busy):
                    done.append(self.active.pop(key))
            if not done:
                break
        self._notify_done()
        return done

    def _stage_event(self, ev) -> None:
        """A staged send ended: ``sent`` (every chunk scattered by the receiver) or ``failed``."""
        got = self._staged.pop((ev.req, ev.peer), None) if ev.kind in ("sent", "failed") else None
        if got is None:
            return  # receiving side, or a request that ended already
        out, r = got
        if ev.kind == "sent":
            r.state = XferState.DONE
        else:
            r.state, r.error = XferState.ERR, ev.reason or "staging failed"
            out.reason = out.reason or f"part {r.key}: {r.error}"

    def _advance(self, out: Outgoing, now: float, busy: set[str] | None = None) -> bool:
        """One turn of ``out``'s state machine (:class:`Step`); True once it ended (reported)."""
        return self._step(out, now, busy) is Step.ENDED

    def _step(self, out: Outgoing, now: float, busy: set[str] | None) -> Step:
        """Poll parts → deadline → held until terminal → release → finish.

        ``busy``: peers with a part in flight seen this turn, whose later parts are not asked
        (None: ask every part; a request past its deadline asks every part)."""
        late = out.deadline is not None and now >= out.deadline
        self._poll(out, None if late else busy)
        if late and not out.settled:
            self._stop(out)
        if not out.settled:
            return Step.HELD if late else self._ready(out)
        if not all([self._release(r) for r in out.parts]):
            return Step.RELEASING  # a handle NIXL would not release yet: try again later
        failed = next((r for r in out.parts if r.state is XferState.ERR), None)
        if failed is not None and not out.reason:  # a part shared with a batch failed through another member
            out.reason = f"part {failed.key}: {failed.error or 'transfer failed'}"
        self._finish(out, now)
        return Step.ENDED

    def _ready(self, out: Outgoing) -> Step:
        """Build ``out``'s ``done`` notifications (one per target: its tag, its JSON) while its bytes still move, so
        that its end only sends them (:func:`tell_done` takes them where a notification carries ``out`` alone):
        the copy hides the work that otherwise came after it (a 1k-token same-host handover on an H100 host spent
        27 µs in ``tell_done`` after its copy ended: benchmarks/README.md, run 38). The bytes are those
        :meth:`Target.done` builds at the end; a request that fails never sends them. Once per request, and only
        while it is the one request in flight here: requests that end together share one batch notification, so a
        single ``done`` built for each of many in flight would mostly go unused (a member of a batch has ``{}``: it
        is told in the batch's). Returns :attr:`Step.IN_FLIGHT`."""
        if out.ready is None and len(self.active) == 1:
            out.ready = {t: t.done([out.req], self.rank) for t in set(out.notify.values())}
        return Step.IN_FLIGHT

    def _poll(self, out: Outgoing, busy: set[str] | None) -> None:
        """Ask NIXL for the state of ``out``'s posted parts in flight (see :meth:`progress` for ``busy``)."""
        for r in out.parts:
            if r.state is not XferState.PROC or r.xfer is None or r.xfer.released:
                continue
            if busy is not None and r.peer in busy:
                continue
            r.state = self.agent.state(r.xfer)
            if r.stopped and r.state is not XferState.PROC:
                r.state, r.error = XferState.ERR, "cancelled"
            elif r.state is XferState.ERR:
                r.error = r.xfer.error or "transfer failed"
                out.reason = out.reason or f"part {r.key}: {r.error}"
            elif busy is not None and r.state is XferState.PROC:
                busy.add(r.peer)

    def _stop(self, out: Outgoing) -> None:
        """Past the deadline (or cancelled) with parts in flight: the request fails, but it is held.

        A staged send is given up (it ends with a staging event once none of its WRITEs is in
        flight). A posted NIXL request is *not* released: releasing does not recall what the
        transport already queued (UCX over TCP lands megabytes after it), so the request waits
        until NIXL says every posted part ended (DONE or ERR); only then are handles released."""
        pending = [r for r in out.parts if r.state is XferState.PROC]
        out.reason = out.reason or (
            f"timed out after {out.deadline - out.started:.3g}s with "
            f"{len(pending)} of {len(out.parts)} parts in flight"
        )
        for r in pending:
            if r.staged:
                self.stager.abort(out.req, r.staged, out.reason)
            else:  # the members of a batch that share it fail with it
                r.stopped = True

    def _finish(self, out: Outgoing, now: float) -> None:
        """Every handle of ``out`` is released: a failed request notifies now; a successful one
        waits for :meth:`_notify_done` (the end of this progress turn), which batches."""
        out.finished = now
        if out.reason:
            self._fail(out)
        else:
            self._done.append(out)

    def _notify_done(self) -> None:
        """Tell every request that ended well since the last call (:func:`tell_done`: one
        notification per session for all of them), then decide each: one whose notification to a
        rank could not be sent fails (the ranks not yet told hear ``failed``)."""
        outs, self._done = self._done, []
        if outs:
            tell_done(self.agent, self.rank, outs)
        for out in outs:
            if out.reason:
                self._fail(out)
            else:
                out.status = "done"

    def _fail(self, out: Outgoing) -> None:
        out.status = "failed"
        for rank, target in out.notify.items():
            if rank in out.notified:
                continue
            try:
                self.agent.send_notif(target.agent, target.notif(out.req, self.rank, Status.FAILED, out.reason))
            except NixlError:
                pass  # the peer may be gone; failing is already decided

    # ------------------------------------------------------------------ release
    def _release(self, r: PartRun) -> bool:
        if r.xfer is None or r.xfer.released:
            return True
        try:
            r.xfer.release()
            return True
        except NixlError as exc:
            log.warning("cannot release %s yet: %s", r.xfer, exc)
            return False

    def _retry_stuck(self) -> None:
        keep = []
        for x in self.stuck:
            try:
                x.release()
            except NixlError:
                keep.append(x)
        self.stuck = keep

    def cancel(self, key: Hashable, reason: str) -> Outgoing | None:
        """Stop one active request now: the deadline becomes now. Returns it once terminal (every
        handle released), else None: it is held (a posted part in flight until NIXL ends it, or a
        handle NIXL cannot release yet); a later :meth:`progress` ends it."""
        out = self.active.get(key)
        if out is None:
            return None
        out.reason = out.reason or reason
        out.deadline = min(out.deadline or self.clock(), self.clock())
        if self._advance(out, self.clock()):
            del self.active[key]
            self._notify_done()
            return out
        return None

    def cancel_all(self, reason: str) -> list[Outgoing]:
        """Cancel every active request (agent closing): release handles, mark failed, no notifications
        of success. Handles NIXL refuses to release are kept in :attr:`stuck`."""
        out_list = []
        now = self.clock()
        for key in list(self.active):
            out = self.active.pop(key)
            out.reason = out.reason or reason
            for r in out.parts:
                if r.staged:
                    self.stager.abort(out.req, r.staged, out.reason)
                    self._staged.pop((out.req, r.staged), None)
                elif r.state is XferState.PROC:
                    # Refresh first: a part that finished meanwhile must not be counted as cancelled.
                    r.state = self.agent.state(r.xfer) if not r.xfer.released else r.state
                if not self._release(r):
                    self.stuck.append(r.xfer)
                if r.state is XferState.PROC:
                    r.state, r.error = XferState.ERR, "cancelled"
            self._finish(out, now)
            out_list.append(out)
        self._notify_done()
        return out_list
