"""Connecting to a remote engine, and the :class:`Peer` that moves requests over that connection.

:func:`connect` fetches every remote rank's record over an authenticated connection, pairs the
plans (``CompatError`` here, not per request), checks that every rank this rank exchanges
bytes with is served, loads the NIXL agents it will initiate transfers to, introduces itself,
and opens one session per remote rank. :meth:`Peer.read` and :meth:`Peer.write` never wait on
the network: direct modes post NIXL requests; pull via push writes its ask to each producer rank
at once where the socket takes it without waiting (else the agent's background sender does), and
the sender reads the replies.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
import numpy as np

from kvlc.compiler.pairing.program import TransferProgram
from kvlc.compiler.request.check import Request, check_request
from kvlc.compiler.request.instantiate import emit, instantiate
from kvlc.compiler.request.tokens import TokenRange
from kvlc.compiler.request.prepared import prepared_indices, prepared_rows
from kvlc.errors import KvlcError, TransferError
import kvlc.runtime.batch as _batch
from kvlc.runtime.arguments import check_request_id, request_timeout
from kvlc.runtime.batch import BlockRequest
from kvlc.runtime.channel.client import ChannelClient
from kvlc.runtime.errors import HandshakeError
from kvlc.runtime.kinds import Direction, ConnectionMode
from kvlc.runtime.channel.sessions import RemoteEngine, Session
from kvlc.runtime.tracking import Incoming
from kvlc.runtime.channel.notifs import agents_of
from kvlc.runtime.transfer import Outgoing, PreparedPart, Target
from kvlc.runtime.channel.wire import MAX_PULLS, Fetch, PullRequest, Pulls, Record, Replies, Reply, decode, encode
from kvlc.runtime.pump import Combine

log = logging.getLogger(__name__)


def _split_replies(reply, n: int) -> list:
    """One answer per request of a :class:`Pulls` frame: the producer's :class:`Replies`, in order; a
    single refusal (the producer could not take the frame) answers every one."""
    if isinstance(reply, Replies) and len(reply.items) == n:
        return list(reply.items)
    if isinstance(reply, Reply) and not reply.ok:
        return [reply] * n
    return [HandshakeError(f"the producer answered {n} pull requests with one '{reply.t}' message")] * n


# pull requests queued together for one producer rank travel in one frame (one round trip)
PULLS = Combine(MAX_PULLS, encode, lambda msgs: encode(Pulls(items=tuple(msgs))), _split_replies)


def _ids(block_ids: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
    """Checked ids as the wire carries them (plain ints): one numpy pass per group (a generator converting each id
    cost 27 µs for 256 of them on this project's VM, this 9)."""
    return {str(g): tuple(np.asarray(ids, dtype=np.int64).ravel().tolist()) for g, ids in block_ids.items()}


def _wire_range(num_tokens, tokens) -> tuple[int, int]:
    """``(start, stop)`` of a checked request, as pull_via_push carries it: one range for every group."""
    if tokens is None:
        if isinstance(num_tokens, Mapping):
            raise TransferError("pull_via_push carries one token count for every group; give num_tokens=N")
        return 0, int(num_tokens)
    if isinstance(tokens, Mapping):
        raise TransferError("pull_via_push carries one token range for every group; give tokens=(start, stop)")
    if isinstance(tokens, (range, TokenRange)):
        return tokens.start, tokens.stop
    return int(tokens[0]), int(tokens[1])


def _fetch(clients: list[ChannelClient]) -> dict[int, tuple[Record, ChannelClient]]:
    out: dict[int, tuple[Record, ChannelClient]] = {}
    for client in clients:
        where = f"{client.address[0]}:{client.address[1]}"
        reply = decode(client.request(encode(Fetch())))
        if isinstance(reply, Reply):
            raise HandshakeError(f"{where} refused to send its record: {reply.error}")
        if not isinstance(reply, Record):
            raise HandshakeError(f"{where} answered with a '{reply.t}' message, not a record")
        if reply.rank in out:
            raise HandshakeError(f"two addresses serve rank {reply.rank} ({out[reply.rank][0].agent} and {reply.agent})")
        first = next(iter(out.values()), (None,))[0]
        if first is not None and (reply.plan_digest, reply.engine_id) != (first.plan_digest, first.engine_id):
            raise HandshakeError(
                f"rank {reply.rank} at {where} belongs to another engine or plan than the other addresses "
                f"(engine '{reply.engine_id}', digest {reply.plan_digest[:12]}); connect once per engine"
            )
        out[reply.rank] = (reply, client)
    return out


def connect(agent, addresses: Sequence[str], direction: str, mode: str, timeout: float, warm: bool = True) -> Peer:
    """Connect ``agent`` (a :class:`~kvlc.runtime.agent.KvAgent`) to the ranks of one remote engine
    (see the module docstring)."""
    direction, mode = _check_connect(addresses, direction, mode)
    agent.check_open()
    clients = [agent.client(a, timeout) for a in addresses]
    added: list[str] = []
    given: list[str] = []  # agents this side gave a staging inbox to
    try:
        got = _fetch(clients)
        eng = _pair(agent, got, direction)
        load = mode is not ConnectionMode.PULL_VIA_PUSH or agent.stager is not None  # (staging: FREEs go back)
        added = agent.admit([got[r][0] for r in eng.program.peer_ranks], eng, load)
        _introduce(agent, got, eng.program.peer_ranks, direction, mode, given)
        peer = _open(agent, got, eng, direction, mode)
        peer.dialled = _Dialled(tuple(addresses), timeout, warm)
        if mode is ConnectionMode.PREPPED:  # prepare the strided lists now: NIXL problems surface at connect
            peer.prepare()
        if mode is not ConnectionMode.PULL_VIA_PUSH:  # this side moves the bytes (else the producer does both)
            agent.bound_program(eng, agents_of(peer._targets()).values())  # before the first request
            if warm:
                agent.warm([got[r][0] for r in eng.program.peer_ranks])
        return peer
    except BaseException:
        agent.forget_peers(added, given)
        for c in clients:
            c.close()
        raise


def _check_connect(addresses: Sequence[str], direction: str, mode: str) -> tuple[Direction, ConnectionMode]:
    """The parsed direction and mode of a connect call, after checking they go together."""
    direction = Direction.parse(direction, "direction")
    mode = ConnectionMode.parse(mode, "mode")
    if mode is ConnectionMode.PULL_VIA_PUSH and direction is not Direction.READ:
        raise KvlcError("mode 'pull_via_push' is for a consumer: use direction='READ'")
    if not addresses:
        raise KvlcError("connect needs the side-channel address of every remote rank to pair with")
    return direction, mode


def _pair(agent, got, direction: Direction) -> RemoteEngine:
    """Pair with the remote engine (CompatError here) and check every rank it needs is served."""
    rec0 = next(iter(got.values()))[0]
    eng = agent.pair_engine(rec0, direction)
    missing = sorted(set(eng.program.peer_ranks) - set(got))
    if missing:
        raise HandshakeError(
            f"rank {agent.rank} exchanges bytes with ranks {list(eng.program.peer_ranks)} of "
            f"'{rec0.plan.name}', but no address serves rank(s) {missing}"
        )
    return eng


def _introduce(agent, got, peers, direction: Direction, mode: ConnectionMode, given: list[str]) -> None:
    """Introduce this agent to every peer rank; staging inboxes travel here (see :mod:`kvlc.runtime.server`)."""
    wire_mode = "pull_via_push" if mode is ConnectionMode.PULL_VIA_PUSH else "direct"  # prepped: direct on the wire
    for r in peers:
        rec = got[r][0]
        inbox = agent.staging_inbox(rec.agent) if mode is ConnectionMode.PULL_VIA_PUSH else None
        if inbox is not None:
            given.append(rec.agent)
        hello = encode(agent.hello(got[r][1], rec.agent, direction.value, wire_mode, inbox=inbox))
        reply = _accepted(r, rec, decode(got[r][1].request(hello)))
        if not reply.welcomed(got[r][1].sealed.binding, rec, agent.name):
            raise HandshakeError(f"rank {r} at {got[r][1].address[0]}:{got[r][1].address[1]} did not prove it holds "
                                 f"the key of the record it sent (agent '{rec.agent}'); a record served from "
                                 "elsewhere? refused")
        if direction is Direction.WRITE:
            agent.add_staging_peer(rec, reply.inbox)
        agent.map_peer(rec.agent, reply.shared)  # same host: this side copies through its memory


def _accepted(r: int, rec: Record, reply) -> Reply:
    """The reply of peer rank ``r`` to an introduction; HandshakeError where it refused."""
    if not isinstance(reply, Reply) or not reply.ok:
        why = reply.error if isinstance(reply, Reply) else f"a '{reply.t}' message"
        raise HandshakeError(f"rank {r} ({rec.agent}) refused this agent: {why}")
    return reply


def _open(agent, got, eng: RemoteEngine, direction: Direction, mode: ConnectionMode) -> Peer:
    """One session per remote rank, on the connection it was introduced on."""
    peers = eng.program.peer_ranks
    sessions = {}
    for r in peers:
        rec, client = got[r]
        sessions[r] = Session(rec, client.sealed.id, client.sealed.notif_key, direction, mode, eng)
    agent.open_sessions(sessions.values())
    for r, (_, c) in got.items():
        if r not in peers:
            c.close()
    agent.keep_clients(got[r][1] for r in peers)
    return Peer(agent, eng, sessions, {r: got[r][1] for r in peers}, direction, mode)


@dataclass(frozen=True)
class _Dialled:
    """How a peer was connected: what reconnecting it takes."""

    addresses: tuple[str, ...]
    timeout: float
    warm: bool


class Peer:
    """This agent's sessions with the ranks of one remote engine (see :func:`connect`).

    A session lost underneath it (the remote engine restarted, on the same address or not; its
    side-channel connection closed; a rank ended the session) is noticed at the next request,
    reported once (a warning, :attr:`losses`, the agent's ``sessions_lost`` count) and repaired by
    connecting again to the same addresses, under the remote engine's new epoch if it restarted;
    the request then moves. Only when reconnecting fails is the request refused.
    """

    def __init__(self, agent, engine: RemoteEngine, sessions: dict[int, Session],
                 clients: dict[int, ChannelClient], direction: Direction, mode: ConnectionMode):
        self.agent = agent
        self.engine = engine
        self.program: TransferProgram = engine.program
        self.direction, self.mode = direction, mode
        self.sessions = sessions
        self._clients = clients
        self._lists: dict | None = None  # mode "prepped": PartKey -> (local Prepped, remote Prepped)
        self._notify = {r: Target(s.agent, s.notif_key) for r, s in sessions.items()}  # fixed per connection
        self.closed = False
        self.dialled: _Dialled | None = None  # set by connect(): how to connect again
        self.losses: list[str] = []  # each session loss seen and repaired, once

    @property
    def peer_ranks(self) -> tuple[int, ...]:
        return self.program.peer_ranks

    @property
    def records(self) -> dict[int, Record]:
        return {r: s.record for r, s in self.sessions.items()}

    def _targets(self) -> dict[int, Target]:
        return self._notify

    def _live(self) -> None:
        """Before a request: the sessions are there, or are connected again (see the class docstring)."""
        self.agent.check_open()
        if self.closed:
            raise TransferError(f"connection to engine '{self.engine.engine_id}' is closed")
        why = self._lost()
        if why is not None:
            self._repair(why)

    def _lost(self) -> str | None:
        """Why these sessions cannot carry a request any more (None: they can)."""
        dead = [r for r, s in self.sessions.items() if not s.live]
        if dead:
            return f"rank(s) {dead} ended the session (restarted or went away)"
        gone = [r for r, c in self._clients.items()
                if c.lost() or c.sealed is None or c.sealed.id != self.sessions[r].conn_id]
        if gone:
            return f"the side-channel connection to rank(s) {gone} closed"
        return None

    def _repair(self, why: str) -> None:
        """End the lost sessions, connect again to the same addresses and take the new sessions over."""
        eid = self.engine.engine_id
        log.warning("engine '%s': %s; connecting again", eid, why)
        self.losses.append(why)
        self.agent.stats["sessions_lost"] = self.agent.stats.get("sessions_lost", 0) + 1
        self._end(f"session lost: {why}")
        if self.dialled is None:
            self.closed = True
            raise TransferError(f"connection to engine '{eid}' lost ({why}); connect again")
        d = self.dialled
        try:
            fresh = connect(self.agent, d.addresses, self.direction.value, self.mode.value, d.timeout, d.warm)
        except KvlcError as exc:
            self.closed = True
            raise TransferError(f"connection to engine '{eid}' lost ({why}) and connecting again failed: "
                                f"{exc}") from exc
        self.engine, self.program, self.sessions = fresh.engine, fresh.program, fresh.sessions
        self._clients, self._lists, self._notify = fresh._clients, fresh._lists, fresh._notify
        fresh.closed = True  # its sessions, clients and lists are this peer's now

    def _end(self, why: str) -> None:
        """Release prepared lists, end the sessions (their NIXL agents and waiting requests go), close
        the connections."""
        lists, self._lists = self._lists or {}, None
        for handles in lists.values():
            for h in handles:
                if h is not None:
                    h.release()
        for s in self.sessions.values():
            self.agent.drop_session(s, why)
        for c in self._clients.values():
            self.agent.sender.retire(c)
            c.close()

    def parts(self, local_block_ids, remote_block_ids, num_tokens=None, tokens=None, *,
              checked: Request | None = None) -> tuple[dict, dict]:
        """One checked request's parts, and the staging decision made for it here, once: peer rank → the
        keys of the parts staged (a prepared part the policy stages travels as rows of its token range).
        ``checked``: the request as :func:`check_request` returned it for these ids (rows are built from
        it, not checked again)."""
        op = "READ" if self.direction is Direction.READ else "WRITE"
        bound = self.agent.bound_program(self.engine)
        agents = agents_of(self._notify)
        if self.mode is not ConnectionMode.PREPPED or self.agent.copies_to(agents.values()):
            blocks = self.agent.copies_blocks(agents.values())  # a GPU's kernel reads ids
            parts = (instantiate(bound, local_block_ids, remote_block_ids, num_tokens, tokens=tokens, blocks=blocks)
                     if checked is None else emit(bound, checked, blocks=blocks))
            return parts, self.agent.staged_parts(op, parts, agents)
        req = prepared_indices(bound, local_block_ids, remote_block_ids, num_tokens, tokens=tokens)
        lists = self._prepared(bound)
        parts: dict = dict(req.tail)
        for key, (li, ri) in req.indices.items():
            local, remote = lists[key]
            parts[("prepped", key)] = PreparedPart(key, local, li, remote, ri, req.nbytes[key])
        staged = self.agent.staged_parts(op, parts, agents)
        if staged:  # staged parts travel as rows (the bounce buffer gathers them), the rest stay prepared
            rows = instantiate(bound, local_block_ids, remote_block_ids, num_tokens, tokens=tokens)
            for rank, keys in staged.items():
                keys[:] = list(dict.fromkeys(getattr(parts.get(k), "key", k) for k in keys))
                for key in keys:
                    parts.pop(("prepped", key), None)
                    parts[key] = rows[key]  # (its tail too: the rows cover the whole range)
        return parts, staged

    def prepare(self) -> None:
        """Prepare the strided lists now (mode 'prepped', at connect); on failure close and raise."""
        try:
            self._prepared(self.agent.bound_program(self.engine))
        except BaseException:
            self.close()
            raise

    def _prepared(self, bound):
        """Prepare the strided lists of every part once."""
        if self._lists is None:
            lists = {}
            try:
                for key, pl in prepared_rows(bound).items():
                    local = self.agent.nixl.prep(None, pl.local, key.local_mem)
                    lists[key] = (local, None)
                    remote = self.agent.nixl.prep(self.sessions[key.peer_rank].agent, pl.remote, key.remote_mem)
                    lists[key] = (local, remote)
            except BaseException:
                for pair_ in lists.values():
                    for h in pair_:
                        if h is not None:
                            h.release()
                raise
            self._lists = lists
        return self._lists

    def read(self, request_id: str, local_block_ids: Mapping[str, Sequence[int]],
             remote_block_ids: Mapping[str, Sequence[int]], num_tokens: int | None = None,
             timeout: float | None = None, *, tokens=None, produced_at: float | None = None
             ) -> Outgoing | None:
        """Pull one request into this (consumer) rank's blocks. Never blocks; see :meth:`KvAgent.poll`.

        ``num_tokens=N`` moves tokens ``[0, N)``; ``tokens=(start, stop)`` (or ``range``) moves
        ``[start, stop)`` (a prefix-cache hit of ``start`` tokens here: those stay untouched).
        Block ids are logical, per KV-cache group: each side's blocks the range touches
        (:func:`kvlc.compiler.request.check.check_request`); every id is checked
        against every region's capacity before anything moves (:class:`TransferError`).
        In pull_via_push mode the range travels to the producer, which checks it again.

        ``produced_at`` (the producer's ``time.time()`` when the KV was complete): a remote rank whose
        epoch started later (the engine restarted, or slept and woke, since) no longer holds that KV:
        the read is refused with :class:`TransferError` and nothing moves, even over a connection made
        again to the same address under the new epoch.

        Returns the request as this agent moves it (its ``nbytes``, ``rows``, and ``started`` /
        ``finished`` on the monotonic clock, ``finished`` set once every part ended), or None in
        pull_via_push mode, where the producer moves the bytes.
        """
        if self.direction is not Direction.READ:
            raise TransferError("read() needs a connection made with direction='READ' (this side consumes)")
        check_request_id(request_id)
        a = self.agent
        timeout = request_timeout(timeout, a.timeout)
        self._live()
        if produced_at is not None:
            self._still_held(request_id, produced_at)
        if self.mode is not ConnectionMode.PULL_VIA_PUSH:
            parts, staged = self.parts(local_block_ids, remote_block_ids, num_tokens, tokens)
            return a.submit(("read", request_id), request_id, "READ", parts, self._targets(), timeout,
                            staged=staged)
        check_request(self.program, local_block_ids, remote_block_ids, num_tokens, tokens=tokens)
        start, stop = _wire_range(num_tokens, tokens)
        deadline = time.monotonic() + timeout
        a.await_pull(Incoming(request_id, deadline, self.engine,
                              via={r: (s, self._clients[r]) for r, s in self.sessions.items()}))
        cblocks, pblocks = _ids(local_block_ids), _ids(remote_block_ids)
        for r, client in self._clients.items():
            def payload(client=client):  # built at send time: the budget left then, on the producer's clock
                sealed = client.sealed
                off, err = (sealed.clock_offset, sealed.clock_error) if sealed else (0.0, 0.0)
                budget = max(0.0, deadline - time.monotonic())
                return PullRequest(req=request_id, consumer_blocks=cblocks, producer_blocks=pblocks,
                                   start=start, stop=stop, until=deadline + off - err, budget_s=budget)
            a.sender.send_now(client, payload, ("pull", request_id, r, self.sessions[r].conn_id), PULLS)
        return None

    def _still_held(self, request_id: str, produced_at: float) -> None:
        """Refuse a read of KV produced before a remote rank's epoch started (that memory was renewed)."""
        for r, s in self.sessions.items():
            started = s.record.started_at
            if started > produced_at:
                raise TransferError(
                    f"request '{request_id}': its KV was produced at {produced_at:.3f} but rank {r} of engine "
                    f"'{self.engine.engine_id}' started epoch {s.epoch[:8]} at {started:.3f}, later (a restart, "
                    "or a sleep and wake-up): that memory no longer holds it; nothing read (compute it again)")

    def write(self, request_id: str, local_block_ids: Mapping[str, Sequence[int]],
              remote_block_ids: Mapping[str, Sequence[int]], num_tokens: int | None = None,
              timeout: float | None = None, *, tokens=None) -> None:
        """Push one request from this (producer) rank's blocks into the consumer ranks' blocks.

        ``num_tokens`` / ``tokens=(start, stop)`` and the ids as in :meth:`read`.
        """
        if self.direction is not Direction.WRITE:
            raise TransferError("write() needs a connection made with direction='WRITE' (this side produces)")
        check_request_id(request_id)
        a = self.agent
        timeout = request_timeout(timeout, a.timeout)
        self._live()
        parts, staged = self.parts(local_block_ids, remote_block_ids, num_tokens, tokens)
        a.submit(("write", request_id), request_id, "WRITE", parts, self._targets(), timeout, staged=staged,
                 refuse=self.cancelled(request_id))

    def cancelled(self, request_id: str) -> dict:
        """The tombstones that refuse a write of ``request_id`` (a consumer rank cancelled it), each with why."""
        return {("tomb", s.conn_id, request_id):
                f"request '{request_id}' was cancelled by consumer rank {r}; nothing written"
                for r, s in self.sessions.items()}

    def write_many(self, requests: Iterable[BlockRequest], timeout: float | None = None) -> None:
        """Push several requests (:class:`~kvlc.runtime.batch.BlockRequest`) as one NIXL request per
        part: all checked first (one refusal refuses all, nothing moves), then they move and end
        together, sharing one deadline (:mod:`kvlc.runtime.batch`). Never blocks, like :meth:`write`."""
        _batch.submit(self, requests, Direction.WRITE, timeout)

    def read_many(self, requests: Iterable[BlockRequest], timeout: float | None = None) -> None:
        """Pull several requests, as :meth:`write_many` pushes them (``local_block_ids``: this consumer's)."""
        _batch.submit(self, requests, Direction.READ, timeout)

    def close(self) -> None:
        """End these sessions: close the connections, release prepared lists, revoke the NIXL agents
        (no transfer with them can be made any more); requests waiting on them end (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self._end("the engine closed this connection")
