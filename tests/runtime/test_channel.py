"""The side channel: authenticated connections, length-prefixed frames, bounds that hostile clients cannot
get around (whole-frame deadlines, per-address caps, nothing kept before authentication)."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from kvlc.runtime.channel import auth
from kvlc.runtime.channel.client import ChannelClient
from kvlc.runtime.channel.tcp import ChannelServer, Limits, frame_bytes, parse_address, read_frame, write_frame
from kvlc.runtime.errors import AuthError, ChannelError

pytestmark = pytest.mark.runtime
KEY = auth.resolve_secret("channel-test-secret-0123456789")
LIMITS = Limits(max_frame=1024, handshake_timeout=1.0, frame_timeout=1.0, max_connections=16,
                max_per_address=4, max_pending_per_address=3)


@pytest.fixture
def echo():
    seen = []

    def handler(conn, frame: bytes) -> bytes:
        seen.append(conn.id)
        if frame == b"boom":
            raise RuntimeError("handler bug")
        return b"echo:" + frame

    server = ChannelServer(handler, lambda text: b"error:" + text.encode(), KEY, limits=LIMITS)
    server.seen = seen
    yield server
    server.close()


def _raw(server):
    return socket.create_connection(server.address, timeout=5)


def _wait(pred, timeout=10.0):
    end = time.monotonic() + timeout
    while not pred() and time.monotonic() < end:
        time.sleep(0.02)
    return pred()


def test_request_reply_on_one_authenticated_connection(echo):
    """One authenticated connection carries many request/reply frames, all seen as the same connection."""
    with ChannelClient(echo.address, KEY) as c:
        for i in range(20):
            assert c.request(b"x%d" % i) == b"echo:x%d" % i
        assert set(echo.seen) == {c.sealed.id}
    assert echo.stats["connections"] == 1


def test_wrong_secret_is_refused_both_ways(echo):
    """A client with another secret gets AuthError and the handler never runs; a server with another
    secret cannot fool a client either."""
    other = auth.resolve_secret("another-secret-0123456789")
    with pytest.raises(AuthError, match="does not know this side-channel secret"):
        ChannelClient(echo.address, other, timeout=2).request(b"hi")
    assert echo.seen == [] and echo.stats["auth_failed"] >= 0
    fake = ChannelServer(lambda conn, f: b"owned", lambda t: b"", other, limits=LIMITS)
    try:
        with pytest.raises(AuthError):
            ChannelClient(fake.address, KEY, timeout=2).request(b"hi")
    finally:
        fake.close()


def test_unauthenticated_frames_reach_no_handler(echo):
    """Frames sent without the handshake, or after a bad proof, never reach the handler."""
    s = _raw(echo)
    write_frame(s, b"fetch me a record")
    with pytest.raises(ChannelError):
        read_frame(s, 1024, 2.0, 2.0)
    s.close()
    s = _raw(echo)
    write_frame(s, auth.client_hello(auth.new_nonce()))
    read_frame(s, 1024, 2.0, 2.0)
    write_frame(s, b"\0" * auth.TAG)  # a proof without the key
    with pytest.raises(ChannelError):
        read_frame(s, 1024, 2.0, 2.0)
    s.close()
    assert echo.seen == []


def test_replayed_or_changed_frames_end_the_connection(echo):
    """A sealed frame replayed, or one with a flipped byte, fails authentication; the handler saw it once."""
    c = ChannelClient(echo.address, KEY)
    c.request(b"first")
    sealed = c.sealed
    replay = sealed.seal(b"again")
    write_frame(c._link.sock, replay)
    assert sealed.open(read_frame(c._link.sock)) == b"echo:again"
    write_frame(c._link.sock, replay)  # the same bytes again: sequence number already used
    with pytest.raises(ChannelError):
        read_frame(c._link.sock, 1024, 2.0, 2.0)
    c.close()
    c = ChannelClient(echo.address, KEY)
    c.request(b"ok")
    bad = bytearray(c.sealed.seal(b"change me"))
    bad[10] ^= 1
    write_frame(c._link.sock, bytes(bad))
    with pytest.raises(ChannelError):
        read_frame(c._link.sock, 1024, 2.0, 2.0)
    c.close()
    assert echo.seen.count(echo.seen[0]) == 2 and len(echo.seen) == 3


def test_slow_frames_are_cut_at_the_frame_deadline(echo):
    """A byte every 0.3 s does not keep a frame open: the connection ends at the whole-frame deadline."""
    c = ChannelClient(echo.address, KEY)
    c.request(b"authenticated first")
    frame = struct.pack(">I", 200) + c.sealed.seal(b"x" * 150)
    t0 = time.monotonic()
    closed = False
    for b in frame[:20]:
        try:
            c._link.sock.sendall(bytes([b]))
            time.sleep(0.3)
        except OSError:
            closed = True
            break
    if not closed:
        c._link.sock.settimeout(3)
        try:
            closed = c._link.sock.recv(1) == b""
        except OSError:
            closed = True
    assert closed and time.monotonic() - t0 < 8
    c.close()


def test_idle_sockets_from_one_address_cannot_lock_it_out(echo):
    """50 silent sockets from one address (every engine of a host connects from it): at most 3 wait
    for a handshake at a time, the oldest cut for each new one; an authenticated client from the
    same address is served at once, while the silent sockets are still held open, and again after
    the attacker opens more."""
    socks = [_raw(echo) for _ in range(50)]
    assert _wait(lambda: echo.stats["evicted"] >= 47)
    with ChannelClient(echo.address, KEY, timeout=5) as c:
        assert c.request(b"still") == b"echo:still"
    socks += [_raw(echo) for _ in range(LIMITS.max_pending_per_address)]
    with ChannelClient(echo.address, KEY, timeout=5) as c:
        assert c.request(b"again") == b"echo:again"
    assert echo.stats["refused"] == 0
    assert _wait(lambda: echo._pending["127.0.0.1"] <= LIMITS.max_pending_per_address)
    for s in socks:
        s.close()
    assert _wait(lambda: echo._pending["127.0.0.1"] == 0 and not echo._waiting)


def test_authenticated_connections_are_capped_per_address(echo):
    """Over max_per_address authenticated connections from one address, new ones are closed at once."""
    held = [ChannelClient(echo.address, KEY) for _ in range(LIMITS.max_per_address)]
    for c in held:
        c.request(b"hold")
    with pytest.raises(ChannelError):
        ChannelClient(echo.address, KEY, timeout=2).request(b"no room")
    held.pop().close()
    assert _wait(lambda: _try(echo))
    for c in held:
        c.close()


def _try(server) -> bool:
    try:
        with ChannelClient(server.address, KEY, timeout=2) as c:
            return c.request(b"room?") == b"echo:room?"
    except ChannelError:
        return False


def test_handler_exception_becomes_an_error_reply(echo):
    """A handler bug answers an error and the connection keeps working."""
    with ChannelClient(echo.address, KEY) as c:
        assert c.request(b"boom").startswith(b"error:internal error: RuntimeError")
        assert c.request(b"after") == b"echo:after"


def test_random_garbage_never_kills_the_server(echo):
    """Bursts of random bytes from many clients leave the server answering and the handler untouched."""
    import random

    rng = random.Random(7)

    def spam():
        for _ in range(10):
            try:
                s = _raw(echo)
                s.sendall(bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64))))
                s.close()
            except OSError:
                pass

    threads = [threading.Thread(target=spam) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert echo.seen == []
    assert _wait(lambda: _try(echo))


def test_unreachable_server_raises_channel_error():
    """A closed port is a ChannelError naming the address."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(ChannelError, match=f"127.0.0.1:{port}"):
        ChannelClient(("127.0.0.1", port), KEY, timeout=1).request(b"x")


def test_frames_addresses_and_secrets():
    """Frames round-trip over a socket pair; addresses parse; short or missing secrets are refused."""
    a, b = socket.socketpair()
    write_frame(a, b"payload")
    assert read_frame(b) == b"payload"
    with pytest.raises(ChannelError, match="over the 3-byte limit"):
        write_frame(a, b"toolong", max_frame=3)
    a.close()
    with pytest.raises(ChannelError, match="closed"):
        read_frame(b)
    assert parse_address("[::1]:80") == ("::1", 80)
    with pytest.raises(ChannelError):
        parse_address("nohost")
    with pytest.raises(AuthError, match="at least 16"):
        auth.resolve_secret("short")


def test_secret_sources_in_order(tmp_path, monkeypatch):
    """secret= beats $KVLC_SECRET beats $KVLC_SECRET_FILE; none refuses unless insecure=True."""
    monkeypatch.delenv("KVLC_SECRET", raising=False)
    monkeypatch.delenv("KVLC_SECRET_FILE", raising=False)
    with pytest.raises(AuthError, match="no side-channel secret"):
        auth.resolve_secret()
    insecure = auth.resolve_secret(insecure=True)
    f = tmp_path / "secret"
    f.write_text("file-secret-0123456789\n")
    monkeypatch.setenv("KVLC_SECRET_FILE", str(f))
    assert auth.resolve_secret() == auth.derive_key(b"file-secret-0123456789") != insecure
    monkeypatch.setenv("KVLC_SECRET", "env-secret-0123456789")
    assert auth.resolve_secret() == auth.derive_key(b"env-secret-0123456789")
    assert auth.resolve_secret("arg-secret-0123456789") == auth.derive_key(b"arg-secret-0123456789")


def test_pipelined_frames_get_their_own_replies_in_any_wait_order(echo):
    """Frames written before any reply is read are answered in order; each ticket gets its own reply
    whichever is waited for first, and a request between them still gets its own."""
    with ChannelClient(echo.address, KEY) as c:
        tickets = [c.post(b"p%d" % i) for i in range(5)]
        assert c.request(b"between") == b"echo:between"
        for i in (4, 0, 2, 3, 1):
            assert c.wait(tickets[i]) == b"echo:p%d" % i


def _together(n: int, *, max_batch: int = 16, bad_at: int | None = None):
    """``n`` frames written in one send on an authenticated connection (they come in together), the frame
    at ``bad_at`` with a flipped byte; returns the replies read back (until the server ends the
    connection), the batches the server handled in one ``serving`` context, and the server's stats."""
    batches: list[list[bytes]] = []

    class Serving:
        def __init__(self, conn):
            self.conn = conn

        def __enter__(self):
            batches.append([])

        def __exit__(self, *exc):
            batches[-1] = tuple(batches[-1])

    def handler(conn, frame: bytes) -> bytes:
        batches[-1].append(frame)
        if frame == b"f4":
            raise RuntimeError("handler bug")
        return b"echo:" + frame

    server = ChannelServer(handler, lambda text: b"error:" + text.encode(), KEY, serving=Serving,
                           limits=Limits(max_frame=1024, max_batch=max_batch))
    try:
        c = ChannelClient(server.address, KEY)
        assert c.request(b"hello") == b"echo:hello"
        sealed = [bytearray(c.sealed.seal(b"f%d" % i)) for i in range(n)]
        if bad_at is not None:
            sealed[bad_at][10] ^= 1
        sock = c._link.sock
        sock.sendall(b"".join(frame_bytes(bytes(f)) for f in sealed))
        replies = []
        while len(replies) < n:
            try:
                replies.append(c.sealed.open(read_frame(sock, 1024, 2.0, 2.0)))
            except ChannelError:
                break
        c.close()
        return replies, batches[1:], server.stats
    finally:
        server.close()


def test_frames_that_come_in_together_are_handled_in_one_context_and_answered_in_order():
    """Frames written back to back are handled one after another inside one serving context (at most
    max_batch a context), each answered, in order; a frame that fails authentication among them ends
    the connection after the frames before it were answered, and nothing after it is handled; a handler that
    raises on one of them answers that one with an error and the rest as usual."""
    want = [b"echo:f%d" % i if i != 4 else b"error:internal error: RuntimeError: handler bug" for i in range(10)]
    replies, batches, stats = _together(10)
    assert replies == want
    assert [f for b in batches for f in b] == [b"f%d" % i for i in range(10)]
    assert len(batches) == 1 and stats["frames"] == 11  # one send on loopback arrives in one read
    replies, batches, _ = _together(10, max_batch=4)
    assert replies == want
    assert [len(b) for b in batches] == [4, 4, 2]
    replies, batches, stats = _together(6, bad_at=3)
    assert replies == [b"echo:f0", b"echo:f1", b"echo:f2"]
    assert [f for b in batches for f in b] == [b"f0", b"f1", b"f2"] and stats["errors"] == 1


@pytest.mark.parametrize("where", ["enter", "exit"])
def test_a_serving_context_that_fails_is_logged_and_every_frame_still_answered(where):
    """A serving context that raises on entering (no frame handled: each gets an error reply) or on leaving
    (the replies made stand) is counted as an error; the connection and the server carry on."""
    class Failing:
        def __init__(self, conn):
            pass

        def __enter__(self):
            if where == "enter":
                raise RuntimeError("enter bug")

        def __exit__(self, *exc):
            if where == "exit":
                raise RuntimeError("exit bug")

    server = ChannelServer(lambda conn, f: b"echo:" + f, lambda text: b"error:" + text.encode(), KEY,
                           serving=Failing, limits=LIMITS)
    try:
        with ChannelClient(server.address, KEY) as c:
            for i in range(3):
                want = b"echo:x%d" % i if where == "exit" else b"error:internal error: RuntimeError: enter bug"
                assert c.request(b"x%d" % i) == want
        assert server.stats["errors"] == 3
    finally:
        server.close()


def test_a_post_that_must_not_wait_refuses_rather_than_waits(echo):
    """block=False never waits: not connected, or another writer busy -> None (nothing written)."""
    c = ChannelClient(echo.address, KEY)
    assert c.post(b"x", block=False) is None  # not connected yet: connecting waits
    c.connect()
    c._write.acquire()  # another thread is writing
    try:
        assert c.post(b"x", block=False) is None
    finally:
        c._write.release()
    t = c.post(b"y", block=False)
    assert t is not None and not t.rest and c.wait(t) == b"echo:y"
    assert echo.seen.count(c.sealed.id) == 1
    c.close()


def test_a_frame_the_socket_takes_in_part_is_finished_later_and_nothing_passes_it():
    """A frame larger than the socket's room: a non-blocking post writes what fits and leaves the rest
    (and the writer's lock) on its ticket; finish() writes it; every reply then arrives in order."""
    go = threading.Event()

    def handler(conn, frame: bytes) -> bytes:
        go.wait(10)
        return b"%d" % len(frame)

    server = ChannelServer(handler, lambda text: text.encode(), KEY, limits=Limits(max_frame=8 << 20))
    c = ChannelClient(server.address, KEY, max_frame=8 << 20)
    try:
        c.connect()
        c._link.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
        big = c.post(b"z" * (4 << 20), block=False)
        assert big is not None and 0 < len(big.rest) < (4 << 20)
        assert c.post(b"late", block=False) is None  # the partial frame holds the writer's lock
        finisher = threading.Thread(target=c.finish, args=(big,))
        finisher.start()
        go.set()
        finisher.join(10)
        assert not big.rest
        assert c.request(b"after") == b"5"
        assert c.wait(big) == b"%d" % (4 << 20)
    finally:
        c.close()
        server.close()


def test_a_broken_connection_fails_every_ticket_it_owes(echo):
    """A connection that breaks with replies owed fails each waiting ticket once; the next request connects anew."""
    c = ChannelClient(echo.address, KEY)
    tickets = [c.post(b"a"), c.post(b"b")]
    first = c.sealed.id
    c.close()
    for t in tickets:
        with pytest.raises(ChannelError):
            c.wait(t)
    assert c.request(b"again") == b"echo:again" and c.sealed.id != first
    c.close()
