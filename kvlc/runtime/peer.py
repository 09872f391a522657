"""Connecting to a remote engine, and the :class:`Peer` that moves requests over that connection.

:func:`connect` fetches every remote rank's record over an authenticated connection, pairs the
plans (``CompatError`` here, not per request), checks that every rank this rank exchanges
bytes with is served, loads the NIXL agents it will initiate transfers to, introduces itself,
and opens one session per remote rank. :meth:`Peer.read` and :meth:`Peer.write` never wait on
the network: direct modes post NIXL requests; pull via push hands its frames to the agent's
background sender.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvlc.compiler.pairing.program import TransferProgram
from kvlc.compiler.request.check import check_request
from kvlc.compiler.request.instantiate import instantiate
from kvlc.compiler.request.prepared import prepared_indices, prepared_rows
from kvlc.errors import KvlcError, TransferError
from kvlc.runtime import batch as _batch
from kvlc.runtime.arguments import check_request_id
from kvlc.runtime.batch import BlockRequest
from kvlc.runtime.channel.tcp import ChannelClient
from kvlc.runtime.errors import HandshakeError, NixlError
from kvlc.runtime.kinds import Direction, Mode
from kvlc.runtime.channel.sessions import RemoteEngine, Session
from kvlc.runtime.tracking import Incoming
from kvlc.runtime.transfer import PreparedPart, Target
from kvlc.runtime.nixl.warmup import warm_peers
from kvlc.runtime.channel.wire import Fetch, Introduce, PullRequest, Record, Reply, decode, encode

if TYPE_CHECKING:
    from kvlc.runtime.agent import KvAgent


def _ids(block_ids: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
    return {str(g): tuple(int(i) for i in np.asarray(ids).ravel().tolist()) for g, ids in block_ids.items()}


def _wire_range(num_tokens, tokens) -> tuple[int, int]:
    """``(start, stop)`` of a checked request, as pull_via_push carries it: one range for every group."""
    if tokens is None:
        if isinstance(num_tokens, Mapping):
            raise TransferError("pull_via_push carries one token count for every group; give num_tokens=N")
        return 0, int(num_tokens)
    if isinstance(tokens, Mapping):
        raise TransferError("pull_via_push carries one token range for every group; give tokens=(start, stop)")
    return (tokens.start, tokens.stop) if isinstance(tokens, range) else (int(tokens[0]), int(tokens[1]))


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


def connect(agent: KvAgent, addresses: Sequence[str], direction: str, mode: str, timeout: float,
            warm: bool = True) -> Peer:
    """Connect ``agent`` to the ranks of one remote engine (see the module docstring)."""
    direction, mode = _check_connect(addresses, direction, mode)
    agent._check_open()
    clients = [ChannelClient(a, agent._key, timeout=timeout) for a in addresses]
    added: list[str] = []
    given: list[str] = []  # agents this side gave a staging inbox to
    try:
        got = _fetch(clients)
        eng = _pair(agent, got, direction)
        added = _admit(agent, got, eng, mode)
        _introduce(agent, got, eng.program.peer_ranks, direction, mode, given)
        peer = _open(agent, got, eng, direction, mode)
        if mode is Mode.PREPPED:  # prepare the strided lists now: NIXL problems surface at connect
            _prepare_now(agent, peer, eng)
        if mode is not Mode.PULL_VIA_PUSH:  # this side moves the bytes (else the producer does both)
            with agent._lock:
                eng.bound(agent.bases)  # the program bound to both sides' bases, before the first request
            if warm:
                warm_peers(agent, [got[r][0] for r in eng.program.peer_ranks])
        return peer
    except BaseException:
        _undo_connect(agent, clients, added, given)
        raise


def _check_connect(addresses: Sequence[str], direction: str, mode: str) -> tuple[Direction, Mode]:
    """The parsed direction and mode of a connect call, after checking they go together."""
    direction = Direction.parse(direction, "direction")
    mode = Mode.parse(mode, "mode")
    if mode is Mode.PULL_VIA_PUSH and direction is not Direction.READ:
        raise KvlcError("mode 'pull_via_push' is for a consumer: use direction='READ'")
    if not addresses:
        raise KvlcError("connect needs the side-channel address of every remote rank to pair with")
    return direction, mode


def _prepare_now(agent: KvAgent, peer: Peer, eng: RemoteEngine) -> None:
    """Prepare the peer's strided lists (mode 'prepped'); on failure close the peer and raise."""
    with agent._lock:
        try:
            peer._prepared(eng.bound(agent.bases))
        except BaseException:
            peer.close()
            raise


def _undo_connect(agent: KvAgent, clients: list[ChannelClient], added: list[str], given: list[str]) -> None:
    """Undo a connect that failed: staging inboxes given, remote agents added, side channels opened."""
    with agent._lock:
        for name in given:
            if not agent.sessions.live(name):
                agent.stager.drop_peer(name)
        for name in added:
            try:
                agent.nixl.remove_remote(name)
            except NixlError:
                pass
    for c in clients:
        c.close()


def _pair(agent: KvAgent, got, direction: Direction) -> RemoteEngine:
    """Pair with the remote engine (CompatError here) and check every rank it needs is served."""
    rec0 = next(iter(got.values()))[0]
    with agent._lock:
        eng = agent.sessions.engine(rec0, direction)
    missing = sorted(set(eng.program.peer_ranks) - set(got))
    if missing:
        raise HandshakeError(
            f"rank {agent.rank} exchanges bytes with ranks {list(eng.program.peer_ranks)} of "
            f"'{rec0.plan.name}', but no address serves rank(s) {missing}"
        )
    return eng


def _admit(agent: KvAgent, got, eng: RemoteEngine, mode: Mode) -> list[str]:
    """Refuse hijacks, end the sessions a restart replaces, load the NIXL agents this side initiates to."""
    added = []
    with agent._lock:
        peers = eng.program.peer_ranks
        replaced = [old for r in peers for old in agent.sessions.check(got[r][0], eng)]
        for old in replaced:
            agent._drop_session(old, f"engine '{old.engine_id}' rank {old.rank} restarted")
        if mode is not Mode.PULL_VIA_PUSH or agent.stager is not None:  # (staging: FREEs go to the producer)
            for r in peers:
                if got[r][0].agent not in agent.nixl.remotes:
                    agent._load_remote(got[r][0])
                    added.append(got[r][0].agent)
    return added


def _introduce(agent: KvAgent, got, peers, direction: Direction, mode: Mode, given: list[str]) -> None:
    """Introduce this agent to every peer rank; staging inboxes travel here (see :mod:`kvlc.runtime.server`)."""
    wire_mode = "pull_via_push" if mode is Mode.PULL_VIA_PUSH else "direct"  # "prepped" is direct on the wire
    st = agent.stager
    for r in peers:
        rec = got[r][0]
        with agent._lock:
            inbox = st.inbox_for(rec.agent) if st is not None and mode is Mode.PULL_VIA_PUSH else None
        if inbox is not None:
            given.append(rec.agent)
        hello = encode(Introduce(record=agent.record, direction=direction.value, mode=wire_mode,
                                 address=agent.address or "", inbox=inbox))
        reply = _accepted(r, rec, decode(got[r][1].request(hello)))
        if st is not None and direction is Direction.WRITE and reply.inbox is not None:
            with agent._lock:
                st.add_peer(rec, reply.inbox)


def _accepted(r: int, rec: Record, reply) -> Reply:
    """The reply of peer rank ``r`` to an introduction; HandshakeError where it refused."""
    if not isinstance(reply, Reply) or not reply.ok:
        why = reply.error if isinstance(reply, Reply) else f"a '{reply.t}' message"
        raise HandshakeError(f"rank {r} ({rec.agent}) refused this agent: {why}")
    return reply


def _open(agent: KvAgent, got, eng: RemoteEngine, direction: Direction, mode: Mode) -> Peer:
    """One session per remote rank, on the connection it was introduced on."""
    peers = eng.program.peer_ranks
    with agent._lock:
        agent._check_open()
        sessions = {}
        for r in peers:
            rec, client = got[r]
            sessions[r] = Session(rec, client.sealed.id, client.sealed.notif_key, direction, mode, eng)
            agent.sessions.add(sessions[r])
        for r, (_, c) in got.items():
            if r not in peers:
                c.close()
        agent._res.clients.extend(got[r][1] for r in peers)
        return Peer(agent, eng, sessions, {r: got[r][1] for r in peers}, direction, mode)


class Peer:
    """This agent's sessions with the ranks of one remote engine (see :func:`connect`)."""

    def __init__(self, agent: KvAgent, engine: RemoteEngine, sessions: dict[int, Session],
                 clients: dict[int, ChannelClient], direction: Direction, mode: Mode):
        self.agent = agent
        self.engine = engine
        self.program: TransferProgram = engine.program
        self.direction, self.mode = direction, mode
        self.sessions = sessions
        self._clients = clients
        self._lists: dict | None = None  # mode "prepped": PartKey -> (local Prepped, remote Prepped)
        self._notify = {r: Target(s.agent, s.notif_key) for r, s in sessions.items()}  # fixed per connection
        self.closed = False

    @property
    def peer_ranks(self) -> tuple[int, ...]:
        return self.program.peer_ranks

    @property
    def records(self) -> dict[int, Record]:
        return {r: s.record for r, s in self.sessions.items()}

    def _targets(self) -> dict[int, Target]:
        return self._notify

    def _live(self) -> None:
        self.agent._check_open()
        dead = [r for r, s in self.sessions.items() if not s.live]
        if self.closed or dead:
            raise TransferError(
                f"connection to engine '{self.engine.engine_id}' is closed"
                + (f" (rank(s) {dead} restarted or went away); connect again" if dead else "")
            )

    def _instantiate(self, local_block_ids, remote_block_ids, num_tokens, tokens=None):
        bound = self.engine.bound(self.agent.bases)
        if self.mode is not Mode.PREPPED:
            return instantiate(bound, local_block_ids, remote_block_ids, num_tokens, tokens=tokens)
        req = prepared_indices(bound, local_block_ids, remote_block_ids, num_tokens, tokens=tokens)
        lists = self._prepared(bound)
        parts: dict = dict(req.tail)
        staged = []
        for key, (li, ri) in req.indices.items():
            local, remote = lists[key]
            parts[("prepped", key)] = PreparedPart(key, local, li, remote, ri, req.nbytes[key])
            st = self.agent.stager
            if self.direction is Direction.WRITE and st is not None and st.decide(
                    "WRITE", key, len(li), int(req.nbytes[key]), self.sessions[key.peer_rank].agent):
                staged.append(key)
        if staged:  # staged parts travel as rows (the bounce buffer gathers them), the rest stay prepared
            rows = instantiate(bound, local_block_ids, remote_block_ids, num_tokens)
            for key in staged:
                del parts[("prepped", key)]
                parts[key] = rows[key]
        return parts

    def _prepared(self, bound):
        """Prepare the strided lists of every part once (called under the agent's lock)."""
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
             timeout: float | None = None, *, tokens=None) -> None:
        """Pull one request into this (consumer) rank's blocks. Never blocks; see :meth:`KvAgent.poll`.

        ``num_tokens=N`` moves tokens ``[0, N)``; ``tokens=(start, stop)`` (or ``range``) moves
        ``[start, stop)`` (a prefix-cache hit of ``start`` tokens here: those stay untouched).
        Block ids are logical, per KV-cache group: each side's blocks the range touches
        (:func:`kvlc.compiler.request.check.check_request`); every id is checked
        against every region's capacity before anything moves (:class:`TransferError`).
        In pull_via_push mode the range travels to the producer, which checks it again.
        """
        if self.direction is not Direction.READ:
            raise TransferError("read() needs a connection made with direction='READ' (this side consumes)")
        check_request_id(request_id)
        a = self.agent
        timeout = a.timeout if timeout is None else float(timeout)
        with a._lock:
            self._live()
            if ("read", request_id) in a.executor.active or request_id in a.incoming:
                raise TransferError(f"request '{request_id}' is already in flight")
            if self.mode is not Mode.PULL_VIA_PUSH:
                parts = self._instantiate(local_block_ids, remote_block_ids, num_tokens, tokens)
                a._submit(("read", request_id), request_id, "READ", parts, self._targets(), timeout)
                a._polled = time.monotonic()  # the engine is at work and polls soon: the progress thread waits
                return
            check_request(self.program, local_block_ids, remote_block_ids, num_tokens, tokens=tokens)
            start, n = _wire_range(num_tokens, tokens)
            deadline = time.monotonic() + timeout
            inc = Incoming(request_id, deadline, self.engine,
                           via={r: (s, self._clients[r]) for r, s in self.sessions.items()})
            a.events.ended.pop(request_id, None)
            a.incoming[request_id] = inc
            a.stats["requests"] += 1
        cblocks, pblocks = _ids(local_block_ids), _ids(remote_block_ids)
        for r, client in self._clients.items():
            def payload(client=client):  # built at send time: the budget left then, on the producer's clock
                sealed = client.sealed
                off, err = (sealed.clock_offset, sealed.clock_error) if sealed else (0.0, 0.0)
                budget = max(0.0, deadline - time.monotonic())
                return encode(PullRequest(req=request_id, consumer_blocks=cblocks, producer_blocks=pblocks,
                                          num_tokens=n, start_token=start, until=deadline + off - err,
                                          budget_s=budget))
            a.sender.send(client, payload, ("pull", request_id, r, self.sessions[r].conn_id))

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
        with a._lock:
            self._live()
            if ("write", request_id) in a.executor.active:
                raise TransferError(f"request '{request_id}' is already in flight")
            for r, s in self.sessions.items():
                if ("tomb", s.conn_id, request_id) in a.events.ended:
                    raise TransferError(f"request '{request_id}' was cancelled by consumer rank {r}; nothing written")
            parts = self._instantiate(local_block_ids, remote_block_ids, num_tokens, tokens)
            a.events.ended.pop(("write", request_id), None)
            a._submit(("write", request_id), request_id, "WRITE", parts, self._targets(),
                      a.timeout if timeout is None else timeout)
            a._polled = time.monotonic()  # the engine is at work and polls soon: the progress thread waits

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
        a = self.agent
        with a._lock:
            if self.closed:
                return
            self.closed = True
            lists, self._lists = self._lists or {}, None
            for handles in lists.values():
                for h in handles:
                    h.release()
            for s in self.sessions.values():
                a._drop_session(s, "the engine closed this connection")
        for c in self._clients.values():
            c.close()
