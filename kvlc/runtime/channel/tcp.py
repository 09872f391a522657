"""The side channel: an authenticated TCP server per agent and its client, length-prefixed frames.

A frame is a 4-byte big-endian length followed by that many bytes (at most
``max_frame``). Every connection starts with the handshake of :mod:`kvlc.runtime.channel.auth`;
before it completes the server keeps nothing but the connection's nonces, accepts only
frames of the handshake's exact sizes, and ends the connection at ``handshake_timeout``.
After it, every frame is sealed (sequence number + HMAC) and the server answers each
request frame with one reply frame, in order, on a thread per connection; what the bytes mean is
the handler's business (:mod:`kvlc.runtime.channel.wire`). Frames a client wrote back to back and
that came in together (up to ``max_batch``) are handled one after another inside one ``serving(conn)``
context (the handler's owner ends there what they started: a producer's progress step after
several pull requests, :meth:`kvlc.runtime.agent.KvAgent.serving`) and their replies go out in one write.

Bounds against a hostile or broken client: a whole frame must arrive within
``frame_timeout`` of its first byte (a byte every few seconds does not keep a frame
open), an idle connection ends after ``idle_timeout``, at most ``max_connections``
connections in all, ``max_per_address`` authenticated ones and ``max_pending_per_address``
unauthenticated ones per peer address. A new connection over a pending cap cuts the oldest
connection still in its handshake (idle connections from one address, where every engine of a
host connects from, cannot lock that address out); an authenticated one over its cap is closed.

A peer whose host goes silent (link down, host lost) is given up after ``peer_timeout`` seconds on
both ends, also on a connection with no frame in flight (TCP keepalive probes and
``TCP_USER_TIMEOUT``, :func:`keep_alive`): the server ends the session the connection carried and
the client sees the connection lost (:meth:`kvlc.runtime.channel.client.ChannelClient.lost`), so a peer reconnects after an
outage longer than that instead of carrying on with a session the other side ended.

Closing the server cuts its open connections too, so clients see the close at once, as after
a crash (:meth:`kvlc.runtime.channel.client.ChannelClient.lost`), instead of at their next request.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from kvlc.runtime.channel import auth
from kvlc.runtime.errors import AuthError, ChannelError
from kvlc.runtime.channel.wire import MAX_FRAME_BYTES

log = logging.getLogger("kvlc.runtime.channel.tcp")
_HEADER = struct.Struct(">I")

Address = tuple[str, int]


def parse_address(address: str | tuple[str, int]) -> Address:
    """``"host:port"`` or ``(host, port)`` → ``(host, port)``.

    >>> parse_address("127.0.0.1:5555"), parse_address(("localhost", 7))
    (('127.0.0.1', 5555), ('localhost', 7))
    """
    if isinstance(address, str):
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            raise ChannelError(f"address {address!r}: expected HOST:PORT")
        return host.strip("[]") or "127.0.0.1", int(port)
    host, port = address
    return str(host), int(port)


def read_frame(
    sock: socket.socket,
    max_frame: int = MAX_FRAME_BYTES,
    frame_timeout: float | None = None,
    idle_timeout: float | None = None,
) -> bytes:
    """Read exactly one frame (nothing past it: the handshake's frames); :class:`ChannelError` when oversize,
    truncated, too slow or the peer closed. ``idle_timeout`` bounds the wait for the first byte,
    ``frame_timeout`` the rest of the frame."""
    return FrameReader(sock, ahead=False).read(max_frame, frame_timeout, idle_timeout)


class FrameReader:
    """The frames of one connection: the first byte within ``idle_timeout``, the rest of the frame within
    ``frame_timeout`` of the call that waits for it. ``ahead`` (an authenticated connection's reader): one
    ``recv`` of up to a chunk usually brings a whole frame (and whatever of the next one has come), where
    exact reads make three, each letting the interpreter go and waiting to get it back behind the process's
    busy threads; one reader per socket then (what it read ahead is its own)."""

    CHUNK = 1 << 16

    def __init__(self, sock: socket.socket, ahead: bool = True):
        self.sock = sock
        self._chunk = self.CHUNK if ahead else 0
        self._buf = bytearray()

    def read(self, max_frame: int = MAX_FRAME_BYTES, frame_timeout: float | None = None,
             idle_timeout: float | None = None) -> bytes:
        if not self._buf:
            self._recv(idle_timeout, 0, _HEADER.size, idle=True, want=_HEADER.size)
        deadline = None if frame_timeout is None else time.monotonic() + frame_timeout
        while len(self._buf) < _HEADER.size:
            self._recv(deadline, len(self._buf), _HEADER.size, want=_HEADER.size - len(self._buf))
        (n,) = _HEADER.unpack_from(self._buf)
        if n > max_frame:
            raise ChannelError(f"frame of {n} bytes is over the {max_frame}-byte limit")
        end = _HEADER.size + n
        while len(self._buf) < end:
            self._recv(deadline, len(self._buf) - _HEADER.size, n, want=end - len(self._buf))
        frame = bytes(self._buf[_HEADER.size:end])
        del self._buf[:end]
        return frame

    def complete(self) -> bool:
        """Whether a whole frame was read ahead already (:meth:`read` then returns it without waiting)."""
        if len(self._buf) < _HEADER.size:
            return False
        (n,) = _HEADER.unpack_from(self._buf)
        return len(self._buf) >= _HEADER.size + n

    def _recv(self, limit: float | None, have: int, of: int, want: int, idle: bool = False) -> None:
        """Read what has come, up to ``want`` bytes (the rest of the piece being read) or a chunk ahead if
        more; ``limit``: the idle wait, or the deadline."""
        if idle:
            self.sock.settimeout(limit)
        elif limit is not None:
            left = limit - time.monotonic()
            if left <= 0:
                raise ChannelError(f"frame incomplete at its deadline ({have} of {of} bytes)")
            self.sock.settimeout(left)
        try:
            chunk = self.sock.recv(min(max(self._chunk, want), 1 << 20))
        except TimeoutError:
            if idle:
                raise ChannelError("idle: no frame started in time") from None
            raise ChannelError(f"frame incomplete at its deadline ({have} of {of} bytes)") from None
        if not chunk:
            raise ChannelError(f"connection closed after {have} of {of} bytes")
        self._buf += chunk


def frame_bytes(payload: bytes, max_frame: int = MAX_FRAME_BYTES) -> bytes:
    """``payload`` as one frame on the wire (its length first)."""
    if len(payload) > max_frame:
        raise ChannelError(f"frame of {len(payload)} bytes is over the {max_frame}-byte limit")
    return _HEADER.pack(len(payload)) + payload


def write_frame(sock: socket.socket, payload: bytes, max_frame: int = MAX_FRAME_BYTES) -> None:
    sock.sendall(frame_bytes(payload, max_frame))


def write_frames(sock: socket.socket, payloads: list[bytes], max_frame: int = MAX_FRAME_BYTES) -> None:
    """Several frames in one write (a batch's replies, in order)."""
    sock.sendall(b"".join(frame_bytes(p, max_frame) for p in payloads))


def keep_alive(sock: socket.socket, seconds: float | None) -> None:
    """Give ``sock`` up when its peer's host stays silent for about ``seconds`` (None: never): keepalive
    probes start after half of it, and unacknowledged data or probes end the connection at it."""
    if not seconds:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, int(seconds // 2)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, int(seconds // 6)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(seconds * 1000))


@dataclass
class Conn:
    """One authenticated connection as the handler sees it: its id, keys, peer address, and a slot
    where the handler keeps what this connection introduced (its session)."""

    sealed: auth.Sealed
    peer: Address
    session: Any = None
    extra: dict = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.sealed.id


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    block_on_close = False
    request_queue_size = 128


@dataclass(frozen=True)
class Limits:
    """The side channel's bounds (seconds and counts); see the module docstring."""

    max_frame: int = MAX_FRAME_BYTES
    handshake_timeout: float = 5.0
    frame_timeout: float = 10.0
    idle_timeout: float | None = None  # authenticated connections are capped per address instead
    max_connections: int = 256
    max_per_address: int = 64
    max_batch: int = 16  # frames that came in together, handled in one serving context, replies in one write
    max_pending_per_address: int = 8
    peer_timeout: float | None = 30.0  # a silent peer host's connections end after this (keep_alive)


class ChannelServer:
    """Serve ``handler(conn, request bytes) -> reply bytes`` on ``host:port`` (port 0: any free port).

    ``key``: the channel key (:func:`kvlc.runtime.channel.auth.resolve_secret`). ``on_error(text) -> bytes``
    encodes an error reply for handler exceptions; ``on_close(conn)`` runs when an authenticated
    connection ends; ``serving(conn)`` (a context manager) is entered around each batch of frames that
    came in together (module docstring).
    """

    def __init__(
        self,
        handler: Callable[[Conn, bytes], bytes],
        on_error: Callable[[str], bytes],
        key: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        limits: Limits = Limits(),
        on_close: Callable[[Conn], None] | None = None,
        serving: Callable[[Conn], AbstractContextManager] | None = None,
    ):
        self.handler, self.on_error, self.on_close = handler, on_error, on_close
        self.serving = serving or (lambda conn: nullcontext())
        self.limits = limits
        self._key = key
        self._lock = threading.Lock()
        self._pending: Counter = Counter()
        self._authed: Counter = Counter()
        self._open = 0
        self._waiting: dict[int, tuple[str, socket.socket]] = {}  # connections in their handshake, oldest first
        self._conns: dict[int, tuple[socket.socket, threading.Thread]] = {}  # every open connection
        self.stats = Counter(connections=0, frames=0, refused=0, errors=0, auth_failed=0, evicted=0)
        outer = self

        class _Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._serve(self.request, self.client_address)

        try:
            self._server = _Server((host, port), _Handler)
        except OSError as exc:
            raise ChannelError(f"cannot listen on {host}:{port}: {exc}") from None
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
            name=f"kvlc-channel-{self.address[1]}", daemon=True,
        )
        self._thread.start()
        self.closed = False

    @property
    def address(self) -> Address:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def _admit(self, ip: str, sock: socket.socket) -> bool:
        """Count a new connection as pending. At a cap, the oldest connection still in its handshake
        (of this address; of any, at the total cap) is cut to make room: idle connections cannot
        lock an address out, and a client that authenticates in time is never the one cut."""
        with self._lock:
            lim = self.limits
            if self._pending[ip] >= lim.max_pending_per_address:
                self._evict(ip)
            elif self._open >= lim.max_connections and not self._evict(None):
                self.stats["refused"] += 1
                return False
            self._open += 1
            self._pending[ip] += 1
            self._waiting[id(sock)] = (ip, sock)
            self._conns[id(sock)] = (sock, threading.current_thread())
            return True

    def _evict(self, ip: str | None) -> bool:
        """Cut the oldest connection still in its handshake (from ``ip``; None: from anywhere); the
        lock is held. Its handler ends on the closed socket and uncounts it."""
        for key, (who, sock) in self._waiting.items():
            if ip is None or who == ip:
                del self._waiting[key]
                self.stats["evicted"] += 1
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return True
        return False

    def _promote(self, ip: str, sock: socket.socket) -> bool:
        with self._lock:
            self._pending[ip] -= 1
            self._waiting.pop(id(sock), None)
            if self._authed[ip] >= self.limits.max_per_address:
                self.stats["refused"] += 1
                return False
            self._authed[ip] += 1
            return True

    def _handshake(self, sock: socket.socket) -> auth.Sealed:
        lim = self.limits
        deadline = time.monotonic() + lim.handshake_timeout
        left = lambda: max(0.001, deadline - time.monotonic())  # noqa: E731
        nc = auth.parse_hello(read_frame(sock, auth.HELLO_BYTES, left(), left()))
        ns = auth.new_nonce()
        write_frame(sock, auth.server_challenge(self._key, nc, ns, time.monotonic()))
        auth.check_proof(self._key, nc, ns, read_frame(sock, auth.TAG, left(), left()))
        sealed = auth.Sealed(self._key, nc, ns, "server")
        write_frame(sock, sealed.seal(b"ok"))
        return sealed

    def _serve(self, sock: socket.socket, peer: Address) -> None:
        ip = peer[0]
        if not self._admit(ip, sock):
            sock.close()
            return
        keep_alive(sock, self.limits.peer_timeout)
        counted = "pending"
        try:
            try:
                sealed = self._handshake(sock)
            except (AuthError, ChannelError, OSError) as exc:
                self.stats["auth_failed"] += 1
                log.info("side channel: %s:%s not authenticated: %s", ip, peer[1], exc)
                return
            counted = "authed" if self._promote(ip, sock) else None
            if counted is None:
                return
            self.stats["connections"] += 1
            conn = Conn(sealed, peer)
            try:
                self._loop(sock, conn)
            finally:
                if self.on_close is not None:
                    self.on_close(conn)
        finally:
            with self._lock:
                self._open -= 1
                self._conns.pop(id(sock), None)
                if counted == "authed":
                    self._authed[ip] -= 1
                elif counted == "pending":
                    self._pending[ip] -= 1
                    self._waiting.pop(id(sock), None)
            try:
                sock.close()
            except OSError:
                pass

    def _loop(self, sock: socket.socket, conn: Conn) -> None:
        lim = self.limits
        frames = FrameReader(sock)
        while not self.closed:
            batch, ended = [], False
            try:
                batch.append(conn.sealed.open(frames.read(lim.max_frame, lim.frame_timeout, lim.idle_timeout)))
                while len(batch) < lim.max_batch and frames.complete():  # came in together: no wait
                    batch.append(conn.sealed.open(frames.read(lim.max_frame)))
            except (ChannelError, OSError) as exc:
                if "after 0 of 4" not in str(exc):
                    self.stats["errors"] += 1
                ended = True  # the frames before it are still answered
            if not batch:
                return
            self.stats["frames"] += len(batch)
            replies = self._answer_all(conn, batch)
            try:
                write_frames(sock, [conn.sealed.seal(r) for r in replies], lim.max_frame)
            except (OSError, ChannelError):
                return
            if ended:
                return

    def _answer_all(self, conn: Conn, batch: list[bytes]) -> list[bytes]:
        """Every frame of ``batch`` answered, in order, inside one ``serving`` context; a context that fails to
        open or close is logged and counted (a bug there must not kill the server), and the frames it left
        unanswered get an error reply each."""
        replies: list[bytes] = []
        try:
            with self.serving(conn):
                for frame in batch:
                    replies.append(self._answer(conn, frame))
        except Exception as exc:
            self.stats["errors"] += 1
            log.exception("side-channel serving context failed")
            replies += [self.on_error(f"internal error: {type(exc).__name__}: {exc}")] * (len(batch) - len(replies))
        return replies

    def _answer(self, conn: Conn, frame: bytes) -> bytes:
        try:
            return self.handler(conn, frame)
        except Exception as exc:  # a handler bug must not kill the server
            self.stats["errors"] += 1
            log.exception("side-channel handler failed")
            return self.on_error(f"internal error: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Stop serving and cut every open connection (idempotent); returns once their handlers ended
        (``on_close`` ran), or after 5 s."""
        if self.closed:
            return
        self.closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        with self._lock:
            conns = list(self._conns.values())
        for sock, _ in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + 5
        for _, thread in conns:
            if thread is not threading.current_thread():
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
