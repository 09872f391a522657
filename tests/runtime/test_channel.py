"""The side channel: length-prefixed frames, size caps, and a server that hostile input cannot take down."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from kvlc.runtime.channel import ChannelClient, ChannelServer, parse_address, read_frame, write_frame
from kvlc.runtime.errors import ChannelError

pytestmark = pytest.mark.runtime


@pytest.fixture
def echo():
    def handler(frame: bytes) -> bytes:
        if frame == b"boom":
            raise RuntimeError("handler bug")
        return b"echo:" + frame

    server = ChannelServer(
        handler, lambda text: b"error:" + text.encode(), max_frame=1024, io_timeout=2.0, max_connections=4
    )
    yield server
    server.close()


def _raw(server):
    s = socket.create_connection(server.address, timeout=5)
    return s


def test_request_reply_on_a_persistent_connection(echo):
    """One client connection carries many request/reply frames."""
    with ChannelClient(echo.address) as c:
        for i in range(20):
            assert c.request(b"x%d" % i) == b"echo:x%d" % i
    assert echo.stats["connections"] == 1


def test_oversize_frame_is_refused_and_server_survives(echo):
    """A length header over the cap gets an error reply and a closed connection; the server still serves."""
    s = _raw(echo)
    s.sendall(struct.pack(">I", 1 << 30))
    assert read_frame(s).startswith(b"error:frame of 1073741824 bytes is over the 1024-byte limit")
    s.close()
    with ChannelClient(echo.address) as c:
        assert c.request(b"ok") == b"echo:ok"


def test_truncated_frame_and_silent_clients_do_not_block_the_server(echo):
    """A client that sends half a frame, or nothing, only holds its own connection until the I/O timeout."""
    stalled = [_raw(echo) for _ in range(2)]
    stalled[0].sendall(struct.pack(">I", 100) + b"half")
    with ChannelClient(echo.address) as c:
        assert c.request(b"still") == b"echo:still"
    for s in stalled:
        s.close()


def test_handler_exception_becomes_an_error_reply(echo):
    """A handler bug answers an error and the connection keeps working."""
    with ChannelClient(echo.address) as c:
        assert c.request(b"boom").startswith(b"error:internal error: RuntimeError")
        assert c.request(b"after") == b"echo:after"


def test_connections_beyond_the_limit_are_closed(echo):
    """Over max_connections, new connections are closed at once instead of queueing threads."""
    held = [ChannelClient(echo.address) for _ in range(4)]
    for c in held:
        c.request(b"hold")
    extra = ChannelClient(echo.address, timeout=2)
    with pytest.raises(ChannelError):
        extra.request(b"no room")
    for c in held:
        c.close()


def test_random_garbage_never_kills_the_server(echo):
    """Bursts of random bytes from many clients leave the server answering."""
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
    with ChannelClient(echo.address) as c:
        assert c.request(b"alive") == b"echo:alive"


def test_unreachable_server_raises_channel_error():
    """A closed port is a ChannelError naming the address."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(ChannelError, match=f"127.0.0.1:{port}"):
        ChannelClient(("127.0.0.1", port), timeout=1).request(b"x")


def test_frames_and_addresses():
    """Frames round-trip over a socket pair; addresses parse from text."""
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
