"""The side channel: a small TCP server per agent and a client, length-prefixed frames.

A frame is a 4-byte big-endian length followed by that many bytes (at most
``max_frame``). The server answers each request frame with one reply frame, on
a thread per connection; what the bytes mean is the handler's business
(:mod:`kvlc.runtime.wire`). Hostile input never takes the server down: an
oversize or truncated frame closes that connection (after an error reply when
one can be sent), a handler exception becomes an error reply, idle connections
time out, and connections beyond ``max_connections`` are closed at once.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import struct
import threading
from collections.abc import Callable

from kvlc.runtime.errors import ChannelError
from kvlc.runtime.wire import MAX_FRAME_BYTES

log = logging.getLogger("kvlc.runtime.channel")
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


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ChannelError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def read_frame(sock: socket.socket, max_frame: int = MAX_FRAME_BYTES) -> bytes:
    """Read one frame; :class:`ChannelError` when oversize, truncated or the peer closed."""
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if n > max_frame:
        raise ChannelError(f"frame of {n} bytes is over the {max_frame}-byte limit")
    return _recv_exact(sock, n)


def write_frame(sock: socket.socket, payload: bytes, max_frame: int = MAX_FRAME_BYTES) -> None:
    if len(payload) > max_frame:
        raise ChannelError(f"frame of {len(payload)} bytes is over the {max_frame}-byte limit")
    sock.sendall(_HEADER.pack(len(payload)) + payload)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    block_on_close = False
    request_queue_size = 128


class ChannelServer:
    """Serve ``handler(request bytes) -> reply bytes`` on ``host:port`` (port 0: any free port).

    ``on_error(text) -> bytes`` encodes an error reply for framing problems and
    handler exceptions.
    """

    def __init__(
        self,
        handler: Callable[[bytes], bytes],
        on_error: Callable[[str], bytes],
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_frame: int = MAX_FRAME_BYTES,
        io_timeout: float = 30.0,
        max_connections: int = 64,
    ):
        self.handler = handler
        self.on_error = on_error
        self.max_frame = max_frame
        self.io_timeout = io_timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        self.stats = {"connections": 0, "frames": 0, "refused": 0, "errors": 0}
        outer = self

        class _Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._serve(self.request)

        try:
            self._server = _Server((host, port), _Handler)
        except OSError as exc:
            raise ChannelError(f"cannot listen on {host}:{port}: {exc}") from None
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"kvlc-channel-{self.address[1]}",
            daemon=True,
        )
        self._thread.start()
        self.closed = False

    @property
    def address(self) -> Address:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def _serve(self, sock: socket.socket) -> None:
        if not self._slots.acquire(blocking=False):
            self.stats["refused"] += 1
            sock.close()
            return
        self.stats["connections"] += 1
        try:
            sock.settimeout(self.io_timeout)
            while True:
                try:
                    frame = read_frame(sock, self.max_frame)
                except ChannelError as exc:
                    if "after 0 of 4" not in str(exc):  # not a clean close between frames
                        self.stats["errors"] += 1
                        self._try_reply(sock, self.on_error(str(exc)))
                    return
                except (TimeoutError, OSError):
                    return
                self.stats["frames"] += 1
                try:
                    reply = self.handler(frame)
                except Exception as exc:  # a handler bug must not kill the server
                    self.stats["errors"] += 1
                    log.exception("side-channel handler failed")
                    reply = self.on_error(f"internal error: {type(exc).__name__}: {exc}")
                if not self._try_reply(sock, reply):
                    return
        finally:
            self._slots.release()
            try:
                sock.close()
            except OSError:
                pass

    def _try_reply(self, sock: socket.socket, payload: bytes) -> bool:
        try:
            write_frame(sock, payload, self.max_frame)
            return True
        except (OSError, ChannelError):
            return False

    def close(self) -> None:
        """Stop serving (idempotent); open connections end at their next frame."""
        if self.closed:
            return
        self.closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class ChannelClient:
    """A persistent connection to one server; :meth:`request` sends a frame and returns the reply.

    A failed request closes the connection (the next one reconnects) and raises
    :class:`ChannelError`; requests are not retried (they may not be idempotent).
    """

    def __init__(
        self, address: str | tuple[str, int], *, timeout: float = 10.0, max_frame: int = MAX_FRAME_BYTES
    ):
        self.address = parse_address(address)
        self.timeout = timeout
        self.max_frame = max_frame
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def _connect(self) -> socket.socket:
        if self._sock is None:
            try:
                self._sock = socket.create_connection(self.address, timeout=self.timeout)
            except OSError as exc:
                raise ChannelError(
                    f"cannot reach side channel at {self.address[0]}:{self.address[1]}: {exc}"
                ) from None
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self._sock

    def request(self, payload: bytes) -> bytes:
        with self._lock:
            sock = self._connect()
            try:
                write_frame(sock, payload, self.max_frame)
                return read_frame(sock, self.max_frame)
            except (OSError, ChannelError) as exc:
                self._close()
                raise ChannelError(f"side channel {self.address[0]}:{self.address[1]}: {exc}") from None

    def _close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._close()

    def __enter__(self) -> ChannelClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
