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
from typing import TYPE_CHECKING

from kvlc.compiler.request.instantiate import instantiate
from kvlc.errors import KvlcError
from kvlc.runtime.channel.auth import tag_ok
from kvlc.runtime.channel.tcp import Conn
from kvlc.runtime.errors import HandshakeError
from kvlc.runtime.kinds import Direction, Mode, Status
from kvlc.runtime.channel.sessions import Session
from kvlc.runtime.transfer import Target
from kvlc.runtime.nixl.warmup import warm_peers
from kvlc.runtime.channel.wire import Cancel, Fetch, Introduce, PullRequest, Reply, decode, encode

if TYPE_CHECKING:
    from kvlc.runtime.agent import KvAgent

log = logging.getLogger("kvlc.runtime.server")


def error_reply(text: str) -> bytes:
    return encode(Reply(ok=False, error=text[:4000]))


def handle(agent: KvAgent, conn: Conn, frame: bytes) -> bytes:
    """Serve one frame (server thread)."""
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
        if isinstance(msg, Cancel):
            return encode(Reply(ok=True, status=cancel(agent, conn, msg).value))
        return error_reply(f"unexpected '{msg.t}' message on a server")
    except KvlcError as exc:
        return error_reply(str(exc))


def introduce(agent: KvAgent, conn: Conn, msg: Introduce) -> Reply:
    """A peer connected to us: pair from our side and open its session on this connection.

    Staging on: a producer that will push here gets an inbox in the reply; a pull-via-push consumer's
    inbox (in its hello) is where this side stages the WRITEs it asks for."""
    rec = msg.record
    if msg.mode == Mode.PULL_VIA_PUSH and msg.direction != Direction.READ:
        raise HandshakeError("pull_via_push is a consumer's mode: the introducing agent must READ")
    mine = Direction(msg.direction).other
    with agent._lock:
        agent._check_open()
        if conn.session is not None:
            raise HandshakeError("this connection already introduced a session; open another connection")
        eng = agent.sessions.engine(rec, mine)
        replaced = agent.sessions.check(rec, eng)
        for old in replaced:
            agent._drop_session(old, f"engine '{rec.engine_id}' rank {rec.rank} restarted (epoch {rec.epoch[:8]})")
        if msg.mode == Mode.PULL_VIA_PUSH:
            agent._load_remote(rec)
        inbox = _staging_peer(agent, msg)
        session = Session(rec, conn.id, conn.sealed.notif_key, mine, Mode(msg.mode), eng, msg.address, True)
        agent.sessions.add(session)
        conn.session = session
        if msg.mode == Mode.PULL_VIA_PUSH:  # this side WRITEs the consumer's requests
            eng.bound(agent.bases)
    if msg.mode == Mode.PULL_VIA_PUSH:  # and warms its memory now
        warm_peers(agent, [rec])
    return Reply(ok=True, inbox=inbox)


def _staging_peer(agent: KvAgent, msg: Introduce):
    """Staging on: the inbox a producer that will push here gets (None otherwise); a pull-via-push
    consumer's inbox becomes where this side stages its WRITEs (caller holds the lock)."""
    rec, st = msg.record, agent.stager
    if st is None:
        return None
    if msg.direction == Direction.WRITE:
        inbox = st.inbox_for(rec.agent)
        if inbox is not None:
            agent._load_remote(rec)  # its chunks' slots go back to it in FREE notifications
        return inbox
    if msg.mode == Mode.PULL_VIA_PUSH and msg.inbox is not None:
        st.add_peer(rec, msg.inbox)
    return None


def pull_request(agent: KvAgent, conn: Conn, msg: PullRequest) -> None:
    """Pull via push, producer side: WRITE this session's share of a request into its own blocks."""
    with agent._lock:
        agent._check_open()
        s: Session | None = conn.session
        if s is None or not s.live:
            raise HandshakeError("no session on this connection: introduce first (connect in pull_via_push mode)")
        if s.mode != Mode.PULL_VIA_PUSH:
            raise HandshakeError(f"agent '{s.agent}' has not connected in pull_via_push mode")
        key = ("pvp", s.conn_id, msg.req)
        if key in agent.executor.active:
            raise KvlcError(f"request '{msg.req}' from rank {s.rank} is already in flight")
        if ("tomb", s.conn_id, msg.req) in agent.events.ended:
            raise KvlcError(f"request '{msg.req}' was cancelled by this consumer; use a new request id")
        if ("lease", s.engine.key, msg.req) in agent.events.ended:
            raise KvlcError(f"request '{msg.req}': its lease ran out and its source blocks were freed")
        now = time.monotonic()
        left = msg.until - now
        if left <= 0:
            raise KvlcError(
                f"request '{msg.req}' expired before it could start (its budget was {msg.budget_s:.3g}s "
                "when sent); nothing was written"
            )
        span = {"tokens": (msg.start_token, msg.num_tokens)} if msg.start_token else {"num_tokens": msg.num_tokens}
        parts = instantiate(s.engine.bound(agent.bases), msg.producer_blocks, msg.consumer_blocks, **span)
        parts = {k: p for k, p in parts.items() if k.peer_rank == s.rank}  # this session's share only
        agent._submit(key, msg.req, "WRITE", parts, {s.rank: Target(s.agent, s.notif_key)}, left, ("pvp", s))
        agent._tally(s.engine, msg.req)


def cancel(agent: KvAgent, conn: Conn, msg: Cancel) -> Status:
    """Stop a request for the asking session; the status says whether bytes can still move."""
    with agent._lock:
        agent._check_open()
        if msg.conn is None:
            s = conn.session
            if s is None or not s.live:
                raise HandshakeError("no session on this connection: nothing to cancel")
            key = ("pvp", s.conn_id, msg.req)
        else:  # a push consumer, over its own connection, for the session it shares with us
            s = agent.sessions.by_conn.get(msg.conn)
            if s is None or msg.tag is None or not tag_ok(s.notif_key, msg.tag, "cancel", msg.req):
                raise HandshakeError("cancel refused: unknown session or bad tag")
            key = ("write", msg.req)
            out = agent.executor.active.get(key)
            if out is not None and not any(t.key == s.notif_key for t in out.notify.values()):
                key = None  # a request of that id, but not one this session receives
        return agent._cancel_served(key, s, msg.req)
