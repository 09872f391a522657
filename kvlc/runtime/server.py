"""The side-channel request server of one agent: records, introductions, pull requests, cancels.

Every frame arrives on an authenticated connection (:mod:`kvlc.runtime.channel.tcp`); who sent it
is the session introduced on that connection (:mod:`kvlc.runtime.channel.sessions`). A pull request
WRITEs only into the bases the requesting session declared, only that session's share of the
request, and never at or after the consumer's deadline. Handlers return reply bytes and never
raise for bad input.
"""

from __future__ import annotations

import logging
import time
from kvlc.compiler.request.instantiate import instantiate
from kvlc.errors import KvlcError
from kvlc.runtime.channel.auth import tag_ok
from kvlc.runtime.channel.tcp import Conn
from kvlc.runtime.errors import HandshakeError
from kvlc.runtime.kinds import Direction, ConnectionMode, Status
from kvlc.runtime.channel.sessions import Session
from kvlc.runtime.channel.wire import Cancel, Fetch, Introduce, PullRequest, Pulls, Replies, Reply, decode, encode

log = logging.getLogger("kvlc.runtime.server")


def error_reply(text: str) -> bytes:
    return encode(_error(text))


def _error(text: str) -> Reply:
    return Reply(ok=False, error=text[:4000])


def handle(agent, conn: Conn, frame: bytes) -> bytes:
    """Serve one frame (server thread) for ``agent`` (a :class:`~kvlc.runtime.agent.KvAgent`, asked
    through its methods)."""
    try:
        msg = decode(frame)
    except HandshakeError as exc:
        return error_reply(str(exc))
    try:
        if isinstance(msg, Fetch):
            return encode(agent.record)
        if isinstance(msg, Introduce):
            return encode(introduce(agent, conn, msg))
        if isinstance(msg, PullRequest):
            pull_request(agent, conn, msg)
            return encode(Reply(ok=True))
        if isinstance(msg, Pulls):
            return encode(Replies(items=tuple(_pull_one(agent, conn, m) for m in msg.items)))
        if isinstance(msg, Cancel):
            return encode(Reply(ok=True, status=cancel(agent, conn, msg).value))
        return error_reply(f"unexpected '{msg.t}' message on a server")
    except KvlcError as exc:
        return error_reply(str(exc))


def _pull_one(agent, conn: Conn, msg: PullRequest) -> Reply:
    """One request of a :class:`Pulls` frame: its own answer (a refusal refuses only it)."""
    try:
        pull_request(agent, conn, msg)
        return Reply(ok=True)
    except KvlcError as exc:
        return _error(str(exc))


def introduce(agent, conn: Conn, msg: Introduce) -> Reply:
    """A peer connected to us: pair from our side and open its session on this connection.

    The hello must carry the record key's signature over this connection and this agent's name
    (:meth:`Introduce.proven`); else nothing is paired, loaded or opened.
    Staging on: a producer that will push here gets an inbox in the reply; a pull-via-push consumer's
    inbox (in its hello) is where this side stages the WRITEs it asks for. Same host
    (:mod:`kvlc.runtime.ipc`): a direct-mode peer gets the storages it may map in the reply; a
    pull-via-push consumer's (in its hello) are mapped here."""
    rec = msg.record
    pvp = msg.mode == ConnectionMode.PULL_VIA_PUSH
    if pvp and msg.direction != Direction.READ:
        raise HandshakeError("pull_via_push is a consumer's mode: the introducing agent must READ")
    if conn.session is not None:
        raise HandshakeError("this connection already introduced a session; open another connection")
    if not msg.proven(conn.sealed.binding, agent.name):
        agent.stats["refused_hellos"] += 1
        log.warning("hello of agent %r refused: no proof of its record's key on this connection", rec.agent[:64])
        raise HandshakeError(f"agent '{rec.agent}' did not prove it holds its record's key on this connection "
                             "(a record replayed from elsewhere?); refused")
    mine = Direction(msg.direction).other
    eng = agent.pair_engine(rec, mine)
    session = Session(rec, conn.id, conn.sealed.notif_key, mine, ConnectionMode(msg.mode), eng, msg.address, True)
    inbox = agent.admit_served(session, pvp, msg.inbox)
    conn.session = session
    if pvp:  # this side WRITEs the consumer's requests (through its mapped memory on this host), warm now
        agent.map_peer(rec.agent, msg.shared)
        agent.warm([rec])
    return Reply(ok=True, inbox=inbox, shared=agent.shared_for(msg, conn.id), proof=agent.welcome(conn.sealed.binding, rec.agent))


def _session(conn: Conn, what: str) -> Session:
    s: Session | None = conn.session
    if s is None or not s.live:
        raise HandshakeError(f"no session on this connection: {what}")
    return s


def time_left(msg: PullRequest, now: float) -> float:
    """Seconds a pull request may still run on this producer: until its deadline on our clock, and
    never longer than the budget the consumer had when it sent the frame (a deadline far in the
    future, 1e308 say, does not make a request that never times out)."""
    return min(msg.until - now, msg.budget_s)


def pull_request(agent, conn: Conn, msg: PullRequest) -> None:
    """Pull via push, producer side: WRITE this session's share of a request into its own blocks."""
    agent.check_open()
    s = _session(conn, "introduce first (connect in pull_via_push mode)")
    if s.mode != ConnectionMode.PULL_VIA_PUSH:
        raise HandshakeError(f"agent '{s.agent}' has not connected in pull_via_push mode")
    key = ("pvp", s.conn_id, msg.req)
    if agent.is_moving(key):
        raise KvlcError(f"request '{msg.req}' from rank {s.rank} is already in flight")
    left = time_left(msg, time.monotonic())
    if left <= 0:
        raise KvlcError(
            f"request '{msg.req}' expired before it could start (its budget was {msg.budget_s:.3g}s "
            "when sent); nothing was written"
        )
    parts = instantiate(agent.bound_program(s.engine), msg.producer_blocks, msg.consumer_blocks,
                        tokens=(msg.start, msg.stop), blocks=agent.copies_blocks([s.agent]))  # as a push's parts
    parts = {k: p for k, p in parts.items() if k.peer_rank == s.rank}  # this session's share only
    refuse = {("tomb", s.conn_id, msg.req): f"request '{msg.req}' was cancelled by this consumer; "
                                            "use a new request id",
              ("lease", s.engine.key, msg.req): f"request '{msg.req}': its lease ran out and its source "
                                                "blocks were freed"}
    agent.serve_pull(s, msg.req, parts, left, refuse)


def cancel(agent, conn: Conn, msg: Cancel) -> Status:
    """Stop a request for the asking session; the status says whether bytes can still move."""
    agent.check_open()
    if msg.conn is None:
        s = _session(conn, "nothing to cancel")
        return agent.cancel_served(("pvp", s.conn_id, msg.req), s, msg.req)
    # a push consumer, over its own connection, for the session it shares with us
    s = agent.session_on(msg.conn)
    if s is None or msg.tag is None or not tag_ok(s.notif_key, msg.tag, "cancel", msg.req):
        raise HandshakeError("cancel refused: unknown session or bad tag")
    return agent.cancel_served(("write", msg.req), s, msg.req, push=True)
