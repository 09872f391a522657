"""The same-host doorbell (kvlc.runtime.ipc.bell, bell.c): a ring in a shared-memory file, one writer and one reader.

Every message the writer got in is taken once, whole and in order; a full ring refuses (the caller sends
through NIXL) and takes the next message once the reader caught up; a writer in another process rings
while the reader takes; a file holding impossible positions or records costs messages, never memory
outside it or a crash.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvlc.runtime.channel.wire import SharedBell
from kvlc.runtime.ipc import bell as _bell
from kvlc.runtime.ipc.bell import Bell, BellWriter
from kvlc.runtime.ipc.cuda import IpcError

pytestmark = pytest.mark.skipif(_bell.library() is None, reason=f"bell.c: {_bell.status()}")

SMALL = 128 + 512  # a ring of 512 data bytes: wraps and fills within a few messages


def _pair(size: int = SMALL) -> tuple[Bell, BellWriter]:
    b = Bell("test-peer", size)
    return b, BellWriter(os.getpid(), b.offer())


def _message(i: int, n: int) -> bytes:
    return (i.to_bytes(4, "little") * (n // 4 + 1))[:n]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 248), st.just(-1)), min_size=1, max_size=120))
def test_every_message_taken_once_in_order(ops):
    """Random puts (message sizes 0..248 bytes, the most a 512-byte ring holds) and takes (-1): what was
    taken is exactly what was accepted, in order; a refused message fits once the ring is drained."""
    b, w = _pair()
    most = _bell.library().kvlc_bell_most(SMALL)
    assert most == 248
    sent, got = [], []
    try:
        for i, op in enumerate(ops):
            if op < 0:
                got += b.take()
                continue
            m = _message(i, op)
            if w.ring(m):
                sent.append(m)
            else:  # full: once everything written is taken, the same message goes in
                got += b.take()
                assert got == sent
                assert w.ring(m), "a message refused by a drained ring"
                sent.append(m)
        got += b.take()
        assert got == sent and b.dropped == 0 and w.rung == len(sent)
        assert b.take() == []
    finally:
        w.close()
        b.close()


def test_a_full_ring_of_the_shortest_records_is_taken_in_one_poll():
    """32,752 empty notifications (8 bytes each: a full 256 KiB ring) come back from one take(), in order
    of writing; one more goes in once they are taken."""
    b = Bell("many")
    w = BellWriter(os.getpid(), b.offer())
    try:
        n = 0
        while w.ring(b""):
            n += 1
        assert n == (_bell.SIZE - 128) // 8
        assert b.take() == [b""] * n and b.pending() == 0
        assert w.ring(b"next") and b.take() == [b"next"]
    finally:
        w.close()
        b.close()


def test_sizes_the_ring_never_takes_are_refused():
    b, w = _pair()
    try:
        assert not w.ring(bytes(249))  # over kvlc_bell_most: the caller sends it through NIXL
        assert w.ring(bytes(248)) and b.take() == [bytes(248)]
        with pytest.raises(ValueError):
            Bell("odd", 128 + 4)
        with pytest.raises(IpcError, match="no ring's size"):
            BellWriter(os.getpid(), SharedBell(fd=b.fd, size=260))
        with pytest.raises(IpcError, match="holds fewer"):
            BellWriter(os.getpid(), SharedBell(fd=b.fd, size=SMALL + 8))
    finally:
        w.close()
        b.close()


_WRITER = """
import os, sys, time
from kvlc.runtime.channel.wire import SharedBell
from kvlc.runtime.ipc.bell import BellWriter
pid, fd, size, n = map(int, sys.argv[1:5])
w = BellWriter(pid, SharedBell(fd=fd, size=size))
waits = 0
for i in range(n):
    m = (i.to_bytes(4, "little") * (1 + i % 40))[: 3 + i % 150]
    while not w.ring(m):
        waits += 1
        time.sleep(0)
print(waits)
"""


def test_a_writer_in_another_process_rings_while_this_one_takes():
    """20,000 messages from a spawned process through a 4 KiB ring (it fills: the writer waits), taken here
    as they come: all of them, whole and in order."""
    n, size = 20_000, 128 + 4096
    b = Bell("other-process", size)
    try:
        p = subprocess.Popen([sys.executable, "-c", _WRITER, str(os.getpid()), str(b.fd), str(size), str(n)],
                             stdout=subprocess.PIPE, text=True, pass_fds=())
        got: list[bytes] = []
        while b.pending() < 4096 - 200 and p.poll() is None:  # let the writer fill the ring first
            time.sleep(0.001)
        while len(got) < n and p.poll() is None:
            got += b.take()
        out, _ = p.communicate(timeout=60)
        got += b.take()
        assert p.returncode == 0
        want = [(i.to_bytes(4, "little") * (1 + i % 40))[: 3 + i % 150] for i in range(n)]
        assert len(got) == n and got == want
        assert b.dropped == 0
        assert int(out) > 0  # the ring did fill: the refusal path ran under a live reader
    finally:
        b.close()


def _raw(b: Bell) -> tuple[mmap.mmap, np.ndarray]:
    """The ring's file as a stranger maps it: bytes, and uint64 words (0: write position, 8: read position)."""
    fd = os.open(f"/proc/self/fd/{b.fd}", os.O_RDWR)
    try:
        m = mmap.mmap(fd, b.size)
    finally:
        os.close(fd)
    return m, np.frombuffer(m, dtype=np.uint64)


@pytest.mark.parametrize("where", ["write position ahead", "write position unaligned", "record length",
                                   "wrap marker", "read position"])
def test_an_impossible_file_costs_messages_not_memory(where):
    """A stranger (or a bug) writes into the file: the reader keeps what was good before, drops the rest
    (counted) and takes messages again at once; a writer that cannot trust a position writes nothing."""
    b, w = _pair()
    m, words = _raw(b)
    try:
        assert w.ring(b"first") and b.take() == [b"first"]  # data bytes 0-16
        assert w.ring(b"good")  # data bytes 16-32: write position 32
        if where == "write position ahead":
            words[0] += 10 * SMALL
        elif where == "write position unaligned":
            words[0] += 3
        elif where == "record length":
            words[0] += 16  # a record the writer never wrote at data byte 32, of a length ...
            m[128 + 32:128 + 36] = (1 << 20).to_bytes(4, "little")  # ... far past the ring's end
        elif where == "wrap marker":
            words[0] += 16
            m[128 + 32:128 + 36] = (0xFFFFFFFF).to_bytes(4, "little")  # "skip to the end": more than was written
        else:
            words[8] = words[0] + 8  # the reader "took" bytes never written
        got = b.take()
        assert b.dropped == 1
        assert got == ([b"good"] if where in ("record length", "wrap marker") else [])  # kept: the good one before
        before = bytes(m)
        if where == "write position unaligned":  # the writer's own position is impossible: it refuses every message
            assert not w.ring(b"again") and bytes(m) == before
        else:  # the reader moved to the writer's position: the ring takes messages again
            assert w.ring(b"again") and b.take() == [b"again"]
        words[8] = words[0] + 4096  # a read position the writer cannot trust: it refuses, writes nothing
        before = bytes(m)
        assert not w.ring(b"refused") and bytes(m) == before
    finally:
        del words
        m.close()
        w.close()
        b.close()


def test_closed_ends_refuse_quietly():
    b, w = _pair()
    w.close()
    assert not w.ring(b"x")
    b.close()
    b.close()
    assert b.take() == []


class _Nixl:
    """What the route passes to NIXL: the notifications sent, per agent."""

    def __init__(self):
        self.sent: list[tuple[str, bytes]] = []

    def send_notif(self, agent: str, message: bytes) -> None:
        self.sent.append((agent, message))


def test_the_route_rings_the_peers_bell_and_sends_what_does_not_fit_through_nixl():
    """Same-host ``done``: written into the doorbell the peer offered (a peer that offered storages or only
    the bell alike); a message the full ring refuses goes through NIXL, none is lost or sent twice; a peer
    without a doorbell, or dropped, hears through NIXL."""
    from kvlc.runtime.ipc.memory import Mapped
    from kvlc.runtime.ipc.route import IpcRoute

    nixl = _Nixl()
    route = IpcRoute(nixl, {})
    b = Bell("route-peer", SMALL)
    route.add(Mapped("peer", [], bell=BellWriter(os.getpid(), b.offer())))
    route.add(Mapped("plain", []))
    msgs = [_message(i, 100) for i in range(6)]  # 112 bytes a record: four fit in 512
    for m in msgs:
        route.send_notif("peer", m)
    route.send_notif("plain", b"p")
    assert route.rung == 4 and b.take() == msgs[:4]
    assert nixl.sent == [("peer", msgs[4]), ("peer", msgs[5]), ("plain", b"p")]
    route.drop("peer")  # its sessions ended: unmapped, the next message goes through NIXL
    route.send_notif("peer", b"late")
    assert nixl.sent[-1] == ("peer", b"late") and b.take() == []
    route.close()
    b.close()
