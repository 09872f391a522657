"""KvAgent: one engine rank's KV cache, registered with NIXL, connected to the ranks of a peer engine.

Roles follow the pairing (:func:`kvlc.compiler.pair.pair`): the **consumer**
receives bytes, the **producer** sends them. Three ways to move a request:

``pull``          the consumer connects with ``direction="READ"`` and calls
                  :meth:`Peer.read`: it READs from every producer rank it pairs with,
                  then notifies each of them.
``push``          the producer connects with ``direction="WRITE"`` and calls
                  :meth:`Peer.write`: it WRITEs to every consumer rank it pairs with,
                  then notifies each of them.
``pull_via_push`` the consumer connects with ``direction="READ", mode="pull_via_push"``
                  and calls :meth:`Peer.read`: its block ids travel over the side channel
                  to each producer rank, which WRITEs and then notifies it. Use it where
                  WRITE is the fast path (one GPU node: cuda_ipc push vs emulated pull).

Every side calls :meth:`KvAgent.poll` in its loop; it never blocks and returns
:class:`Completions`: requests finished, requests failed (with the reason), and,
on a producer, requests whose source blocks no consumer rank will read any more.
Between polls a small kvlc thread keeps NIXL progressing (``progress="thread"``):
a producer that is only read from must still drive its UCX worker.

Example (two processes; see ``kvlc.runtime.demo`` for a runnable one)::

    producer = KvAgent(plan_p, 0, tensors_p); addr = producer.serve()
    consumer = KvAgent(plan_c, 0, tensors_c)
    peer = consumer.connect(addr, direction="READ")          # CompatError here, not per request
    peer.read("req-1", {"full": [3, 4]}, {"full": [7, 9]}, num_tokens=20)
    while "req-1" not in consumer.poll().finished: ...
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvlc.compiler.pair import TransferProgram, pair
from kvlc.compiler.plan import Plan
from kvlc.errors import KvlcError, TransferError
from kvlc.runtime.binding import Bound, bind
from kvlc.runtime.channel import ChannelClient, ChannelServer
from kvlc.runtime.errors import ChannelError, HandshakeError, NixlError
from kvlc.runtime.nixl import Agent
from kvlc.runtime.transfer import Executor, Outgoing, PreparedPart, Tally
from kvlc.runtime.wire import (
    Fetch,
    Introduce,
    PullRequest,
    Record,
    Reply,
    StorageBase,
    decode,
    decode_notif,
    encode,
    make_record,
)

log = logging.getLogger("kvlc.runtime.agent")

DEFAULT_TIMEOUT_S = 60.0
_NAME_OK = re.compile(r"^[A-Za-z0-9_.:@\-]{1,128}$")
_REQ_OK = re.compile(r"^[\x21-\x7e]{1,128}$")
_FORGET = 1 << 16  # how many finished request keys to remember (late notifications are ignored)


@dataclass(frozen=True)
class Completions:
    """What :meth:`KvAgent.poll` found since the previous call.

    ``finished``: requests that completed (consumer: every byte landed and every
    producer rank is done; producer: every consumer rank reported done).
    ``failed``: request id → reason. ``freeable``: producer side, requests whose
    source blocks no consumer rank will read any more (done or failed).
    """

    finished: tuple[str, ...] = ()
    failed: Mapping[str, str] = field(default_factory=dict)
    freeable: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.finished or self.failed or self.freeable)


@dataclass
class _Engine:
    """A remote engine (one plan) as this agent sees it: the program and its ranks' records."""

    plan: Plan
    program: TransferProgram
    records: dict[int, Record] = field(default_factory=dict)
    _bound: Any = None

    def set_record(self, rank: int, rec: Record) -> None:
        self.records[rank] = rec
        self._bound = None

    def bound(self, local_bases: Mapping[str, tuple[int, int]]):
        """The program with every storage base fixed (bound again after a rank's record changes).

        Ranks that have not introduced themselves yet get placeholder bases; the caller keeps
        only the parts of ranks it knows.
        """
        if self._bound is None:
            placeholder = {s.name: (0, s.device) for s in self.plan.storages}
            known = self.records
            remote = {r: (known[r].bases() if r in known else placeholder) for r in self.expected}
            self._bound = self.program.bind(local_bases, remote)
        return self._bound

    @property
    def role(self) -> str:
        return "consumer" if self.program.direction == "READ" else "producer"

    @property
    def expected(self) -> frozenset[int]:
        return frozenset(self.program.peer_ranks)


def _valid_name(name: str) -> str:
    if not _NAME_OK.match(name):
        raise KvlcError(f"agent name {name!r}: use 1-128 characters of A-Z a-z 0-9 _ . : @ -")
    return name


def _check_req(req: str) -> str:
    if not isinstance(req, str) or not _REQ_OK.match(req):
        raise TransferError(f"request id {req!r:.40}: use 1-128 printable ASCII characters without spaces")
    return req


def _ids(block_ids: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
    return {str(g): tuple(np.asarray(ids, dtype=np.int64).ravel().tolist()) for g, ids in block_ids.items()}


class KvAgent:
    """One rank of one engine: bound tensors, one NIXL registration per storage, a side channel.

    ``timeout``: default seconds per request. ``progress`` says who drives NIXL (UCX may need the
    *target* side's worker to progress, e.g. a producer that is only read from):

    * ``"thread"`` (default): a kvlc thread advances transfers and collects notifications every
      ``progress_interval`` seconds (sleeping in between); :meth:`poll` returns what it found.
    * ``"nixl"``: NIXL's own progress thread (lowest latency; busy-polls a core per agent).
    * ``"manual"``: only :meth:`poll` advances anything; the engine must poll in its loop.

    ``agent_factory`` (tests only) builds the NIXL agent wrapper from a name.
    """

    def __init__(
        self,
        plan: Plan,
        rank: int,
        tensors: Mapping[str, Any],
        *,
        name: str | None = None,
        backends: Sequence[str] = ("UCX",),
        timeout: float = DEFAULT_TIMEOUT_S,
        telemetry: bool = False,
        progress: str = "thread",
        progress_interval: float = 0.001,
        agent_factory: Callable[[str], Any] | None = None,
    ):
        if progress not in ("thread", "nixl", "manual"):
            raise KvlcError(f"progress {progress!r}: use 'thread', 'nixl' or 'manual'")
        tp = plan.parallel.tp_size
        if not 0 <= rank < tp:
            raise KvlcError(f"rank {rank} outside plan '{plan.name}' (tp_size {tp}); use 0..{tp - 1}")
        self.plan = plan
        self.rank = rank
        self.timeout = timeout
        self.bindings: dict[str, Bound] = bind(plan, tensors)
        default = re.sub(r"[^A-Za-z0-9_.\-]", "_", plan.name)[:80]
        self.name = _valid_name(name or f"kvlc-{default}-r{rank}-{uuid.uuid4().hex[:8]}")
        self._lock = threading.RLock()
        self.closed = False
        self.nixl = (
            agent_factory
            or (lambda n: Agent(n, backends, telemetry=telemetry, progress_thread=progress == "nixl"))
        )(self.name)
        self._regs = []
        try:
            for b in self.bindings.values():
                self._regs.append(self.nixl.register(b.row(), b.mem, what=f"storage '{b.name}'"))
            self.record = make_record(
                self.name,
                self.nixl.metadata(),
                plan,
                rank,
                [
                    StorageBase(name=b.name, addr=b.addr, size=b.nbytes, mem=b.mem, device=b.device)
                    for b in self.bindings.values()
                ],
            )
        except BaseException:
            self.nixl.close()
            raise
        self.bases = {b.name: (b.addr, b.device) for b in self.bindings.values()}
        self.executor = Executor(self.nixl, rank)
        # Remote engines are keyed by (plan digest, this side's direction); tallies by (engine key, request).
        self._engines: dict[tuple[str, str], _Engine] = {}
        self._agents: dict[str, tuple[tuple[str, str], int]] = {}  # remote agent name → (engine key, rank)
        self._pull_peers: set[str] = set()  # consumer agents that may send pull requests
        self._tallies: dict[tuple[str, str], Tally] = {}
        self._gone: OrderedDict = OrderedDict()  # finished tally keys, to ignore late notifications
        self._events: list[tuple[str, str, str]] = []  # (kind, req, reason)
        self._server: ChannelServer | None = None
        self._peers: list[Peer] = []
        self.stats = {"dropped_notifs": 0, "requests": 0, "bytes": 0, "descriptors": 0}
        self._progress: threading.Thread | None = None
        if progress == "thread":
            self._progress = threading.Thread(
                target=self._progress_loop,
                args=(progress_interval,),
                name=f"kvlc-progress-{self.name}",
                daemon=True,
            )
            self._progress.start()

    def _progress_loop(self, interval: float) -> None:
        while not self.closed:
            try:
                with self._lock:
                    if not self.closed:
                        self._pump()
            except Exception:  # keep progressing; poll() surfaces real failures
                log.exception("progress thread")
                time.sleep(0.1)
            time.sleep(interval)

    # ------------------------------------------------------------------ side channel
    def serve(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Start this agent's side-channel server; returns its ``host:port``."""
        with self._lock:
            self._check_open()
            if self._server is None:
                self._server = ChannelServer(
                    self._handle, lambda text: encode(Reply(ok=False, error=text[:4000])), host, port
                )
            h, p = self._server.address
            return f"{h}:{p}"

    @property
    def address(self) -> str | None:
        if self._server is None:
            return None
        h, p = self._server.address
        return f"{h}:{p}"

    def _handle(self, frame: bytes) -> bytes:
        """Serve one side-channel frame (server thread). Never raises for bad input."""
        try:
            msg = decode(frame)
        except HandshakeError as exc:
            return encode(Reply(ok=False, error=str(exc)[:4000]))
        try:
            if isinstance(msg, Fetch):
                return encode(self.record)
            if isinstance(msg, Introduce):
                self._introduced(msg)
                return encode(Reply(ok=True))
            if isinstance(msg, PullRequest):
                self._pull_request(msg)
                return encode(Reply(ok=True))
            return encode(Reply(ok=False, error=f"unexpected '{msg.t}' message on a server"))
        except KvlcError as exc:
            return encode(Reply(ok=False, error=str(exc)[:4000]))

    def _engine_for(self, plan: Plan, direction: str) -> tuple[tuple[str, str], _Engine]:
        ekey = (plan.digest, direction)
        eng = self._engines.get(ekey)
        if eng is None:
            eng = _Engine(plan, pair(self.plan, plan, local_rank=self.rank, direction=direction))
            self._engines[ekey] = eng
        return ekey, eng

    def _introduced(self, msg: Introduce) -> None:
        """A peer connected to us: pair from our side and learn its rank (server thread)."""
        rec = msg.record
        mine = "WRITE" if msg.direction == "READ" else "READ"
        if msg.mode == "pull_via_push" and msg.direction != "READ":
            raise HandshakeError("pull_via_push is a consumer's mode: the introducing agent must READ")
        with self._lock:
            self._check_open()
            if rec.agent == self.name:
                raise HandshakeError(f"agent name '{rec.agent}' is this agent's own name")
            ekey, eng = self._engine_for(rec.plan, mine)
            known = self._agents.get(rec.agent)
            if known is not None and known != (ekey, rec.rank):
                raise HandshakeError(
                    f"agent '{rec.agent}' is already known as rank {known[1]} of another pairing"
                )
            if rec.rank not in eng.expected:
                raise HandshakeError(
                    f"rank {rec.rank} of '{rec.plan.name}' does not exchange bytes with rank "
                    f"{self.rank} of '{self.plan.name}' (peers of this rank: "
                    f"{sorted(eng.expected)})"
                )
            old = eng.records.get(rec.rank)
            if (
                old is not None
                and old.agent == rec.agent
                and old.nixl_md != rec.nixl_md
                and rec.agent in self.nixl.remotes
            ):
                self.nixl.remove_remote(rec.agent)  # the peer restarted under the same name
            if msg.mode == "pull_via_push" and rec.agent not in self.nixl.remotes:
                name = self.nixl.add_remote(rec.nixl_md)
                if name != rec.agent:
                    self.nixl.remove_remote(name)
                    raise HandshakeError(
                        f"record says agent '{rec.agent}' but its NIXL metadata is agent '{name}'"
                    )
            if msg.mode == "pull_via_push":
                self._pull_peers.add(rec.agent)
            eng.set_record(rec.rank, rec)
            self._agents[rec.agent] = (ekey, rec.rank)

    def _pull_request(self, msg: PullRequest) -> None:
        """Pull via push, producer side: WRITE one consumer rank's share of a request (server thread)."""
        with self._lock:
            self._check_open()
            _check_req(msg.req)
            if msg.agent not in self._pull_peers:
                raise HandshakeError(f"agent '{msg.agent}' has not connected in pull_via_push mode")
            ekey, rank = self._agents[msg.agent]
            if rank != msg.rank:
                raise HandshakeError(f"agent '{msg.agent}' is rank {rank}, not {msg.rank}")
            eng = self._engines[ekey]
            key = ("pull", ekey, msg.req, rank)
            if key in self.executor.active:
                raise TransferError(f"request '{msg.req}' from rank {rank} is already in flight")
            parts = eng.bound(self.bases).instantiate(
                msg.producer_blocks, msg.consumer_blocks, msg.num_tokens
            )
            parts = {k: p for k, p in parts.items() if k.peer_rank == rank}  # this consumer rank's share
            timeout = msg.timeout_s or self.timeout
            self._submit(key, msg.req, "WRITE", parts, {rank: msg.agent}, timeout, tag=("pull", ekey))
            tkey = (ekey, msg.req)
            self._gone.pop(tkey, None)
            self._tallies.setdefault(tkey, Tally(msg.req, eng.expected, time.monotonic() + timeout))

    # ------------------------------------------------------------------ connect
    def connect(
        self,
        *addresses: str | tuple[str, int],
        direction: str = "READ",
        mode: str = "direct",
        timeout: float = 10.0,
    ) -> Peer:
        """Connect to the ranks of a remote engine (one side-channel address per rank).

        Fetches and checks every record, pairs the plans (:class:`CompatError` here),
        checks that every rank this rank exchanges bytes with is among ``addresses``,
        adds those NIXL agents (direct mode) and introduces itself to them.
        """
        if direction not in ("READ", "WRITE"):
            raise KvlcError(
                f"direction {direction!r}: use 'READ' (this side consumes) or 'WRITE' (it produces)"
            )
        if mode not in ("direct", "prepped", "pull_via_push"):
            raise KvlcError(f"mode {mode!r}: use 'direct', 'prepped' or 'pull_via_push'")
        if mode == "pull_via_push" and direction != "READ":
            raise KvlcError("mode 'pull_via_push' is for a consumer: use direction='READ'")
        if not addresses:
            raise KvlcError("connect needs the side-channel address of every remote rank to pair with")
        self._check_open()
        clients, records = {}, {}
        try:
            for addr in addresses:
                client = ChannelClient(addr, timeout=timeout)
                reply = decode(client.request(encode(Fetch())))
                if isinstance(reply, Reply):
                    raise HandshakeError(
                        f"{client.address[0]}:{client.address[1]} refused to send its record: {reply.error}"
                    )
                if not isinstance(reply, Record):
                    raise HandshakeError(
                        f"{client.address[0]}:{client.address[1]} answered with a "
                        f"'{reply.t}' message, not a record"
                    )
                if reply.rank in records:
                    raise HandshakeError(
                        f"two addresses serve rank {reply.rank} ({records[reply.rank].agent} and "
                        f"{reply.agent})"
                    )
                if records and reply.plan_digest != next(iter(records.values())).plan_digest:
                    raise HandshakeError(
                        f"rank {reply.rank} at {addr} runs another plan than the other addresses "
                        f"(digest {reply.plan_digest[:12]})"
                    )
                records[reply.rank], clients[reply.rank] = reply, client
            plan = next(iter(records.values())).plan
            program = pair(self.plan, plan, local_rank=self.rank, direction=direction)
            missing = sorted(set(program.peer_ranks) - set(records))
            if missing:
                raise HandshakeError(
                    f"rank {self.rank} exchanges bytes with ranks {list(program.peer_ranks)} of "
                    f"'{plan.name}', but no address serves rank(s) {missing}"
                )
            peer = self._attach(plan, program, records, clients, direction, mode)
            if mode == "prepped":  # prepare the strided lists now: NIXL problems surface at connect
                with self._lock:
                    try:
                        peer._prepared(peer.engine.bound(self.bases))
                    except BaseException:
                        peer.close()
                        raise
            return peer
        except BaseException:
            for c in clients.values():
                c.close()
            raise

    def _attach(self, plan, program, records, clients, direction, mode) -> Peer:
        """Add the peers' NIXL agents (direct mode), introduce ourselves, then record the engine.

        The lock is not held while waiting on the network: two agents may connect to each other at once.
        """
        peers = program.peer_ranks
        added = []
        try:
            if mode in ("direct", "prepped"):
                with self._lock:
                    self._check_open()
                    for r in peers:
                        rec = records[r]
                        if rec.agent in self.nixl.remotes:
                            continue
                        name = self.nixl.add_remote(rec.nixl_md)
                        added.append(name)
                        if name != rec.agent:
                            raise HandshakeError(
                                f"record says agent '{rec.agent}' but its NIXL metadata is agent '{name}'"
                            )
            # on the wire "prepped" is "direct": this side moves the bytes either way
            wire_mode = "pull_via_push" if mode == "pull_via_push" else "direct"
            hello = encode(Introduce(record=self.record, direction=direction, mode=wire_mode))
            for r in peers:
                reply = decode(clients[r].request(hello))
                if not isinstance(reply, Reply) or not reply.ok:
                    why = reply.error if isinstance(reply, Reply) else f"a '{reply.t}' message"
                    raise HandshakeError(f"rank {r} ({records[r].agent}) refused this agent: {why}")
        except BaseException:
            with self._lock:
                for name in added:
                    try:
                        self.nixl.remove_remote(name)
                    except NixlError:
                        pass
            raise
        with self._lock:
            self._check_open()
            ekey = (plan.digest, direction)
            eng = self._engines.setdefault(ekey, _Engine(plan, program))   # may know ranks that introduced
            for r in peers:
                eng.set_record(r, records[r])
                self._agents[records[r].agent] = (ekey, r)
            for r, c in clients.items():
                if r not in peers:
                    c.close()
            peer = Peer(self, ekey, eng, {r: clients[r] for r in peers}, direction, mode)
            self._peers.append(peer)
            return peer

    # ------------------------------------------------------------------ requests
    def _submit(
        self, key, req: str, op: str, parts, agents: Mapping[int, str], timeout: float | None, tag=None
    ) -> Outgoing:
        out = self.executor.submit(key, req, op, parts, agents, agents, timeout, tag)
        self.stats["requests"] += 1
        self.stats["bytes"] += out.nbytes
        self.stats["descriptors"] += out.rows
        return out

    def expect(self, request_id: str, timeout: float | None = None) -> None:
        """Consumer in push mode: fail ``request_id`` if its notifications do not all arrive in time."""
        with self._lock:
            deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
            for (_, req), t in self._tallies.items():
                if req == request_id:
                    t.deadline = deadline
                    return
            self._tallies[("", request_id)] = Tally(request_id, frozenset(), deadline)

    # ------------------------------------------------------------------ completion
    def poll(self) -> Completions:
        """Advance transfers, read notifications, apply timeouts; never blocks. Returns what happened
        since the previous call (also what the progress thread found meanwhile)."""
        with self._lock:
            if not self.closed:
                self._pump()
            return self._drain()

    def _pump(self) -> None:
        """Advance transfers, read notifications, apply deadlines (caller holds the lock)."""
        for out in self.executor.progress():
            self._outgoing_done(out)
        for sender, msgs in self.nixl.notifs().items():
            for m in msgs:
                self._notif(sender, m)
        now = time.monotonic()
        for key, t in list(self._tallies.items()):
            if t.deadline is not None and now >= t.deadline and not t.complete:
                missing = t.missing() if t.expected else "every rank"
                t.refused.update({r: "timed out" for r in t.missing()})
                self._tally_done(key, t, f"timed out waiting for notifications from {missing}")

    def _drain(self) -> Completions:
        finished, failed, freeable = [], {}, []
        for kind, req, why in self._events:
            if kind == "finished":
                finished.append(req)
            elif kind == "failed":
                failed[req] = why
            else:
                freeable.append(req)
        self._events.clear()
        return Completions(tuple(finished), failed, tuple(freeable))

    def _outgoing_done(self, out: Outgoing) -> None:
        if out.status != "done":
            log.warning("request %s failed: %s", out.req, out.reason)
        tag = out.tag or ("direct", "")
        if tag[0] == "pull":  # producer share of a pull-via-push request
            ekey = tag[1]
            eng = self._engines[ekey]
            key = (ekey, out.req)
            if key in self._gone:
                return
            t = self._tallies.setdefault(key, Tally(out.req, eng.expected))
            rank = out.key[3]
            t.add(rank, "done" if out.status == "done" else "failed", out.reason)
            if t.complete:
                self._tally_done(key, t, t.reason)
            return
        if out.status == "done":
            self._events.append(("finished", out.req, ""))
        else:
            self._events.append(("failed", out.req, out.reason))
        if out.op == "WRITE":
            self._events.append(("freeable", out.req, ""))

    def _notif(self, sender: str, message: bytes) -> None:
        who = self._agents.get(sender)
        if who is None:
            self.stats["dropped_notifs"] += 1
            log.warning("notification from unknown agent %r dropped", sender[:64])
            return
        try:
            n = decode_notif(message)
        except HandshakeError as exc:
            self.stats["dropped_notifs"] += 1
            log.warning("notification from %r dropped: %s", sender, exc)
            return
        ekey, rank = who
        if n.rank != rank:
            self.stats["dropped_notifs"] += 1
            log.warning("notification from %r claims rank %d, but the agent is rank %d", sender, n.rank, rank)
            return
        key = (ekey, n.req)
        if key in self._gone:
            return
        eng = self._engines[ekey]
        t = self._tallies.get(key)
        if t is None:
            t = self._tallies.pop(("", n.req), None)  # registered by expect() before we knew the engine
            t = Tally(n.req, eng.expected, t.deadline if t else None)
            self._tallies[key] = t
        elif not t.expected:
            t.expected = eng.expected
        t.add(rank, n.status, n.why)
        if t.complete:
            self._tally_done(key, t, t.reason)

    def _tally_done(self, key, t: Tally, reason: str) -> None:
        self._tallies.pop(key, None)
        self._gone[key] = None
        while len(self._gone) > _FORGET:
            self._gone.popitem(last=False)
        eng = self._engines.get(key[0])
        if reason:
            self._events.append(("failed", t.req, reason))
        else:
            self._events.append(("finished", t.req, ""))
        if eng is not None and eng.role == "producer":
            self._events.append(("freeable", t.req, ""))

    def wait(
        self, request_ids: Iterable[str], timeout: float | None = None, interval: float = 0.0005
    ) -> Completions:
        """Poll until every id has finished or failed (tests, demos); other events are kept too."""
        want = set(request_ids)
        finished, failed, freeable = [], {}, []
        deadline = None if timeout is None else time.monotonic() + timeout
        while want:
            c = self.poll()
            finished += c.finished
            failed.update(c.failed)
            freeable += c.freeable
            want -= set(c.finished) | set(c.failed)
            if want and deadline is not None and time.monotonic() > deadline:
                raise TransferError(
                    f"wait: {len(want)} request(s) still open after {timeout}s: {sorted(want)[:5]}"
                )
            if want and not c:
                time.sleep(interval)
        return Completions(tuple(finished), failed, tuple(freeable))

    @property
    def in_flight(self) -> int:
        return len(self.executor.active)

    # ------------------------------------------------------------------ lifetime
    def _check_open(self) -> None:
        if self.closed:
            raise TransferError(f"agent '{self.name}' is closed")

    def close(self) -> None:
        """Stop serving, cancel and release in-flight transfers, deregister memory (idempotent)."""
        server = None
        with self._lock:
            if self.closed:
                return
            self.closed = True
            server, self._server = self._server, None
        if server is not None:
            server.close()
        if self._progress is not None and self._progress is not threading.current_thread():
            self._progress.join(timeout=5)
        with self._lock:
            for out in self.executor.cancel_all(f"agent '{self.name}' closed"):
                self._outgoing_done(out)
            for p in self._peers:
                p._close_clients()
            problems = self.nixl.close()
            for p in problems:
                log.warning("close: %s", p)

    def __enter__(self) -> KvAgent:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            if not self.closed:
                self.close()
        except Exception:
            pass


class Peer:
    """This agent's connection to the ranks of one remote engine (see :meth:`KvAgent.connect`)."""

    def __init__(
        self,
        agent: KvAgent,
        ekey: tuple[str, str],
        engine: _Engine,
        clients: dict[int, ChannelClient],
        direction: str,
        mode: str,
    ):
        self.agent = agent
        self._ekey = ekey
        self.engine = engine
        self.program: TransferProgram = engine.program
        self.direction = direction
        self.mode = mode
        self._clients = clients
        self._lists: dict | None = None  # mode "prepped": PartKey -> (local Prepped, remote Prepped)

    @property
    def peer_ranks(self) -> tuple[int, ...]:
        return self.program.peer_ranks

    @property
    def records(self) -> dict[int, Record]:
        return dict(self.engine.records)

    def _agents(self) -> dict[int, str]:
        return {r: self.engine.records[r].agent for r in self.peer_ranks}

    def _instantiate(self, local_block_ids, remote_block_ids, num_tokens):
        bound = self.engine.bound(self.agent.bases)
        if self.mode != "prepped":
            return bound.instantiate(local_block_ids, remote_block_ids, num_tokens)
        # whole tiles as indices into lists prepared once; a clipped last tile as rows
        req = bound.prepared_indices(local_block_ids, remote_block_ids, num_tokens)
        lists = self._prepared(bound)
        parts: dict = dict(req.tail)
        for key, (li, ri) in req.indices.items():
            local, remote = lists[key]
            parts[("prepped", key)] = PreparedPart(key, local, li, remote, ri, req.nbytes[key])
        return parts

    def _prepared(self, bound):
        """Prepare the strided lists of every part once (called under the agent's lock)."""
        if self._lists is None:
            agents = self._agents()
            lists = {}
            try:
                for key, pl in bound.prepared_rows().items():
                    local = self.agent.nixl.prep(None, pl.local, key.local_mem)
                    lists[key] = (local, None)
                    remote = self.agent.nixl.prep(agents[key.peer_rank], pl.remote, key.remote_mem)
                    lists[key] = (local, remote)
            except BaseException:
                for pair_ in lists.values():
                    for h in pair_:
                        if h is not None:
                            h.release()
                raise
            self._lists = lists
        return self._lists

    def read(
        self,
        request_id: str,
        local_block_ids: Mapping[str, Sequence[int]],
        remote_block_ids: Mapping[str, Sequence[int]],
        num_tokens: int,
        timeout: float | None = None,
    ) -> None:
        """Pull one request into this (consumer) rank's blocks. Non-blocking; see :meth:`KvAgent.poll`.

        Block ids are logical, per KV-cache group; every id is checked against
        every region's capacity before anything moves (:class:`TransferError`).
        """
        if self.direction != "READ":
            raise TransferError("read() needs a connection made with direction='READ' (this side consumes)")
        _check_req(request_id)
        a = self.agent
        timeout = a.timeout if timeout is None else timeout
        with a._lock:
            a._check_open()
            key = (self._ekey, request_id)
            if ("direct", request_id) in a.executor.active or key in a._tallies:
                raise TransferError(f"request '{request_id}' is already in flight")
            if self.mode in ("direct", "prepped"):
                parts = self._instantiate(local_block_ids, remote_block_ids, num_tokens)
                a._submit(("direct", request_id), request_id, "READ", parts, self._agents(), timeout)
                return
            # Pull via push: the producer ranks build the descriptors; here the ids are only checked.
            self.program.check_request(local_block_ids, remote_block_ids, num_tokens)
            a._gone.pop(key, None)
            tally = Tally(request_id, self.engine.expected, time.monotonic() + timeout)
            a._tallies[key] = tally
            a.stats["requests"] += 1
        msg = encode(
            PullRequest(
                req=request_id,
                agent=a.name,
                rank=a.rank,
                consumer_blocks=_ids(local_block_ids),
                producer_blocks=_ids(remote_block_ids),
                num_tokens=int(num_tokens),
                timeout_s=float(timeout),
            )
        )
        for r in self.peer_ranks:
            try:
                reply = decode(self._clients[r].request(msg))
                why = "" if isinstance(reply, Reply) and reply.ok else getattr(reply, "error", "bad reply")
            except (ChannelError, HandshakeError) as exc:
                why = str(exc)
            if why:
                with a._lock:
                    tally.refused[r] = f"refused the pull request: {why}"
                    if tally.complete and key in a._tallies:
                        a._tally_done(key, tally, tally.reason)

    def write(
        self,
        request_id: str,
        local_block_ids: Mapping[str, Sequence[int]],
        remote_block_ids: Mapping[str, Sequence[int]],
        num_tokens: int,
        timeout: float | None = None,
    ) -> None:
        """Push one request from this (producer) rank's blocks into the consumer ranks' blocks."""
        if self.direction != "WRITE":
            raise TransferError("write() needs a connection made with direction='WRITE' (this side produces)")
        _check_req(request_id)
        a = self.agent
        with a._lock:
            a._check_open()
            if ("direct", request_id) in a.executor.active:
                raise TransferError(f"request '{request_id}' is already in flight")
            parts = self._instantiate(local_block_ids, remote_block_ids, num_tokens)
            a._submit(
                ("direct", request_id),
                request_id,
                "WRITE",
                parts,
                self._agents(),
                a.timeout if timeout is None else timeout,
            )

    def _close_clients(self) -> None:
        for c in self._clients.values():
            c.close()

    def close(self) -> None:
        """Close the side-channel connections and release prepared lists (NIXL agents stay)."""
        self._close_clients()
        lists, self._lists = self._lists or {}, None
        for handles in lists.values():
            for h in handles:
                h.release()
