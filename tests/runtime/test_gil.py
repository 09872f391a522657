"""kvlc's per-request calls into C and its HMACs keep the GIL.

A call that releases the GIL hands it to any other Python thread that is busy (an engine's own loop, kvlc's
progress thread), and the caller waits until that thread gives it back: up to the switch interval (5 ms by
default). The harness makes that visible without timing the calls: a thread spins counting while the switch
interval is 50 ms; a few hundred calls run after this thread took the GIL back from it, and the counter must
not move during a call that began within 40 ms of that (before Python could have forced the GIL away): it can
only move there where the call released the GIL. The harness itself is checked on calls that do release it
(``ctypes.CDLL``, ``hmac.digest``).
"""

from __future__ import annotations

import ctypes
import hmac
import os
import sys
import threading
import time

import numpy as np
import pytest

from kvlc import compile_spec
from kvlc.compiler.pairing.pair import pair
from kvlc.compiler.request import native as rows_native
from kvlc.compiler.request.bind import bind
from kvlc.compiler.request.check import check_request
from kvlc.compiler.request.instantiate import emit
from kvlc.runtime.channel.auth import notif_tag, tag_ok
from kvlc.runtime.ipc import bell as _bell, native as table_native
from kvlc.runtime.ipc.copy import CHUNK
from kvlc.runtime.ipc.memory import Mapped, Window
from kvlc.runtime.ipc.route import _Windows

from runtime_engines import TEST_LAYOUTS

CALLS = 300
SWITCH_S = 0.05       # the switch interval while a test runs
FORCED_AFTER = 0.04   # runs of the busy thread later than this after getting the GIL back may be forced ones


class _Busy:
    """A thread that counts as fast as it can, holding the GIL until forced off it (the switch interval)."""

    def __enter__(self) -> "_Busy":
        self.count, self._stop = 0, False
        self._old = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_S)
        self._t = threading.Thread(target=self._spin, daemon=True)
        self._t.start()
        while not self.count:
            time.sleep(0.001)
        return self

    def _spin(self) -> None:
        while not self._stop:
            self.count += 1

    def handovers(self, fn, calls: int = CALLS) -> int:
        """Of ``calls`` calls of ``fn``, in how many the busy thread ran (0: ``fn`` kept the GIL every time).

        A run of the busy thread counts only in a call that began within FORCED_AFTER of this thread having
        the GIL back: in a later one Python itself may have made this thread give it up (the switch interval;
        a slow, loaded machine), and the window starts again."""
        time.sleep(0)  # gives the GIL away: this thread goes on only after the busy one is forced off it
        seen, last, since = 0, self.count, time.monotonic()
        for _ in range(calls):
            began = time.monotonic()
            fn()
            now = self.count
            if now != last:
                seen += began - since < FORCED_AFTER
                since = time.monotonic()  # (either way this thread has just got the GIL back)
            last = now
        return seen

    def __exit__(self, *exc) -> None:
        self._stop = True
        self._t.join()
        sys.setswitchinterval(self._old)


def test_the_harness_sees_calls_that_release_the_gil():
    """Calls that release the GIL long enough for the busy thread to wake are seen (each time where the
    machine is not loaded); the same sleep through ``ctypes.PyDLL`` keeps it."""
    released, held = ctypes.CDLL(None).usleep, ctypes.PyDLL(None).usleep
    with _Busy() as busy:
        assert busy.handovers(lambda: released(200), 20) > 0
        assert busy.handovers(lambda: hmac.digest(b"k" * 32, bytes(4 << 20), "sha256"), 5) > 0
        assert busy.handovers(lambda: held(200), 20) == 0


def test_notification_tags_keep_the_gil():
    key = os.urandom(32)
    tag = notif_tag(key, "req-1", "0", "done")
    with _Busy() as busy:
        assert busy.handovers(lambda: notif_tag(key, "req-1", "0", "done")) == 0
        assert busy.handovers(lambda: tag_ok(key, tag, "req-1", "0", "done")) == 0


@pytest.mark.skipif(rows_native.library() is None, reason=f"rows.c: {rows_native.status()}")
def test_request_checks_and_rows_keep_the_gil():
    plan = compile_spec(TEST_LAYOUTS / "dense-tp1.yaml")
    prog = pair(plan, plan, local_rank=0, direction="READ")
    bound = bind(prog, {s.name: 1 << 40 for s in plan.storages}, {0: {s.name: 2 << 40 for s in plan.storages}})
    ids = {"full": list(range(0, 39, 3))}  # 13 blocks of 16 tokens
    req = check_request(prog, ids, ids, 200)
    kids = np.arange(64, dtype=np.int64)  # (numpy's arange itself releases the GIL: made outside)
    with _Busy() as busy:
        assert busy.handovers(lambda: check_request(prog, ids, ids, 200)) == 0
        assert busy.handovers(lambda: emit(bound, req)) == 0
        assert busy.handovers(lambda: rows_native.ids_ok(kids, 128, True)) == 0


@pytest.mark.skipif(table_native.library() is None, reason=f"table.c: {table_native.status()}")
def test_the_same_host_launch_table_keeps_the_gil():
    w = _Windows(Mapped("peer", [Window("kv", "VRAM", 1 << 40, 1 << 30, 7 << 40, 0)]))
    local = np.stack([np.arange(512, dtype=np.uint64) * 8192, np.full(512, 4096, np.uint64),
                      np.zeros(512, np.uint64)], axis=1)
    remote = local.copy()
    remote[:, 0] += np.uint64(1 << 40)
    with _Busy() as busy:
        assert busy.handovers(lambda: w.table(local, remote, "VRAM", True, "WRITE", CHUNK)) == 0


@pytest.mark.skipif(_bell.library() is None, reason=f"bell.c: {_bell.status()}")
def test_the_doorbell_keeps_the_gil():
    b = _bell.Bell("gil-peer")
    w = _bell.BellWriter(os.getpid(), b.offer())
    try:
        with _Busy() as busy:
            assert busy.handovers(lambda: (w.ring(b"x" * 90), b.take())) == 0
    finally:
        w.close()
        b.close()


def test_same_host_dram_rows_keep_the_gil():
    """HostCopy (a peer's DRAM on this host): the check of both sides against the regions (in C) and one
    memmove per row under 1 MiB keep the GIL, on a thousand rows (where numpy's check released it at
    every step); the rows moved."""
    from kvlc.runtime.ipc.copy import HostCopy
    from kvlc.runtime.staging.copy import Region, Regions

    rows, half = 1024, 1 << 22
    buf = np.zeros(2 * half, dtype=np.uint8)
    base = buf.ctypes.data
    copier = HostCopy(Regions([Region(base, half, buf[:half]), Region(base + half, half, buf[half:])]))
    src = np.arange(rows, dtype=np.uint64) * np.uint64(4096) + np.uint64(base)
    dst = src + np.uint64(half)
    lens = np.full(rows, 2048, dtype=np.uint64)
    buf[:half] = np.arange(half) % 251
    with _Busy() as busy:
        assert busy.handovers(lambda: copier.start(src, dst, lens), 20) == 0
    for s in range(0, rows * 4096, 4096):  # and the rows moved: 2 KiB of each row's 4 KiB
        assert np.array_equal(buf[half + s:half + s + 2048], buf[s:s + 2048])


def test_a_look_at_a_side_channel_keeps_the_gil():
    """Before each request a Peer looks whether its side channels are still open (``ChannelClient.lost``): a
    peek that never waits, in C with the GIL held; open, open with a byte waiting, and closed are told apart."""
    import socket

    from kvlc.runtime.channel.client import _peer_closed

    a, b = socket.socketpair()
    try:
        a.settimeout(5.0)  # a client socket has a timeout: its descriptor is non-blocking
        with _Busy() as busy:
            assert busy.handovers(lambda: _peer_closed(a)) == 0
        assert not _peer_closed(a)
        b.send(b"x")
        assert not _peer_closed(a) and a.recv(1) == b"x"  # (a peek: the byte is still there)
        b.close()
        assert _peer_closed(a)
    finally:
        a.close()
