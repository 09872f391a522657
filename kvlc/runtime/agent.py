"""KvAgent: one engine rank's KV cache, registered with NIXL, in sessions with the ranks of other engines.

Roles (:func:`~kvlc.compiler.pairing.pair.pair`): the **consumer** receives bytes, the **producer** sends them:

``direct`` / ``prepped``  the consumer connects with ``direction="READ"`` and :meth:`Peer.read`
                          READs from every producer rank it pairs with (rows per request, or
                          indices into lists prepared at connect), then notifies each; or the
                          producer connects with ``direction="WRITE"`` and :meth:`Peer.write` pushes.
``pull_via_push``         the consumer connects with ``direction="READ", mode="pull_via_push"``;
                          :meth:`Peer.read` hands its block ids to a background sender, each
                          producer rank WRITEs (before the consumer's deadline) and notifies.

:meth:`Peer.write_many` / :meth:`Peer.read_many` share NIXL requests among several (:mod:`kvlc.runtime.batch`).
Options are one :class:`~kvlc.runtime.settings.AgentSettings` (explicit > ``KVLC_*`` > default).
Staging (``staging=``, ``$KVLC_STAGING``) sends fragmented or mixed-memory WRITEs through bounce buffers.
Every side calls :meth:`KvAgent.poll`; it never blocks and returns :class:`~kvlc.runtime.tracking.Completions`
(finished, failed, held, freeable): a failed request's blocks are safe to reuse, a *held* one's
not yet. Side-channel connections are authenticated with a shared secret (``secret=``,
``$KVLC_SECRET`` or ``$KVLC_SECRET_FILE``; :mod:`kvlc.runtime.channel.auth`). Example (``kvlc demo``)::

    producer = KvAgent(plan_p, 0, tensors_p, AgentSettings(secret=key)); addr = producer.serve()
    consumer = KvAgent(plan_c, 0, tensors_c, AgentSettings(secret=key))
    peer = consumer.connect(addr, direction="READ")          # CompatError here, not per request
    peer.read("req-1", {"full": [3, 4]}, {"full": [7, 9]}, num_tokens=20)
    while "req-1" not in consumer.poll().finished: ...
"""

from __future__ import annotations

import logging
import re
import secrets
import threading
import time
import uuid
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

from kvlc.compiler.plan.model import Plan
from kvlc.errors import TransferError
from kvlc.runtime import server as _server
from kvlc.runtime.arguments import PROGRESS  # noqa: F401 - re-exported, callers import it from here
from kvlc.runtime.arguments import check_agent_args, check_request_id, valid_name
from kvlc.runtime.binding import Bound, bind
from kvlc.runtime.channel.tcp import ChannelServer
from kvlc.runtime.errors import HandshakeError
from kvlc.runtime.kinds import Event, Status
from kvlc.runtime.nixl.core import Agent
from kvlc.runtime.peer import Peer, connect
from kvlc.runtime.settings import AgentSettings
from kvlc.runtime.pump import Pump, Resources, Sender
from kvlc.runtime import replies as _replies
from kvlc.runtime.channel.sessions import RemoteEngine, Session, SessionTable
from kvlc.runtime.staging.agent import make_stager
from kvlc.runtime.tracking import Completions, Events, Incoming, Tally
from kvlc.runtime.channel.notifs import agents_of
from kvlc.runtime.transfer import Executor, Outgoing, Target
from kvlc.runtime.channel.wire import StorageBase, decode, make_record
from kvlc.runtime.nixl.warmup import Warmer

log = logging.getLogger("kvlc.runtime.agent")


class KvAgent:
    """One rank of one engine: bound tensors, one NIXL registration per storage, an authenticated side channel.

    ``settings`` (:class:`~kvlc.runtime.settings.AgentSettings`; default: from ``KVLC_*`` variables and
    defaults) says how it runs. Each agent gets a fresh random epoch, so a restarted rank replaces
    only its own old sessions.
    """

    def __init__(self, plan: Plan, rank: int, tensors: Mapping[str, Any], settings: AgentSettings | None = None):
        cfg = self.settings = settings if settings is not None else AgentSettings()
        check_agent_args(plan, rank, cfg.progress, cfg.timeout, cfg.lease)
        self._key = cfg.channel_key()
        self.plan, self.rank, self.timeout, self.lease = plan, rank, float(cfg.timeout), float(cfg.lease)
        self.limits = cfg.limits
        self.bindings: dict[str, Bound] = bind(plan, tensors)
        default = re.sub(r"[^A-Za-z0-9_.\-]", "_", plan.name)[:80]
        self.engine_id = valid_name(cfg.engine_id or f"{default}-{uuid.uuid4().hex[:12]}", "engine_id")
        self.epoch = secrets.token_hex(8)
        self.name = valid_name(cfg.name or f"kvlc-{default}-r{rank}-{uuid.uuid4().hex[:8]}")
        self._lock = threading.RLock()
        self.closed = False
        self.nixl = self._make_nixl(cfg, any(s.mem == "VRAM" for s in plan.storages))
        self._res = Resources(self.nixl, self.name)
        try:
            for b in self.bindings.values():
                self.nixl.register(b.row(), b.mem, what=f"storage '{b.name}'")
            storages = [StorageBase(name=b.name, addr=b.addr, size=b.nbytes, mem=b.mem, device=b.device)
                        for b in self.bindings.values()]
            self.staging = cfg.staging_policy()
            self.stager = make_stager(self.nixl, self.bindings, self.staging)
            self.record = make_record(self.name, self.nixl.metadata(), plan, rank, storages,
                                      self.engine_id, self.epoch)
        except BaseException:
            self.nixl.close()
            raise
        self.bases = {b.name: (b.addr, b.device) for b in self.bindings.values()}
        self.executor = self._res.executor = Executor(self.nixl, rank, stager=self.stager)
        self._res.stager = self.stager
        self.warmer = Warmer(self.nixl, self.bindings)  # connect's warm-up READs (kvlc.runtime.nixl.warmup)
        self._unsettled: set[str] = set()            # consumer: complete, but a staged scatter still copies
        self.sessions = SessionTable(plan, rank, self.name)
        self.events = Events()
        self.incoming: dict[str, Incoming] = {}      # consumer: requests remote ranks move here
        self.tallies: dict[tuple, Tally] = {}        # producer: (engine key, req) → consumer answers
        self.offers: dict[str, float] = {}           # producer: req → lease end, no consumer named it yet
        self.sender = self._res.sender = Sender(decode, self._res.stop, f"kvlc-sender-{self.name}")
        self._cancel_clients: dict = {}              # push consumer: producer address → client
        self.stats = {"dropped_notifs": 0, "fenced_chunks": 0, "requests": 0, "bytes": 0, "descriptors": 0,
                      "nixl_requests": 0}
        self._finalizer = weakref.finalize(self, self._res.close)
        if cfg.progress == "thread":
            self._res.pump = Pump(self, "_pump_locked", cfg.progress_interval, self._res.stop,
                                  f"kvlc-progress-{self.name}", busy_interval=self.PUMP_BUSY_S)

    def _make_nixl(self, cfg: AgentSettings, vram: bool):
        """The NIXL agent wrapper (``cfg.agent_factory`` in tests)."""
        if cfg.agent_factory is not None:
            return cfg.agent_factory(self.name)
        return Agent(self.name, cfg.backends, telemetry=cfg.telemetry, ucx=cfg.ucx_options(vram),
                     progress_thread=cfg.progress == "nixl")

    # ------------------------------------------------------------------ side channel
    def serve(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Start this agent's authenticated side-channel server; returns its ``host:port``."""
        with self._lock:
            self._check_open()
            if self._res.server is None:
                ref = weakref.ref(self)

                def handler(conn, frame, ref=ref):
                    agent = ref()
                    return _server.error_reply("agent closed") if agent is None else _server.handle(agent, conn, frame)

                def closed(conn, ref=ref):
                    agent = ref()
                    if agent is not None and conn.session is not None:
                        with agent._lock:
                            agent._drop_session(conn.session, "its side-channel connection closed")

                self._res.server = ChannelServer(handler, _server.error_reply, self._key, host, port,
                                                 limits=self.limits, on_close=closed)
            return self.address

    @property
    def address(self) -> str | None:
        if self._res.server is None or self._res.server.closed:
            return None
        h, p = self._res.server.address
        return f"{h}:{p}"

    def connect(self, *addresses: str, direction: str = "READ", mode: str = "direct",
                timeout: float = 10.0, warm: bool = True) -> Peer:
        """Connect to the ranks of one remote engine (one side-channel address per rank); see :func:`connect`.
        ``warm``: touch the peers' VRAM once now, so the first request does not pay UCX's first use
        (:mod:`kvlc.runtime.nixl.warmup`)."""
        return connect(self, addresses, direction, mode, timeout, warm)

    # ------------------------------------------------------------------ sessions (caller holds the lock)
    def _load_remote(self, rec) -> None:
        if rec.agent in self.nixl.remotes:
            return
        name = self.nixl.add_remote(rec.nixl_md)
        if name != rec.agent:
            self.nixl.remove_remote(name)
            raise HandshakeError(f"record says agent '{rec.agent}' but its NIXL metadata is agent '{name}'")

    def _drop_session(self, s: Session, why: str) -> None:
        """End a session: its in-flight transfers stop, what waited on it ends, its NIXL agent goes."""
        _replies.end_session(self, s, why)

    # ------------------------------------------------------------------ requests
    def _submit(self, key, req: str, op: str, parts, notify: Mapping[int, Target], timeout, tag=None) -> Outgoing:
        return self._counted([self.executor.submit(key, req, op, parts, agents_of(notify), notify, timeout, tag)])[0]

    def _submit_many(self, members, op: str, parts, notify: Mapping[int, Target], timeout) -> list[Outgoing]:
        """Several requests sharing their NIXL requests (:mod:`kvlc.runtime.batch`)."""
        return self._counted(self.executor.submit_many(members, op, parts, agents_of(notify), notify, timeout))

    def _counted(self, outs: list[Outgoing]) -> list[Outgoing]:
        self.stats["requests"] += len(outs)
        self.stats["bytes"] += sum(o.nbytes for o in outs)
        self.stats["descriptors"] += sum(o.rows for o in outs)
        self.stats["nixl_requests"] += sum(r.xfer is not None for r in outs[0].parts)  # a batch shares its parts
        return outs

    def _tally(self, engine: RemoteEngine, req: str) -> Tally:
        key = (engine.key, req)
        t = self.tallies.get(key)
        if t is None:
            until = self.offers.pop(req, time.monotonic() + self.lease)
            t = self.tallies[key] = Tally(req, engine, until)
        return t

    def _tally_check(self, key, t: Tally) -> None:
        if t.complete:
            del self.tallies[key]
            why = t.reason()
            self.events.emit(Event.FAILED if why else Event.FINISHED, t.req, why)
            self.events.emit(Event.FREEABLE, t.req)
            self.events.end(key, Status.FAILED if why else Status.DONE)

    def expect(self, request_id: str, timeout: float | None = None) -> None:
        """Consumer in push mode: the request must land within ``timeout``; else it is held, the producers
        are asked to cancel, and it fails once every one answered (its blocks safe then)."""
        check_request_id(request_id)
        with self._lock:
            deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
            inc = self.incoming.get(request_id)
            if inc is not None:
                inc.deadline = deadline
            elif request_id not in self.events.ended:
                self.incoming[request_id] = Incoming(request_id, deadline)

    def offer(self, request_id: str, lease: float | None = None) -> None:
        """Producer: request ``request_id``'s source blocks wait for consumers; if none finished with them
        within ``lease`` seconds (default: the agent's), poll() reports them freeable."""
        check_request_id(request_id)
        with self._lock:
            self.offers[request_id] = time.monotonic() + (self.lease if lease is None else lease)

    def cancel(self, request_id: str) -> None:
        """Stop a request: what this side moves is released; what remote ranks move is cancelled there.
        The request is reported held, then failed once no byte can land (or finished if it already had)."""
        with self._lock:
            for key in (("read", request_id), ("write", request_id)):
                if key in self.executor.active:
                    out = self.executor.cancel(key, "cancelled by this engine")
                    if out is not None:
                        self._outgoing_done(out)
                    elif not self.executor.active[key].held:
                        self.executor.active[key].held = True
                        self.events.emit(Event.HELD, request_id, "cancelled; a part is still in flight")
            inc = self.incoming.get(request_id)
            if inc is not None:
                _replies.hold_and_cancel(self, inc, "cancelled by this engine")

    def _cancel_served(self, key, s: Session, req: str) -> Status:
        """Answer a remote cancel of a request this agent serves (see :mod:`kvlc.runtime.server`)."""
        if key is not None and key in self.executor.active:
            out = self.executor.cancel(key, f"cancelled by consumer rank {s.rank}")
            if out is None:
                return Status.PENDING
            self._outgoing_done(out)
            return Status.CANCELLED
        ended = self.events.ended.get(key) if key is not None else None
        if ended is not None:
            return ended
        self.events.end(("tomb", s.conn_id, req), Status.CANCELLED)
        return Status.UNKNOWN

    # ------------------------------------------------------------------ completion
    def poll(self) -> Completions:
        """Advance transfers, read notifications and replies, apply deadlines and leases; never blocks."""
        with self._lock:
            if not self.closed:
                self._pump()
                self._polled = time.monotonic()
            return self.events.drain()

    _polled = 0.0  # when poll() last advanced everything, or the engine submitted a request (monotonic s)
    PUMP_SKIP_S = 0.001  # the progress thread skips a turn when the engine was this recently active
    PUMP_BUSY_S = 0.00005  # its interval while staged chunks are in flight (each waits on a turn here)

    def _pump_locked(self) -> bool:
        """The progress thread's turn: fills gaps between the engine's polls, never waits for the engine's lock.

        Returns whether staged chunks are in flight: the thread then comes back every
        :attr:`PUMP_BUSY_S` and takes its turn even right after an engine poll (a chunk's scatter, its
        FREE and the next chunk's WRITE each wait on some agent's turn)."""
        hot = self.stager is not None and self.stager.endpoint.hot
        engine_active = time.monotonic() - self._polled < self.PUMP_SKIP_S
        if (engine_active and not hot) or not self._lock.acquire(blocking=False):
            return hot
        try:
            if not self.closed:
                self._pump()
        finally:
            self._lock.release()
        return self.stager is not None and self.stager.endpoint.hot

    def _pump(self) -> None:
        for out in self.executor.progress():
            self._outgoing_done(out)
        _replies.notifs(self, self.nixl.notifs())
        _replies.drain(self, self.sender.replies)
        self._deadlines(time.monotonic())

    def _deadlines(self, now: float) -> None:
        for out in self.executor.active.values():
            if out.deadline is not None and now >= out.deadline and not out.held:
                out.held = True
                self.events.emit(Event.HELD, out.req, "timed out; a part is still in flight")
        for inc in list(self.incoming.values()):
            if inc.deadline is not None and now >= inc.deadline and not inc.held:
                missing = inc.missing() if inc.engine is not None else "every producer rank"
                _replies.hold_and_cancel(self, inc, f"timed out waiting for {missing}")
        for key, t in list(self.tallies.items()):
            if now >= t.lease_until:
                del self.tallies[key]
                self.events.emit(Event.FREEABLE, t.req)
                self.events.end(("lease", t.engine.key, t.req), Status.FAILED)
        for req, until in list(self.offers.items()):
            if now >= until:
                del self.offers[req]
                self.events.emit(Event.FREEABLE, req)

    def _outgoing_done(self, out: Outgoing) -> None:
        kind = out.key[0]
        status = Status.DONE if out.status == "done" else Status.FAILED
        if kind == "pvp":  # producer share of a pull-via-push request
            s = out.tag[1]
            self.events.end(out.key, status)
            key = (s.engine.key, out.req)
            t = self.tallies.get(key)
            if t is not None:
                t.add(s.rank, status, out.reason)
                self._tally_check(key, t)
            return
        self.events.end(out.key, status)
        self.events.emit(Event.FINISHED if status is Status.DONE and not out.held else Event.FAILED,
                         out.req, out.reason or ("" if not out.held else "timed out"))
        if out.op == "WRITE":
            self.offers.pop(out.req, None)
            self.events.emit(Event.FREEABLE, out.req)

    def wait(self, request_ids: Iterable[str], timeout: float | None = None, interval: float = 0.0005
             ) -> Completions:
        """Poll until every id has finished or failed (tests, demos); other events are kept too."""
        want = set(request_ids)
        finished, failed, held, freeable = [], {}, {}, []
        deadline = None if timeout is None else time.monotonic() + timeout
        while want:
            c = self.poll()
            finished += c.finished
            failed.update(c.failed)
            held.update(c.held)
            freeable += c.freeable
            want -= set(c.finished) | set(c.failed)
            if want and deadline is not None and time.monotonic() > deadline:
                raise TransferError(f"wait: {len(want)} request(s) still open after {timeout}s: {sorted(want)[:5]}")
            if want and not c:
                time.sleep(interval)
        return Completions(tuple(finished), failed, held, tuple(freeable))

    @property
    def in_flight(self) -> int:
        return len(self.executor.active)

    # ------------------------------------------------------------------ lifetime
    def _check_open(self) -> None:
        if self.closed:
            raise TransferError(f"agent '{self.name}' is closed")

    def close(self) -> None:
        """Stop serving, cancel and release in-flight transfers, deregister memory (idempotent)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        self._res.stop.set()
        if self._res.server is not None:
            self._res.server.close()
        with self._lock:
            for out in self.executor.cancel_all(f"agent '{self.name}' closed"):
                self._outgoing_done(out)
        self._finalizer()

    def __enter__(self) -> KvAgent:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
