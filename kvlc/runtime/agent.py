"""KvAgent: one engine rank's KV cache, registered with NIXL, in sessions with the ranks of other engines.

Roles (:func:`~kvlc.compiler.pairing.pair.pair`): the **consumer** receives bytes, the **producer** sends them:

``direct`` / ``prepped``  the consumer connects with ``direction="READ"`` and :meth:`Peer.read`
                          READs from every producer rank it pairs with (rows per request, or
                          indices into lists prepared at connect), then notifies each; or the
                          producer connects with ``direction="WRITE"`` and :meth:`Peer.write` pushes.
``pull_via_push``         the consumer connects with ``direction="READ", mode="pull_via_push"``;
                          :meth:`Peer.read` asks each producer rank (the frame written at once,
                          its reply read by a background sender), each producer rank WRITEs
                          (before the consumer's deadline) and notifies.

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
from collections.abc import Callable, Iterable, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

from kvlc.compiler.plan.model import Plan
from kvlc.compiler.request.instantiate import prepare_bound
from kvlc.errors import TransferError
import kvlc.runtime.server as _server
from kvlc.runtime.arguments import check_agent_args, check_request_id, request_timeout, valid_name
from kvlc.runtime.binding import Bound, bind
from kvlc.runtime.channel.client import ChannelClient
from kvlc.runtime.channel.tcp import ChannelServer
from kvlc.runtime.errors import HandshakeError, NixlError
from kvlc.runtime.kinds import ConnectionMode, Direction, Event, Status
from kvlc.runtime.nixl.core import Agent
from kvlc.runtime.peer import Peer, connect
from kvlc.runtime.settings import AgentSettings, check_advertised
from kvlc.runtime.pump import Pump, Resources, Sender
import kvlc.runtime.replies as _replies
from kvlc.runtime.channel.sessions import RemoteEngine, Session, SessionTable
from kvlc.runtime.staging.agent import make_stager
from kvlc.runtime.tracking import Completions, Events, Incoming, Tally
from kvlc.runtime.channel.notifs import agents_of
from kvlc.runtime.transfer import Executor, Outgoing, Target
from kvlc.runtime.channel.identity import Identity, introduction
from kvlc.runtime.channel.wire import Introduce, Record, StorageBase, decode, make_record
from kvlc.runtime.nixl.warmup import Warmer, warm_peers
from kvlc.runtime.ipc import bell as _bell
from kvlc.runtime.ipc.memory import host_key, offer, open_offer, with_bell
from kvlc.runtime.ipc.route import IpcRoute, IpcXfer

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
        self.started_at = time.time()  # this epoch's start: its memory holds nothing produced before
        self._identity = Identity.generate()  # this epoch's key: introductions prove it (channel.identity)
        self.name = valid_name(cfg.name or f"kvlc-{default}-r{rank}-{uuid.uuid4().hex[:8]}")
        self._lock = threading.RLock()
        self._frames = threading.local()  # a server thread's batch of frames (:meth:`serving`): pulls served in it
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
                                      self.engine_id, self.epoch, self._identity.public, self.started_at,
                                      notes_md=self.nixl.notes_metadata())
        except BaseException:
            self.nixl.close()
            raise
        self.bases = {b.name: (b.addr, b.device) for b in self.bindings.values()}
        self.route = self._res.route = (
            IpcRoute(self.nixl, self.bindings, cfg.ipc_min_rows, cfg.ipc_gpu_calls, cfg.ipc_copy_engine)
            if cfg.ipc == "auto" else None)
        self._shared: Any = False  # what same-host peers may map of this agent (made on first need)
        self.executor = self._res.executor = Executor(self.route or self.nixl, rank, stager=self.stager)
        self._res.stager = self.stager
        self.warmer = Warmer(self.nixl, self.bindings)  # connect's warm-up READs (kvlc.runtime.nixl.warmup)
        self.unsettled: set[str] = set()            # consumer: complete, but a staged scatter still copies
        self.sessions = SessionTable(plan, rank, self.name)
        self.events = Events()
        self.incoming: dict[str, Incoming] = {}      # consumer: requests remote ranks move here
        self.tallies: dict[tuple, Tally] = {}        # producer: (engine key, req) → consumer answers
        self.offers: dict[str, float] = {}           # producer: req → lease end, no consumer named it yet
        self.retiring: set[str] = set()              # NIXL agents of ended sessions a request still uses
        self.sender = self._res.sender = Sender(decode, self._res.stop, f"kvlc-sender-{self.name}")
        self._cancel_clients: dict = {}              # push consumer: producer address → client
        self.stats = {"dropped_notifs": 0, "fenced_chunks": 0, "requests": 0, "bytes": 0, "descriptors": 0,
                      "nixl_requests": 0, "refused_hellos": 0, "ipc_requests": 0, "ipc_copies": 0, "ipc_peers": 0,
                      "bell_rung": 0, "bell_taken": 0, "bells": 0}
        self._finalizer = weakref.finalize(self, self._res.close)
        if cfg.progress == "thread":
            self._res.pump = Pump(self, "progress_turn", cfg.progress_interval, self._res.stop,
                                  f"kvlc-progress-{self.name}", busy_interval=self.PUMP_BUSY_S)

    def _make_nixl(self, cfg: AgentSettings, vram: bool):
        """The NIXL agent wrapper (``cfg.agent_factory`` in tests)."""
        if cfg.agent_factory is not None:
            return cfg.agent_factory(self.name)
        return Agent(self.name, cfg.backends, telemetry=cfg.telemetry, ucx=cfg.ucx_options(vram),
                     progress_thread=cfg.progress == "nixl", notes=cfg.notes_agent)

    # ------------------------------------------------------------------ side channel
    def serve(self, host: str | None = None, port: int | None = None, advertise: str | None = None) -> str:
        """Start this agent's authenticated side-channel server on ``host:port`` (default: the settings'
        ``host`` and ``port``); returns the address peers are given, ``advertise`` (default: the settings'
        ``advertise``, else the bound host) with the bound port. A wildcard advertised address (0.0.0.0, ::)
        is refused with the fix named, before anything is bound."""
        cfg = self.settings
        bind_host = cfg.host if host is None else host
        shown = check_advertised(advertise or cfg.advertise or bind_host)
        with self._lock:
            self.check_open()
            if self._res.server is None:
                self._res.server = self._channel_server(bind_host, cfg.port if port is None else port)
                self._advertised = shown
            return self.address

    def _channel_server(self, host: str, port: int) -> ChannelServer:
        """The side-channel server; its handlers hold this agent weakly (a dropped agent is collected)."""
        ref = weakref.ref(self)

        def handler(conn, frame, ref=ref):
            agent = ref()
            return _server.error_reply("agent closed") if agent is None else _server.handle(agent, conn, frame)

        def closed(conn, ref=ref):
            agent = ref()
            if agent is not None and conn.session is not None:
                agent.drop_session(conn.session, "its side-channel connection closed")

        def serving(conn, ref=ref):
            agent = ref()
            return nullcontext() if agent is None else agent.serving()

        return ChannelServer(handler, _server.error_reply, self._key, host, port, limits=self.limits, on_close=closed,
                             serving=serving)

    _advertised = ""

    @property
    def address(self) -> str | None:
        """``host:port`` peers reach this agent's side channel at (None: not serving)."""
        if self._res.server is None or self._res.server.closed:
            return None
        _, p = self._res.server.address
        host = self._advertised
        return f"[{host}]:{p}" if ":" in host and not host.startswith("[") else f"{host}:{p}"

    def connect(self, *addresses: str, direction: str = "READ", mode: str = "direct",
                timeout: float = 10.0, warm: bool = True) -> Peer:
        """Connect to the ranks of one remote engine (one side-channel address per rank); see :func:`connect`.
        ``warm``: touch the peers' VRAM once now, so the first request does not pay UCX's first use
        (:mod:`kvlc.runtime.nixl.warmup`)."""
        return connect(self, addresses, direction, mode, timeout, warm)

    def client(self, address: str, timeout: float = 10.0) -> ChannelClient:
        """An authenticated side-channel connection to ``address`` with this agent's key."""
        return ChannelClient(address, self._key, timeout=timeout, peer_timeout=self.limits.peer_timeout)

    def hello(self, client: ChannelClient, server_agent: str, direction: str, mode: str, *,
              inbox=None) -> Introduce:
        """This agent's introduction to ``server_agent`` on ``client``'s connection (made now, if it is
        not), signed with this epoch's key over that connection: it is worthless on any other."""
        client.connect()
        msg = introduction(client.sealed.binding, server_agent, self.name, direction, mode)
        host = host_key() if self.route is not None else ""
        shared = (self._offer_to(server_agent, client.sealed.id) if host and mode == ConnectionMode.PULL_VIA_PUSH
                  else None)
        return Introduce(record=self.record, direction=direction, mode=mode, address=self.address or "",
                         inbox=inbox, host=host, shared=shared, proof=self._identity.sign(msg))

    # ------------------------------------------------------------------ same host (kvlc.runtime.ipc)
    def shared(self):
        """What a same-host peer may map of this agent's storages (None: nothing; ``ipc="off"``: None)."""
        with self._lock:
            if self._shared is False:
                self._shared = offer(self.bindings.values()) if self.route is not None else None
            return self._shared

    def shared_for(self, hello: Introduce, conn_id: str):
        """What this side offers in answer to ``hello`` on connection ``conn_id`` (:meth:`_offer_to`): a
        direct-mode peer on this host that can copy (it sent this host's key), when this side copies too;
        else None."""
        if self.route is None or hello.mode == ConnectionMode.PULL_VIA_PUSH or not hello.host:
            return None
        return self._offer_to(hello.record.agent, conn_id) if hello.host == host_key() else None

    def _offer_to(self, peer: str, conn_id: str):
        """What same-host NIXL agent ``peer`` may map here, for the session on connection ``conn_id``: the
        storages (:meth:`shared`) and a doorbell of that session's own, where ``bell.c`` is built (the
        peer's notifications to this side are written there, not sent through NIXL; taken at every
        poll; closed when the session ends). None where nothing can be offered."""
        shared = self.shared()
        if _bell.library() is None:
            return shared
        try:
            bell = _bell.Bell(peer, conn=conn_id)
        except OSError as exc:
            log.warning("no doorbell for %s, its notifications come through NIXL: %s", peer[:64], exc)
            return shared
        got = with_bell(shared, bell)
        with self._lock:
            if got is None or self.closed:
                bell.close()
                return shared
            self._res.bells.setdefault(peer, []).append(bell)
            self.stats["bells"] += 1
        return got

    def drop_bells(self, peer: str, conn_id: str | None = None) -> None:
        """Close the doorbells offered to NIXL agent ``peer``: the one of the session on ``conn_id``, or
        (None) every one, when no session with it is left (caller holds the lock)."""
        bells = self._res.bells.get(peer, [])
        for bell in [b for b in bells if conn_id is None or b.conn == conn_id]:
            bell.close()
            bells.remove(bell)
            self.stats["bells"] -= 1
        if not bells:
            self._res.bells.pop(peer, None)

    def _take_bells(self, got: dict[str, list[bytes]]) -> None:
        """Add what same-host peers rang since the last pump to ``got`` (sender → messages, as NIXL gives them)."""
        for peer, bells in self._res.bells.items():
            for bell in bells:
                dropped = bell.dropped
                msgs = bell.take()
                if msgs:
                    got.setdefault(peer, []).extend(msgs)
                    self.stats["bell_taken"] += len(msgs)
                self.stats["dropped_notifs"] += bell.dropped - dropped

    def map_peer(self, peer: str, shared) -> bool:
        """Copy to and from NIXL agent ``peer`` through its mapped storages (``shared``, its offer) from
        now on; where they cannot be mapped here, NIXL moves its bytes (logged, not an error)."""
        if self.route is None or shared is None:
            return False
        try:
            mapped = open_offer(peer, shared, self.route.devices())
            try:
                with self._lock:
                    self.route.add(mapped)
            except BaseException:
                mapped.close()
                raise
        except Exception as exc:  # IpcError, or no Triton / no GPU kernel on this host
            log.warning("same-host copies with %s are off, NIXL moves its bytes: %s", peer, exc)
            return False
        self.stats["ipc_peers"] += 1
        return True

    def welcome(self, binding: bytes, client_agent: str) -> bytes:
        """This epoch's signature answering ``client_agent``'s hello on the connection of ``binding``
        (:meth:`~kvlc.runtime.channel.wire.Reply.welcomed`): the client knows it reached this agent."""
        return self._identity.sign(introduction(binding, client_agent, self.name, "welcome", ""))

    def keep_clients(self, clients: Iterable[ChannelClient]) -> None:
        """Connections this agent closes when it closes."""
        with self._lock:
            live = [c for c in self._res.clients if c.connected or c.sealed is None]  # drop the ones closed for good
            self._res.clients[:] = live + list(clients)

    def cancel_client(self, address: str) -> ChannelClient:
        """The one connection that carries this consumer's cancels to the producer at ``address``."""
        with self._lock:
            c = self._cancel_clients.get(address)
            if c is None:
                c = self._cancel_clients[address] = self.client(address)
                self._res.clients.append(c)
            return c

    # ------------------------------------------------------------------ sessions
    def pair_engine(self, rec: Record, direction: Direction) -> RemoteEngine:
        """The remote engine of ``rec`` as this side sees it in ``direction`` (paired once; CompatError)."""
        with self._lock:
            return self.sessions.engine(rec, direction)

    def admit(self, records: Iterable[Record], eng: RemoteEngine, load: bool) -> list[str]:
        """Refuse records that would hijack a name, end the sessions they replace (a restart) and, with
        ``load``, load their NIXL agents; returns the names of the NIXL agents loaded now."""
        records = list(records)
        with self._lock:
            self.check_open()
            for rec in records:
                for old in self.sessions.check(rec, eng):
                    self.drop_session(old, f"engine '{rec.engine_id}' rank {rec.rank} restarted "
                                           f"(epoch {rec.epoch[:8]})")
            added = []
            for rec in records if load else ():
                if rec.agent not in self.nixl.remotes:
                    self.load_remote(rec)
                    added.append(rec.agent)
            return added

    def admit_served(self, session: Session, load: bool, inbox) -> Any:
        """A peer introduced itself on a connection of this agent's server: admit its record, exchange
        staging inboxes (the inbox it gets, or None), open its ``session``; pull via push (``load``):
        this side WRITEs, so the program is bound now."""
        with self._lock:
            self.admit([session.record], session.engine, load)
            mine = self._staging_inbox_served(session, inbox)
            self.sessions.add(session)
            if load:
                self.bound_program(session.engine, [session.record.agent])
            return mine

    def _staging_inbox_served(self, s: Session, inbox):
        """Staging on: a producer that will push here gets an inbox (its chunks' slots go back to it in
        FREE notifications); a pull-via-push consumer's ``inbox`` is where this side stages its WRITEs."""
        if self.stager is None:
            return None
        if s.direction is Direction.READ:  # the peer WRITEs here
            mine = self.stager.inbox_for(s.agent)
            if mine is not None:
                self.load_remote(s.record)
            return mine
        if s.mode is ConnectionMode.PULL_VIA_PUSH and inbox is not None:
            self.stager.add_peer(s.record, inbox)
        return None

    def staging_inbox(self, peer_agent: str):
        """The staging inbox this side lends ``peer_agent`` (None: staging is off here)."""
        with self._lock:
            return None if self.stager is None else self.stager.inbox_for(peer_agent)

    def add_staging_peer(self, rec: Record, inbox) -> None:
        """Stage this side's WRITEs to ``rec``'s agent into its ``inbox`` (staging on)."""
        with self._lock:
            if self.stager is not None and inbox is not None:
                self.stager.add_peer(rec, inbox)

    def forget_peers(self, loaded: Iterable[str], given: Iterable[str]) -> None:
        """Undo a connect that failed: the staging inboxes ``given`` and the NIXL agents ``loaded``."""
        with self._lock:
            for name in given:
                if not self.sessions.live(name) and self.stager is not None:
                    self.stager.drop_peer(name)
            for name in set(loaded) | set(given):
                if not self.sessions.live(name) and self.route is not None:
                    self.route.drop(name)
            for name in loaded:
                try:
                    self.nixl.remove_remote(name)
                except NixlError:
                    pass

    def open_sessions(self, sessions: Iterable[Session]) -> None:
        """Open these sessions (the connection is made); TransferError if this agent closed meanwhile."""
        with self._lock:
            self.check_open()
            for s in sessions:
                self.sessions.add(s)

    def bound_program(self, eng: RemoteEngine, peers: Iterable[str] = ()):
        """``eng``'s program bound to both sides' storage bases (bound once, then shared). ``peers``: the NIXL
        agents a connection moves bytes with; where a GPU here copies parts to them by block ids
        (:meth:`copies_blocks`), the block tables are built now too, not in the first request."""
        with self._lock:
            bound = eng.bound(self.bases)
            if peers and self.copies_blocks(peers):
                prepare_bound(bound, blocks=True)
            return bound

    def load_remote(self, rec: Record) -> None:
        """Load ``rec``'s NIXL agent (once); HandshakeError when its metadata names another agent."""
        with self._lock:
            if rec.agent in self.nixl.remotes:
                return
            name = self.nixl.add_remote(rec.nixl_md)
            if name != rec.agent:
                self.nixl.remove_remote(name)
                raise HandshakeError(f"record says agent '{rec.agent}' but its NIXL metadata is agent '{name}'")
            if rec.notes_md is not None and self.record.notes_md is not None:  # (both sides have one)
                self._load_notes(rec)

    def _load_notes(self, rec: Record) -> None:
        """Send ``done`` to ``rec``'s notes agent from now on; where it cannot be loaded, it goes as before."""
        try:
            self.nixl.add_remote_notes(rec.agent, rec.notes_md)
        except NixlError as exc:
            log.warning("agent '%s': its notes agent was not loaded, its `done` goes with its bytes: %s",
                        rec.agent, exc)

    def drop_session(self, s: Session, why: str) -> None:
        """End a session: its in-flight transfers stop, what waited on it ends, its NIXL agent goes."""
        with self._lock:
            _replies.end_session(self, s, why)

    def warm(self, records: list[Record], mems=None) -> dict[str, str]:
        """Touch these peers' memory once (:mod:`kvlc.runtime.nixl.warmup`); problems per agent name."""
        return warm_peers(self, records, mems)

    def keep_stuck(self, handles: list) -> None:
        """NIXL handles that would not release yet: retried on every progress turn and at close."""
        with self._lock:
            self.executor.stuck.extend(handles)

    # ------------------------------------------------------------------ requests
    def submit(self, key, req: str, op: str, parts, notify: Mapping[int, Target], timeout, tag=None, *,
               staged: Mapping[int, list] | None = None, refuse: Mapping[Any, str] | None = None,
               engine: bool = True) -> Outgoing:
        """Move one request's ``parts`` (:meth:`Executor.submit`). Refused with TransferError while a request
        of this key is in flight, and with TransferError (its text) where a key of ``refuse`` ended here (a
        consumer's cancel, a lease). ``staged``: the parts to stage (peer rank → keys), where the caller
        decided already; else :meth:`staged_parts` decides now. ``engine``: the engine's own thread asks
        (it polls soon: the progress thread waits a turn)."""
        with self._lock:
            self._refuse(key, req, op, refuse)
            agents = agents_of(notify)
            staged = self.staged_parts(op, parts, agents) if staged is None else staged
            outs = self._counted([self.executor.submit(key, req, op, parts, agents, notify, timeout, tag, staged)])
            self._polled = time.monotonic() if engine else self._polled
            return outs[0]

    def submit_many(self, members, op: str, parts, notify: Mapping[int, Target], timeout,
                    refuse: Mapping[Any, str] | None = None) -> list[Outgoing]:
        """Several requests sharing their NIXL requests (:mod:`kvlc.runtime.batch`); refusals as in :meth:`submit`."""
        with self._lock:
            for m in members:
                self._refuse(m.key, m.req, op, refuse)
            outs = self._counted(self.executor.submit_many(members, op, parts, agents_of(notify), notify, timeout))
            self._polled = time.monotonic()
            return outs

    def staged_parts(self, op: str, parts, agents: Mapping[int, str]) -> dict[int, list]:
        """The one staging decision of a request: peer rank → keys of ``parts`` that go through bounce
        buffers (:meth:`~kvlc.runtime.staging.agent.Stager.pick`); empty where staging is off."""
        with self._lock:
            if self.stager is None:
                return {}
            if self.route is not None:  # same-host copies move these in one pass: never staged
                parts = {k: p for k, p in parts.items() if not self._copied(getattr(p, "key", k), len(p), agents)}
            return self.stager.pick(op, parts, agents)

    def _copied(self, pk, rows: int, agents: Mapping[int, str]) -> bool:
        return self.route.copies_part(agents[pk.peer_rank], pk.local_mem, pk.remote_mem, rows)

    def copies_each(self, requests: Iterable[Mapping], agents: Mapping[int, str]) -> bool:
        """Whether the same-host copy moves every part of each of these requests (parts as
        :meth:`submit` takes them) on its own: a batch of them then goes request by request
        (:mod:`kvlc.runtime.batch`), each copy starting as soon as its request is built."""
        with self._lock:
            return self.route is not None and all(
                self._copied(getattr(p, "key", k), len(p), agents) for parts in requests for k, p in parts.items())

    def copies_to(self, peers: Iterable[str]) -> bool:
        """Whether every one of these NIXL agents is copied to and from through its mapped memory."""
        with self._lock:
            return self.route is not None and all(p in self.route.peers for p in peers)

    def copies_blocks(self, peers: Iterable[str]) -> Callable[[Any], bool] | bool:
        """Which parts to these NIXL agents a GPU here copies by their block form
        (:attr:`~kvlc.compiler.pairing.program.Part.blocks`; its kernel reads ids, not rows): a test of a part's
        key (the route's :meth:`~kvlc.runtime.ipc.route.IpcRoute.by_blocks`) where it copies to every one of
        them (:meth:`copies_to`), else False (no part: none gets a form)."""
        if not (self.copies_to(peers) and self.route.gpu is not None):
            return False
        return lambda key: self.route.by_blocks(key.local_mem, key.remote_mem)

    def _refuse(self, key, req: str, op: str, refuse: Mapping[Any, str] | None) -> None:
        self.check_open()
        if key in self.executor.active or (op == "READ" and req in self.incoming):
            raise TransferError(f"request '{req}' is already in flight")
        for k, why in (refuse or {}).items():
            if k in self.events.ended:
                raise TransferError(why)
        self.events.ended.pop(key, None)

    def serve_pull(self, s: Session, req: str, parts, timeout: float, refuse: Mapping[Any, str]) -> Outgoing:
        """Pull via push, producer side: WRITE session ``s``'s share of ``req`` (``parts``) and tally its
        consumer's answer (refusals as in :meth:`submit`)."""
        with self._lock:
            out = self.submit(("pvp", s.conn_id, req), req, "WRITE", parts, {s.rank: Target(s.agent, s.notif_key)},
                              timeout, ("pvp", s), refuse=refuse, engine=False)
            self.tally(s.engine, req)
        served = getattr(self._frames, "served", None)
        if served is None:
            self._served()
        else:  # one of several asks read together: its step comes after the last of them
            self._frames.served = served + 1
        return out

    @contextmanager
    def serving(self):
        """The side-channel server thread handles, in this context, frames that came in together
        (:class:`~kvlc.runtime.channel.tcp.ChannelServer`): the pull requests among them take one progress step
        and one wake of the progress thread at its end, for all of them (a copy that ended inside its post is told
        done then), not one each while the next ask waits behind it."""
        self._frames.served = 0
        try:
            yield
        finally:
            served, self._frames.served = self._frames.served, None
            if served:
                self._served()

    def _served(self) -> None:
        """After pull requests were served: a copy that ended inside its post (host memory on one host) is told
        done now; the progress thread sees the rest end (no engine call follows a served ask)."""
        with self._lock:
            if self.closed:
                return
            self.advance()
        if self._res.pump is not None:
            self._res.pump.wake()

    def session_on(self, conn_id: str) -> Session | None:
        """The session introduced on side-channel connection ``conn_id`` (None: none, or it ended)."""
        with self._lock:
            return self.sessions.by_conn.get(conn_id)

    def await_pull(self, inc: Incoming) -> None:
        """Pull via push: producers move ``inc`` into this rank (the asks follow on the sender)."""
        with self._lock:
            self._refuse(("read", inc.req), inc.req, "READ", None)
            self.events.ended.pop(inc.req, None)
            self.incoming[inc.req] = inc
            self.stats["requests"] += 1

    def is_moving(self, key) -> bool:
        """Whether a request of this key is in flight here."""
        with self._lock:
            return key in self.executor.active

    def ended(self, key) -> Status | None:
        """How the request of ``key`` ended here (None: not ended, or long forgotten)."""
        with self._lock:
            return self.events.ended.get(key)

    def _counted(self, outs: list[Outgoing]) -> list[Outgoing]:
        self.stats["requests"] += len(outs)
        self.stats["bytes"] += sum(o.nbytes for o in outs)
        self.stats["descriptors"] += sum(o.rows for o in outs)
        copied = sum(isinstance(r.xfer, IpcXfer) for r in outs[0].parts)  # a batch shares its parts
        self.stats["nixl_requests"] += sum(r.xfer is not None for r in outs[0].parts) - copied
        self.stats["ipc_requests"] += len(outs) if copied else 0
        self.stats["ipc_copies"] += copied
        return outs

    def tally(self, engine: RemoteEngine, req: str) -> Tally:
        """Producer: which consumer ranks of ``engine`` are done with ``req`` (started with its lease)."""
        with self._lock:
            key = (engine.key, req)
            t = self.tallies.get(key)
            if t is None:
                until = self.offers.pop(req, time.monotonic() + self.lease)
                t = self.tallies[key] = Tally(req, engine, until)
            return t

    def consumer_answered(self, engine: RemoteEngine, req: str, rank: int, status: Status, why: str = "") -> None:
        """Producer: consumer ``rank`` of ``engine`` ended ``req`` (``status``); report it once all did."""
        with self._lock:
            key = (engine.key, req)
            if key in self.events.ended:
                return
            t = self.tally(engine, req)
            t.add(rank, status, why)
            if t.complete:
                del self.tallies[key]
                why = t.reason()
                self.events.emit(Event.FAILED if why else Event.FINISHED, t.req, why)
                self.events.emit(Event.FREEABLE, t.req)
                self.events.end(key, Status.FAILED if why else Status.DONE)

    def expect(self, request_id: str, timeout: float | None = None, producer: str | None = None) -> None:
        """Consumer in push mode: the request must land within ``timeout``; else it is held, the producers
        are asked to cancel, and it fails once every one answered (its blocks safe then).

        ``producer``: the engine id of the engine that pushes it. Only that engine's sessions can then
        end it (``done``/``failed``) or have a staged chunk of it scattered; another engine's are
        dropped, logged and counted (``stats["dropped_notifs"]``, ``stats["fenced_chunks"]``), also
        answers that came before this call (a request another engine ended before it is opened again;
        poll() may have shown that end if it ran in between: expect before asking the producer). Without it the request is bound to the first engine that
        answers, so a holder of the secret could end it first: name the producer where it is known."""
        check_request_id(request_id)
        timeout = request_timeout(timeout, self.timeout)
        with self._lock:
            deadline = time.monotonic() + timeout
            inc = self.incoming.get(request_id)
            if inc is None:
                if request_id not in self.events.ended or self._reopened(request_id, producer):
                    self.incoming[request_id] = Incoming(request_id, deadline, producer=producer)
                return
            inc.deadline = deadline
            if producer is None or inc.via or inc.producer == producer:
                return
            if inc.engine is not None and inc.engine.engine_id != producer:  # another engine answered first
                log.warning("request %r: %d answer(s) from engine %r dropped; it is expected from %r",
                            request_id[:40], len(inc.answers), inc.engine.engine_id, producer)
                self.stats["dropped_notifs"] += len(inc.answers)
                inc = self.incoming[request_id] = Incoming(request_id, deadline)
            inc.producer = producer

    def _reopened(self, req: str, producer: str | None) -> bool:
        """``req`` ended here before it was expected, on answers of an engine other than ``producer``:
        that end is dropped (and its events, where poll() has not reported them yet); True then."""
        by = self.events.ended.get(("unasked", req))
        if producer is None or by is None or by == producer:
            return False
        log.warning("request %r: its end by engine %r before it was expected is dropped; it is expected from %r",
                    req[:40], by, producer)
        self.stats["dropped_notifs"] += 1
        self.events.ended.pop(req, None)
        self.events.ended.pop(("unasked", req), None)
        self.events.retract(req)
        return True

    def offer(self, request_id: str, lease: float | None = None) -> None:
        """Producer: request ``request_id``'s source blocks wait for consumers; if none finished with them
        within ``lease`` seconds (default: the agent's), poll() reports them freeable."""
        check_request_id(request_id)
        with self._lock:
            self.offers[request_id] = time.monotonic() + (self.lease if lease is None else lease)

    def cancel(self, request_id: str) -> None:
        """Stop a request: what this side moves is given up; what remote ranks move is cancelled there.
        The request is reported held, then failed once no byte can land (or finished if it already had)."""
        with self._lock:
            for key in (("read", request_id), ("write", request_id)):
                held = key in self.executor.active and not self.cancel_own(key, "cancelled by this engine")
                if held and not self.executor.active[key].held:
                    self.executor.active[key].held = True
                    self.events.emit(Event.HELD, request_id, "cancelled; a part is still in flight")
            inc = self.incoming.get(request_id)
            if inc is not None:
                _replies.hold_and_cancel(self, inc, "cancelled by this engine")

    def cancel_own(self, key, why: str) -> bool:
        """Stop a request this side moves: True when it ended now, False while it is held (a part in
        flight until NIXL ends it; a later progress turn reports it) or unknown."""
        with self._lock:
            out = self.executor.cancel(key, why)
            if out is not None:
                self.report(out)
            return out is not None

    def cancel_served(self, key, s: Session, req: str, push: bool = False) -> Status:
        """Answer session ``s``'s cancel of ``req``, served here under ``key`` (see :mod:`kvlc.runtime.server`);
        ``push``: only if ``s`` receives that request. Unknown requests are refused for good (a tombstone)."""
        with self._lock:
            self.check_open()
            out = self.executor.active.get(key)
            if push and out is not None and not any(t.key == s.notif_key for t in out.notify.values()):
                key = out = None  # a request of that id, but not one this session receives
            if out is not None:
                out = self.executor.cancel(key, f"cancelled by consumer rank {s.rank}")
                if out is None:
                    return Status.PENDING
                self.report(out)
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
    _heard = float("-inf")  # when a pump last fetched a NIXL notification (monotonic s)
    channels_looked = float("-inf")  # when the asked pulls' side channels were last looked at (replies.sever_turn)
    PUMP_SKIP_S = 0.001  # the progress thread skips a turn when the engine was this recently active
    PUMP_BUSY_S = 0.00005  # its interval while staged chunks are in flight (each waits on a turn here)
    PUMP_HEARD_S = 0.005  # for this long after a notification came, the thread comes every PUMP_HEARD_EVERY_S
    PUMP_HEARD_EVERY_S = 0.0002

    def _hot(self) -> bool | float:
        """How soon the progress thread should come back: True (every :attr:`PUMP_BUSY_S`) while staged
        chunks, same-host copies or WRITEs served for a pull-via-push consumer are in flight;
        :attr:`PUMP_HEARD_EVERY_S` within :attr:`PUMP_HEARD_S` of a notification (a peer's next WRITE waits on this side: NIXL's UCX WRITE ends with a flush of its endpoint, which
        waits until this side's worker took the notification sent on it before); else False (the interval)."""
        if self.stager is not None and self.stager.endpoint.hot:
            return True
        if self.route is not None and self.route.in_flight:  # a copy's end: seen within PUMP_BUSY_S
            return True
        if any(k[0] == "pvp" for k in tuple(self.executor.active)):  # a copy of the keys: no lock held here
            return True  # WRITEs a pull-via-push consumer asked for: it hears done once this side sees them end
        return self.PUMP_HEARD_EVERY_S if time.monotonic() - self._heard < self.PUMP_HEARD_S else False

    def progress_turn(self) -> bool | float:
        """The progress thread's turn: fills gaps between the engine's polls, never waits for the engine's lock.

        Returns how soon it should come back (:meth:`_hot`): while a peer may be waiting on this side's
        turns (a chunk's scatter, its FREE, the next chunk's WRITE, a peer's next request, the end of a
        same-host copy or of a WRITE a pull-via-push consumer asked for, who waits on this side to hear
        ``done``) it comes at that cadence. An engine poll does what a turn does, so a turn is skipped
        within one cadence of the engine's last poll (:attr:`PUMP_SKIP_S` when nothing waits on this
        side): an engine that polls that often leaves no gap to fill, and a turn then only contends for
        the agent's lock and the GIL (run 12: 30-50 µs of a 4k same-host request)."""
        hot = self._hot()
        cadence = self.PUMP_SKIP_S if hot is False else self.PUMP_BUSY_S if hot is True else hot
        if time.monotonic() - self._polled < cadence or not self._lock.acquire(blocking=False):
            return hot
        try:
            if not self.closed:
                self._pump()
        finally:
            self._lock.release()
        return self._hot()

    def _pump(self) -> None:
        self.advance()
        got = self.nixl.notifs()
        if any(got.values()):
            self._heard = time.monotonic()
        if self._res.bells:
            self._take_bells(got)
        if self.route is not None:
            self.stats["bell_rung"] = self.route.rung
            self.stats["ipc_block_copies"] = self.route.block_copies
            self.stats["ipc_engine_copies"] = self.route.engine_copies
        notes = getattr(self.nixl, "notes", None)
        if notes is not None:  # `done` sent and taken through the notes agent (kvlc.runtime.nixl.notes)
            self.stats["notes_sent"], self.stats["notes_taken"] = notes.sent, notes.taken
        _replies.notifs(self, got)
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
        _replies.sever_turn(self)
        for key, t in list(self.tallies.items()):
            if now >= t.lease_until:
                del self.tallies[key]
                self.events.emit(Event.FREEABLE, t.req)
                self.events.end(("lease", t.engine.key, t.req), Status.FAILED)
        for req, until in list(self.offers.items()):
            if now >= until:
                del self.offers[req]
                self.events.emit(Event.FREEABLE, req)

    def advance(self) -> None:
        """Advance the transfers this side moves; report those that ended."""
        with self._lock:
            for out in self.executor.progress():
                self.report(out)

    def report(self, out: Outgoing) -> None:
        """A request this side moved ended (done or failed): tell poll(), and a tally its consumer's share."""
        status = Status.DONE if out.status == "done" else Status.FAILED
        with self._lock:
            self.events.end(out.key, status)
            if self.retiring:
                _replies.revoke_retired(self)
            if out.key[0] == "pvp":  # producer share of a pull-via-push request
                s = out.tag[1]
                if (s.engine.key, out.req) in self.tallies:
                    self.consumer_answered(s.engine, out.req, s.rank, status, out.reason)
                return
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
    def check_open(self) -> None:
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
                self.report(out)
        self._finalizer()

    def __enter__(self) -> KvAgent:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
