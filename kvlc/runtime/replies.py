"""What comes back from remote ranks (notifications, pull-request and cancel replies) and what happens
when a session ends.

Applied under the agent's lock by its pump (``KvAgent.poll``, ``KvAgent.progress_turn``), to the
:class:`~kvlc.runtime.agent.KvAgent` given, through its public methods. A notification counts only
when its tag proves it comes from a live session of the sender (:mod:`kvlc.runtime.channel.auth`);
everything else is dropped and counted (``stats["dropped_notifs"]``). Staging notifications
(:mod:`kvlc.runtime.staging.wire`) are tagged the same way; a staged chunk is scattered only
for a request that is still open here, from the session it is expected from, and not held: once
a request timed out, was cancelled, or its session ended, its late chunks only give their slot
back. A request whose scatter may still be writing (on a GPU stream) is reported failed or
finished only once that copy completed.
"""

from __future__ import annotations

import logging
import time
from kvlc.runtime.channel.auth import notif_tag, tag_ok
from kvlc.runtime.errors import ChannelError, HandshakeError, NixlError
from kvlc.runtime.kinds import Direction, ConnectionMode, Status
from kvlc.runtime.nixl import sever
from kvlc.runtime.staging.copy import StagingError
from kvlc.runtime.staging.wire import Kind, decode as decode_staging, is_staging, verify
from kvlc.runtime.tracking import Incoming, Severing, hold, settle
from kvlc.runtime.channel.notifs import NotifBatch, decode_notif
from kvlc.runtime.channel.wire import Cancel, Reply, encode

log = logging.getLogger("kvlc.runtime.replies")
_TERMINAL = {Status.DONE, Status.FAILED, Status.CANCELLED, Status.UNKNOWN}


def _drop(agent, why: str, *args) -> None:
    agent.stats["dropped_notifs"] += 1
    log.warning("notification dropped: " + why, *args)


def _settle(agent, inc: Incoming) -> bool:
    """:func:`settle`, unless a staged scatter of the request may still write (then retried by the pump)."""
    st = agent.stager
    if st is not None and inc.complete and st.endpoint.scattering(inc.req):
        agent.unsettled.add(inc.req)
        return False
    return settle(inc, agent.events)


def notifs(agent, batch) -> None:
    """Every notification NIXL delivered (sender → messages), staging ones included."""
    staged = False
    for sender, msgs in batch.items():
        for m in msgs:
            if is_staging(m):
                staging(agent, sender, m)
                staged = True
            else:
                notif(agent, sender, m)
    if staged:  # a FREE may have completed a staged part: finish its request in this pump
        agent.advance()
    for req in list(agent.unsettled):
        inc = agent.incoming.get(req)
        if inc is None or not inc.complete:
            agent.unsettled.discard(req)
        elif _settle(agent, inc):
            agent.unsettled.discard(req)
            del agent.incoming[req]


def not_from(inc: Incoming, s) -> str:
    """Why session ``s`` may not answer or write request ``inc`` here ("" if it may). The first
    answer binds a request to its engine (where ``expect()`` named none, and only an engine of the
    id it named) and each rank to the session that gave it; pull via push: to the sessions asked."""
    if inc.producer is not None and s.engine_id != inc.producer:
        return f"the request is expected from engine '{inc.producer}', not '{s.engine_id}'"
    if inc.engine is None:
        inc.engine = s.engine
    elif inc.engine is not s.engine:
        return f"the request is expected from another engine, not '{s.engine_id}'"
    if inc.via:
        return "" if s.rank in inc.via and inc.via[s.rank][0] is s else "the request was not asked of this session"
    if inc.sessions.setdefault(s.rank, s.conn_id) != s.conn_id:
        return f"rank {s.rank} of engine '{s.engine_id}' answers the request on another session"
    return ""


def _fenced(agent, s, req: str) -> str:
    """Why a chunk of ``req`` from session ``s`` must not be scattered here ("" if it may)."""
    inc = agent.incoming.get(req)
    if inc is None:
        if req in agent.events.ended:
            return "the request ended here"
        inc = agent.incoming[req] = Incoming(req, time.monotonic() + agent.timeout, asked=False)
    why = not_from(inc, s)
    if why:
        return why
    if inc.held:
        return f"the request is held here ({inc.why_held})"
    if s.rank in inc.answers:
        return f"rank {s.rank} already ended the request"
    return ""


def staging(agent, sender: str, raw: bytes) -> None:
    """One staging notification (LANDED, FREE, FAIL), authenticated like :func:`notif`."""
    st = agent.stager
    if st is None:
        return _drop(agent, "staging message from %r: staging is off here", sender[:64])
    try:
        m = decode_staging(raw)
    except StagingError as exc:
        return _drop(agent, "from %r: %s", sender[:64], exc)
    s = next((s for s in agent.sessions.live(sender) if verify(m, s.notif_key)), None)
    if s is None:
        return _drop(agent, "staging %s from %r: no session whose key signs it (request %r)", m.kind.name,
                     sender[:64], m.req[:40])
    if m.kind is Kind.LANDED:
        if s.direction is not Direction.READ:
            return _drop(agent, "staged chunk from %r on a session where it does not write here", sender[:64])
        why = _fenced(agent, s, m.req)
        if why:
            agent.stats["fenced_chunks"] += 1
            log.info("staged chunk %d of %r from %r not scattered: %s", m.seq, m.req[:40], sender[:64], why)
            st.endpoint.discard(sender, m, s.notif_key)
            return
    elif m.kind is Kind.FREE and s.direction is not Direction.WRITE:
        return _drop(agent, "FREE from %r on a session where this side does not write", sender[:64])
    st.endpoint.take(sender, m, s.notif_key)


def notif(agent, sender: str, message: bytes) -> None:
    """One NIXL notification: one request's end, or several requests' ``done`` (caller holds the lock)."""
    try:
        n = decode_notif(message)
    except HandshakeError as exc:
        return _drop(agent, "from %r: %s", sender[:64], exc)
    batch = isinstance(n, NotifBatch)
    fields = n.fields() if batch else (n.req, str(n.rank), n.status)
    s = next((s for s in agent.sessions.live(sender) if s.rank == n.rank and tag_ok(s.notif_key, n.tag, *fields)),
             None)
    reqs = n.done if batch else [n.req]
    if s is None:
        return _drop(agent, "%r has no session whose key signs it (rank %d, request %r%s)", sender[:64], n.rank,
                     reqs[0][:40], f" and {len(reqs) - 1} more" if len(reqs) > 1 else "")
    for req in reqs:
        _ended(agent, s, req, Status.DONE if batch else Status(n.status), "" if batch else n.why)

def _ended(agent, s, req: str, status: Status, why: str) -> None:
    """Session ``s``'s rank says request ``req`` ended ``status`` on its side."""
    if s.direction is Direction.WRITE:  # we produce: a consumer rank is done reading
        return agent.consumer_answered(s.engine, req, s.rank, status, why)
    inc = agent.incoming.get(req)
    if inc is None:
        if req in agent.events.ended:
            return  # late: the request already ended here
        inc = agent.incoming[req] = Incoming(req, time.monotonic() + agent.timeout, asked=False)
    refused = not_from(inc, s)
    if refused:
        return _drop(agent, "%s from %r for request %r: %s", status.value, s.agent[:64], req[:40], refused)
    inc.answer(s.rank, status, why)
    for cid, cs in list(inc.cancel_wait.items()):
        if cs.engine is s.engine and cs.rank == s.rank:
            del inc.cancel_wait[cid]
    if _settle(agent, inc):
        del agent.incoming[req]


def _gone(result) -> bool:
    """The remote's side channel refuses connections: its agent is closed (close releases every transfer)
    or its process is dead. A stopped or unreachable process does not look like this."""
    return isinstance(result, ChannelError) and "cannot reach" in str(result) and "refused" in str(result)


def drain(agent, replies) -> None:
    """Apply the background sender's replies (pull requests and cancels)."""
    while replies:
        (kind, req, rank, conn_id), result = replies.popleft()
        if _gone(result):
            s = agent.session_on(conn_id)
            if s is not None:
                agent.drop_session(s, "its side channel refuses connections: the agent is gone")
        inc = agent.incoming.get(req)
        if inc is None:
            continue
        answered = _pull_reply(inc, rank, result) if kind == "pull" else _cancel_reply(inc, conn_id, result)
        if answered and _settle(agent, inc):
            del agent.incoming[req]


def _pull_reply(inc: Incoming, rank: int, result) -> bool:
    """A producer rank's reply to a pull request: True where it refused (its share ends cancelled)."""
    if isinstance(result, Reply) and result.ok:
        return False
    if isinstance(result, Reply):  # refused: the producer posted nothing for this share
        inc.answer(rank, Status.CANCELLED, f"refused the pull request: {result.error}")
        return True
    log.warning("pull request %s to rank %d: %s", inc.req, rank, result)  # it may have arrived: the deadline
    return False                                                          # holds and cancels


def _cancel_reply(inc: Incoming, conn_id: str, result) -> bool:
    """A producer rank's reply to a cancel: True where it is terminal (pending: its notification follows;
    errors: the request stays held)."""
    ok = isinstance(result, Reply) and result.ok
    status = Status(result.status) if ok and result.status else None
    if status not in _TERMINAL:
        if not ok:
            log.warning("cancel of %s: %s", inc.req, getattr(result, "error", result))
        return False
    s = inc.cancel_wait.pop(conn_id, None)
    if s is not None and inc.engine is not None and inc.engine is s.engine:
        inc.answer(s.rank, status, "answered a cancel")
    return True


def hold_and_cancel(agent, inc: Incoming, why: str) -> None:
    """Report ``inc`` held and ask every rank that may still write to cancel (caller holds the lock)."""
    hold(inc, agent.events, why)
    missing = set(inc.missing())
    if inc.via:  # pull via push: cancel over the connection the request went on
        for rank, (s, client) in inc.via.items():
            if rank in missing and s.conn_id not in inc.cancel_wait:
                inc.cancel_wait[s.conn_id] = s
                agent.sender.send(client, lambda req=inc.req: encode(Cancel(req=req)),
                                  ("cancel", inc.req, rank, s.conn_id))
    else:
        for s in _pushers(agent, inc, missing):
            _cancel_push(agent, inc, s)
    if _settle(agent, inc):
        agent.incoming.pop(inc.req, None)


def _pushers(agent, inc: Incoming, missing: set[int]) -> list:
    """Push: the live producer sessions that may still write ``inc`` and were not asked to cancel yet."""
    out = []
    for s in agent.sessions.all():
        if not (s.live and s.server_side and s.direction is Direction.READ and s.mode is ConnectionMode.DIRECT):
            continue
        if inc.engine is not None and (s.engine is not inc.engine or s.rank not in missing):
            continue
        if inc.producer is not None and s.engine_id != inc.producer:
            continue
        if s.conn_id not in inc.cancel_wait:
            out.append(s)
    return out


def _cancel_push(agent, inc: Incoming, s) -> None:
    """Ask producer session ``s`` to cancel ``inc`` over this side's own connection to it (tagged)."""
    inc.cancel_wait[s.conn_id] = s
    if s.address:  # else: wait for its notification or for its session to end
        msg = encode(Cancel(req=inc.req, conn=s.conn_id, tag=notif_tag(s.notif_key, "cancel", inc.req)))
        agent.sender.send(agent.cancel_client(s.address), lambda m=msg: m, ("cancel", inc.req, s.rank, s.conn_id))


def end_session(agent, s, why: str) -> None:
    """End a session: its in-flight transfers stop, what waited on it ends, its NIXL agent goes."""
    if not s.live:
        return
    for key, out in list(agent.executor.active.items()):
        if any(t.key == s.notif_key for t in out.notify.values()):
            agent.cancel_own(key, f"session of rank {s.rank} ended: {why}")
    if agent.sessions.drop(s):
        agent.drop_bells(s.agent, s.conn_id)  # the doorbell offered for it, if any
        agent.retiring.add(s.agent)  # removed now, or once no request in flight uses it (revoke_retired)
        revoke_retired(agent)
    still = any(x.engine is s.engine and x.rank == s.rank for x in agent.sessions.all())
    _end_incoming(agent, s, why, still)
    if still:
        return
    for t in list(agent.tallies.values()):
        if t.engine is s.engine and s.rank not in t.seen:
            agent.consumer_answered(t.engine, t.req, s.rank, Status.FAILED, f"consumer session ended: {why}")


def revoke_retired(agent) -> None:
    """Remove the NIXL agents whose sessions ended (``agent.retiring``) once no request in flight here
    uses them: a request held past its session's end keeps its peer's NIXL agent until NIXL ends it,
    then it goes (called at a session's end and whenever a request this side moves ends). A name that
    has a live session again (connected anew) is kept."""
    busy = {t.agent for out in agent.executor.active.values() for t in out.notify.values()}
    for name in list(agent.retiring):
        if agent.sessions.live(name):
            agent.retiring.discard(name)
        elif name not in busy:
            agent.retiring.discard(name)
            _revoke(agent, name)


def _revoke(agent, name: str) -> None:
    """No session and no transfer uses NIXL agent ``name`` any more: its staging and its metadata go
    (no transfer with it can be made any more)."""
    if agent.stager is not None:
        agent.stager.drop_peer(name)
    if agent.route is not None:
        agent.route.drop(name)  # its mapped memory goes once no copy uses it
    agent.drop_bells(name)
    if name in agent.nixl.remotes:
        try:
            agent.nixl.remove_remote(name)
        except NixlError as exc:
            log.warning("remove remote %s: %s", name, exc)


def _end_incoming(agent, s, why: str, still: bool) -> None:
    """Requests that session ``s`` could write here: its rank's share ends cancelled (``still``: another
    session of that engine rank is live, so only requests asked over ``s`` end). From another host its
    TCP connections are shut first and the share ends once they are closed (:func:`sever_turn`)."""
    for req, inc in list(agent.incoming.items()):
        asked = inc.cancel_wait.pop(s.conn_id, None) is not None
        hit = inc.via[s.rank][0] is s if s.rank in inc.via else (inc.engine is s.engine and not still)
        unknown = asked and inc.engine is None  # push, no answer yet: any producer asked to cancel may write
        if (hit and s.rank not in inc.answers or unknown) and s.conn_id not in inc.severing:
            host = _host_of(inc, s)
            if host is None:  # this host's own address (CMA / shared memory) or unknown: the session's end is it
                if hit:
                    inc.answer(s.rank, Status.CANCELLED, f"session ended ({why}); it can no longer write here")
            else:  # over TCP queued bytes still land: close the sockets first (answered by sever_turn)
                inc.severing[s.conn_id] = Severing(s, host, sever.shut(host), why)
                agent.stats["severed"] = agent.stats.get("severed", 0) + 1
                log.warning("request %s: session of %s rank %d ended (%s); closing this process's TCP "
                            "connections to %s so that no byte of it lands", req[:40], s.engine_id, s.rank, why, host)
        if _settle(agent, inc):
            del agent.incoming[req]


def _lost_sessions(inc: Incoming, lost: dict[int, bool]) -> list:
    """The live sessions ``inc`` was asked over, by ranks that have not answered, whose side channel is lost
    (``lost``: id(client) -> its look, one look per client a turn)."""
    out = []
    for rank, (s, client) in inc.via.items():
        if s.live and rank not in inc.answers:
            k = id(client)
            if k not in lost:
                lost[k] = client.lost()
            if lost[k]:
                out.append(s)
    return out


def _host_of(inc: Incoming, s) -> str | None:
    """The other host that session ``s`` writes ``inc`` from (its side-channel address), None when it is
    this host or unknown."""
    if s.rank in inc.via and inc.via[s.rank][0] is s:
        host = inc.via[s.rank][1].address[0]
    elif s.address:
        host = s.address.rsplit(":", 1)[0].strip("[]")
    else:
        return None
    return sever.remote_host(host)


LOOK_EVERY_S = 0.05  # how often the side channels of asked pull-via-push requests are looked at


def sever_turn(agent) -> None:
    """Pull-via-push requests whose producer's side channel is lost are held (a producer killed or cut off
    with asks in flight: seen within :data:`LOOK_EVERY_S`, not at their deadline) and end that session (its
    sockets are shut, :func:`_end_incoming`); a rank whose shut sockets are all closed now answers: no byte
    can land."""
    now = time.monotonic()
    look = now - agent.channels_looked >= LOOK_EVERY_S
    if look:
        agent.channels_looked = now
    lost: dict[int, bool] = {}  # id(client) -> whether its connection is gone (one look per client a turn)
    for req, inc in list(agent.incoming.items()):
        if not (inc.held or inc.severing):
            if not (look and inc.via and _lost_sessions(inc, lost)):
                continue
            hold_and_cancel(agent, inc, "its producer's side channel is lost (the producer died or its host "
                                        "is cut off)")
            if req not in agent.incoming:
                continue
        if inc.held:
            for s in _lost_sessions(inc, lost):
                agent.drop_session(s, "its side channel is lost (host cut off or gone)")
        if not inc.severing:
            continue
        _severed(inc)
        if _settle(agent, inc):
            agent.incoming.pop(req, None)


def _severed(inc: Incoming) -> None:
    """Each session ``inc`` waits to sever whose shut sockets to its host are all closed now answers."""
    for conn_id, cut in list(inc.severing.items()):
        if not cut.sockets & sever.socket_inodes(cut.host):
            del inc.severing[conn_id]
            s = cut.session
            end = (f"session ended ({cut.why}); this process's TCP connections to {cut.host} are closed: "
                   "no byte of it can land")
            if inc.engine is s.engine:
                inc.answer(s.rank, Status.CANCELLED, end)
            elif inc.engine is None:
                inc.why_held = f"{inc.why_held}; then {end}"
