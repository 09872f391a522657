"""The same-host doorbell: a peer on this host rings its notifications into shared memory, not through NIXL.

After a same-host copy, the initiator's ``done`` went out through NIXL's notifications: 53-80 µs of
``send_notif`` on an H100 host (runs 11-12 and 19 in benchmarks/README.md), about a tenth of a 4k-token
handover. An agent that offers its storages to a same-host peer (:mod:`kvlc.runtime.ipc.memory`) now
also offers a :class:`Bell`, a ring in a shared-memory file of its own made for that one session; the
peer maps it (:class:`BellWriter`) and writes its notifications there, the same bytes NIXL would carry
(signed with the session's key, so the receiver checks them exactly as it checks NIXL's); the receiver
takes them at its next poll. A notification the ring has no room for goes through NIXL as before, and
so does everything where ``bell.c`` is not built (:func:`status`).

The ring (``bell.c``): one writer process, one reader process, positions published with release
stores; each side refuses what the other's half of the file makes impossible, so a corrupt or hostile
file costs notifications (dropped, counted), never memory outside it.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from pathlib import Path

import numpy as np

from kvlc import clib
from kvlc.runtime.channel.wire import SharedBell
from kvlc.runtime.ipc.cuda import IpcError
from kvlc.runtime.shm import map_peer_file

log = logging.getLogger(__name__)

ABI_VERSION = 1
SIZE = 1 << 18  # bytes of a ring: ~1,000 done notifications waiting, or a batch notification of 128 KiB
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p

_LIB = clib.Library(Path(__file__).resolve().parent, "_bell", "kvlc/runtime/ipc/bell.c", "kvlc_bell_abi_version",
                   ABI_VERSION, "same-host notifications go through NIXL",
                   {"kvlc_bell_most": ((_I64,), _I64),
                    "kvlc_bell_put": ((_PTR, _I64, ctypes.c_char_p, _I64), _I64),
                    "kvlc_bell_take": ((_PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR), _I64)})
library = _LIB.library  # the loaded C library, or None (no doorbells: NIXL carries every notification)
status = _LIB.status    # one line: whether doorbells ring, and why not


def _address(m: mmap.mmap) -> int:
    c = ctypes.c_char.from_buffer(m)
    try:
        return ctypes.addressof(c)
    finally:
        del c  # the mapping can be closed again once no object exports it


class Bell:
    """The receiving end: a ring in a new shared-memory file of this process (``os.memfd_create``), that
    the one peer it is offered to (:meth:`offer`) writes into; :meth:`take` reads what it wrote."""

    MAX_TAKE = 4096  # records one call of bell.c takes at most
    ROUNDS = 8       # calls one take() makes at most: a full ring of the shortest records

    def __init__(self, peer: str, size: int = SIZE, conn: str = ""):
        lib = library()
        if lib is None:
            raise IpcError(f"no doorbell: {status()}")
        if lib.kvlc_bell_most(size) < 0:
            raise ValueError(f"a doorbell of {size} bytes: give a multiple of 8 above 192")
        self.peer, self.size, self.conn, self._lib = peer, size, conn, lib  # conn: its session's connection
        self.fd = os.memfd_create(f"kvlc-bell-{peer[:40]}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self._map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self._base = _address(self._map)
        head = np.frombuffer(self._map, dtype=np.uint64, count=9)
        self._w, self._r = head[0:1], head[8:9]  # the positions, read here without a call when nothing is new
        self._out = np.empty(size, dtype=np.uint8)
        self._lens = np.empty(self.MAX_TAKE, dtype=np.int64)
        self._bad = np.zeros(1, dtype=np.int64)
        self.dropped = 0  # times a corrupt ring lost what was written (see bell.c)
        self.closed = False

    def offer(self) -> SharedBell:
        """What the peer needs to map this ring (its process opens the file at /proc/<pid>/fd/<fd>)."""
        return SharedBell(fd=self.fd, size=self.size)

    def pending(self) -> int:
        """Bytes of the ring written and not taken yet (records with their headers and padding)."""
        return 0 if self.closed else int(self._w[0]) - int(self._r[0])

    def take(self) -> list[bytes]:
        """The notifications written since the last call, oldest first (a corrupt ring: what was still
        good, the rest dropped and counted in :attr:`dropped`)."""
        if self.closed or self._w[0] == self._r[0]:
            return []
        got: list[bytes] = []
        for _ in range(self.ROUNDS):  # bounded: a peer that keeps ringing cannot hold this poll
            n = self._lib.kvlc_bell_take(self._base, self.size, self._out.ctypes.data, self.size,
                                         self._lens.ctypes.data, self.MAX_TAKE, self._bad.ctypes.data)
            at = 0
            raw = self._out.data
            for k in self._lens[:n].tolist():
                got.append(bytes(raw[at:at + k]))
                at += k
            if self._bad[0]:
                self.dropped += 1
                (log.warning if self.dropped == 1 else log.debug)(
                    "the doorbell of %s held an impossible record or position (%d times): what followed was "
                    "dropped", self.peer[:64], self.dropped)
                return got
            if n < self.MAX_TAKE or self._w[0] == self._r[0]:
                return got
        return got  # the rest at the next poll

    def close(self) -> None:
        """Unmap and close the file here (idempotent); a peer's mapping stays valid until it unmaps."""
        if self.closed:
            return
        self.closed = True
        self._w = self._r = None
        try:
            self._map.close()
        finally:
            os.close(self.fd)


class BellWriter:
    """The ringing end: a peer's :class:`Bell` (``offer``, from process ``pid``) mapped here."""

    def __init__(self, pid: int, offer: SharedBell):
        lib = library()
        if lib is None:
            raise IpcError(f"the peer offered a doorbell, but it cannot be rung here: {status()}")
        if lib.kvlc_bell_most(offer.size) < 0:
            raise IpcError(f"the peer offered a doorbell of {offer.size} bytes, which is no ring's size")
        try:
            self._map, _ = map_peer_file(pid, offer.fd, 0, offer.size, "the doorbell")
        except OSError as exc:
            raise IpcError(str(exc)) from exc
        self._lib, self.size, self._base = lib, offer.size, _address(self._map)
        self.rung = 0  # notifications written
        self.closed = False

    def ring(self, message: bytes) -> bool:
        """Write one notification; False where the ring has no room now or never will (send it another way)."""
        if self.closed:
            return False
        ok = self._lib.kvlc_bell_put(self._base, self.size, message, len(message)) == 1
        self.rung += ok
        return ok

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._map.close()
