"""The side channel's client: one persistent authenticated connection to a server, pipelined.

The server answers the frames of one connection one at a time, in order (:mod:`kvlc.runtime.channel.tcp`),
so a client may write several frames before the first reply comes back: each written frame is a
:class:`Ticket` in the connection's queue, and each frame read answers the oldest ticket still open.
:meth:`ChannelClient.request` is a post and a wait; :meth:`ChannelClient.post` with ``block=False``
writes from a thread that must never wait (an engine's): only when the connection is open and nobody
else is writing, and only what the socket takes at once; the reply is read by another thread
(:meth:`ChannelClient.wait`). A frame the socket takes only part of (or none of) keeps the writer's lock
on its ticket; :meth:`ChannelClient.finish` writes the rest from a thread that may wait.

A failed write or read closes the connection and fails every ticket still open on it (their frames
may or may not have been handled); a later post connects and authenticates again, as a new
connection: what the server kept for the old one is gone. Frames are not retried (they may not be
idempotent).

>>> t = Ticket(link=None)
>>> t.done, t.rest
(False, b'')
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass

from kvlc.clib import libc
from kvlc.runtime.channel import auth
from kvlc.runtime.channel.tcp import FrameReader, Limits, frame_bytes, keep_alive, parse_address, read_frame, write_frame
from kvlc.runtime.channel.wire import MAX_FRAME_BYTES
from kvlc.runtime.errors import AuthError, ChannelError


@dataclass(eq=False)
class Ticket:
    """One frame written on a connection, its reply still to read (:meth:`ChannelClient.wait`)."""

    link: _Link | None
    rest: bytes = b""  # what a non-blocking post left unwritten: its writer's lock is held until written
    reply: bytes | None = None
    error: ChannelError | None = None

    @property
    def done(self) -> bool:
        return self.reply is not None or self.error is not None


class _Link:
    """One authenticated connection: its socket, its frame protection, the tickets it owes replies to."""

    def __init__(self, sock: socket.socket, sealed: auth.Sealed):
        self.sock = sock
        self.sealed = sealed
        self.frames = FrameReader(sock)
        self.pending: deque[Ticket] = deque()
        self.broken = False


class ChannelClient:
    """A persistent authenticated, pipelined connection to one server (see the module docstring).

    :class:`ChannelError` reports a failed frame (:class:`AuthError` when the server does not prove
    the secret); the connection is then closed and the next post opens a new one.
    """

    def __init__(
        self, address: str | tuple[str, int], key: bytes, *, timeout: float = 10.0,
        max_frame: int = MAX_FRAME_BYTES, peer_timeout: float | None = Limits.peer_timeout,
    ):
        if not timeout > 0:
            raise ChannelError(f"side-channel client timeout must be a positive number of seconds, not {timeout!r}")
        self.address = parse_address(address)
        self.timeout = float(timeout)
        self.peer_timeout = peer_timeout
        self.max_frame = max_frame
        self._key = key
        self._link: _Link | None = None
        self.sealed: auth.Sealed | None = None  # the latest connection's (kept once it closes)
        self._write = threading.Lock()  # frames leave in one order: that of their tickets
        self._read = threading.Lock()   # one reader at a time; each frame read answers the oldest ticket
        self._state = threading.Lock()  # the tickets' queue and the connection's replacement

    def _where(self) -> str:
        return f"side channel {self.address[0]}:{self.address[1]}"

    def _open(self) -> _Link:
        """The open connection, or a new authenticated one (the caller holds the writer's lock)."""
        link = self._link
        if link is not None and not link.broken:
            return link
        try:
            sock = socket.create_connection(self.address, timeout=self.timeout)
        except OSError as exc:
            raise ChannelError(f"cannot reach {self._where()}: {exc}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            keep_alive(sock, self.peer_timeout)
            sealed = self._authenticate(sock)
        except BaseException:
            sock.close()
            raise
        with self._state:
            self._link, self.sealed = _Link(sock, sealed), sealed
        return self._link

    def _authenticate(self, sock: socket.socket) -> auth.Sealed:
        nc = auth.new_nonce()
        t0 = time.monotonic()
        try:
            write_frame(sock, auth.client_hello(nc))
            ns, t_server = auth.check_challenge(self._key, nc, read_frame(sock, 1024, self.timeout, self.timeout))
            t1 = time.monotonic()
            write_frame(sock, auth.client_proof(self._key, nc, ns))
            sealed = auth.Sealed(self._key, nc, ns, "client")
            if sealed.open(read_frame(sock, 1024, self.timeout, self.timeout)) != b"ok":
                raise AuthError("the server did not confirm the session")
        except AuthError as exc:
            raise AuthError(f"{self._where()}: {exc}") from None
        except (OSError, ChannelError) as exc:
            raise AuthError(
                f"{self._where()}: authentication refused ({exc}); the peer may use another secret"
            ) from None
        sealed.clock_offset = t_server - (t0 + t1) / 2
        sealed.clock_error = (t1 - t0) / 2
        return sealed

    def post(self, payload: bytes, *, block: bool = True) -> Ticket | None:
        """Write one frame; its reply is read by :meth:`wait`. ``block=False``: never waits (None where it
        would: another thread is writing, or the connection is not open); what the socket does not take
        now (all of the frame, where it has no room) stays on the ticket for :meth:`finish`."""
        if not self._write.acquire(blocking=block):
            return None
        link, keep = None, False
        try:
            link = self._open() if block else self._link
            if link is None or link.broken:
                return None
            frame = frame_bytes(link.sealed.seal(payload), self.max_frame)
            ticket = Ticket(link)
            if block:
                link.sock.sendall(frame)
            else:  # its sequence number is spent: what the socket does not take now goes later, whole
                ticket.rest = frame[_send_now(link.sock, frame):]
            with self._state:
                link.pending.append(ticket)
            keep = bool(ticket.rest)
            return ticket
        except OSError as exc:
            self._break(link, f"{exc}")
            raise ChannelError(f"{self._where()}: {exc}") from None
        finally:
            if not keep:
                self._write.release()

    def finish(self, ticket: Ticket) -> None:
        """Write what a non-blocking post left of ``ticket``'s frame (may wait), then let other writers on."""
        if not ticket.rest:
            return
        rest, ticket.rest = ticket.rest, b""
        try:
            ticket.link.sock.sendall(rest)
        except OSError as exc:
            self._break(ticket.link, f"{exc}")
        finally:
            self._write.release()

    def wait(self, ticket: Ticket) -> bytes:
        """``ticket``'s reply (frames read meanwhile answer the tickets before it)."""
        with self._read:
            link = ticket.link
            while not ticket.done:
                try:
                    payload = link.sealed.open(link.frames.read(self.max_frame, self.timeout, self.timeout))
                except (OSError, ChannelError) as exc:
                    self._break(link, f"{exc}")
                    break
                with self._state:
                    head = link.pending.popleft() if link.pending else None
                if head is None:
                    self._break(link, "a reply came that no frame asked for")
                    break
                head.reply = payload
        if ticket.error is not None:
            raise ticket.error
        return ticket.reply

    def request(self, payload: bytes) -> bytes:
        """Send one frame and return its reply."""
        return self.wait(self.post(payload))

    def _break(self, link: _Link | None, why: str) -> None:
        """Close ``link`` and fail every ticket it still owes a reply (idempotent)."""
        if link is None:
            return
        with self._state:
            link.broken = True
            owed, link.pending = list(link.pending), deque()
            if self._link is link:
                self._link = None
        for t in owed:
            t.error = ChannelError(f"{self._where()}: {why}")
        try:
            link.sock.shutdown(socket.SHUT_RDWR)  # a reader blocked on it wakes
        except OSError:
            pass
        link.sock.close()

    def connect(self) -> None:
        """Open and authenticate the connection now (a request does it too); :attr:`sealed` is then set."""
        with self._write:
            self._open()

    @property
    def connected(self) -> bool:
        """Whether this client holds an open connection now."""
        return self._link is not None

    def lost(self) -> bool:
        """Whether the connection this client authenticated is gone (the peer closed it, or a failed
        frame did); never blocks: a connection with a reply being read or still owed counts as alive."""
        if not self._read.acquire(blocking=False):
            return False
        try:
            link = self._link
            if link is None:
                return self.sealed is not None
            if link.pending:
                return False
            if not _peer_closed(link.sock):
                return False
            self._break(link, "the peer closed the connection")
            return True
        finally:
            self._read.release()

    def close(self) -> None:
        """Close the connection; tickets still owed a reply fail."""
        self._break(self._link, "closed by this side")

    def __enter__(self) -> ChannelClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# A write to a non-blocking socket returns at once; letting the interpreter go for it (as os.write does) would
# put the engine's thread behind every other thread of the process that wants it, for as long as they keep it:
# both calls go through kvlc.clib.libc, which keeps it.
_PEEK = socket.MSG_PEEK | socket.MSG_DONTWAIT
_ONE = ctypes.create_string_buffer(1)


def _peer_closed(sock: socket.socket) -> bool:
    """Whether the peer closed (or reset) the connection: a peek at one byte that never waits, in C with the
    interpreter held (a select and a recv through the socket module would let it go to any busy thread of
    the engine: up to the switch interval, 5 ms, before this request went on). 0 bytes: closed; a byte or
    nothing to read: open (a reply never comes unasked); an error other than "nothing now": gone."""
    n = libc.recv(sock.fileno(), _ONE, 1, _PEEK)
    if n >= 0:
        return n == 0
    return ctypes.get_errno() not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR)


def _send_now(sock: socket.socket, frame: bytes) -> int:
    """Bytes of ``frame`` the socket takes without waiting (0: no room now). A client socket always has a
    timeout, so its descriptor is non-blocking: the write returns at once (the socket module's own send
    would first wait up to that timeout for room)."""
    n = libc.write(sock.fileno(), frame, len(frame))
    if n >= 0:
        return n
    err = ctypes.get_errno()
    if err in (errno.EAGAIN, errno.EWOULDBLOCK):
        return 0
    raise OSError(err, os.strerror(err))
