"""Sharing storages with a peer on the same host: what one side offers, what the other maps.

VRAM storages are offered as CUDA IPC handles of the allocations that hold them (any CUDA
tensor from ``cudaMalloc``; memory from the virtual-memory API, torch's expandable segments
say, cannot be shared this way and is simply not offered). DRAM storages are offered when
their memory is a shared-memory file of this process (:func:`kvlc.runtime.shm.shared_dram`, what
:func:`kvlc.runtime.binding.allocate` gives with ``shared=True``); the peer opens that file
through ``/proc/<pid>/fd``, so only a process of the same host, PID namespace and user can.
Private memory (an engine's own ``torch.zeros`` on the CPU) is not offered: NIXL moves it.

An offer (:class:`~kvlc.runtime.channel.wire.Shared`) travels only over an authenticated
connection, after the hello; a peer maps it (:func:`open_offer`) only when the host keys match,
and unmaps it when the session ends (:meth:`Mapped.close`). An offer made for one session also
carries a doorbell of its own (:mod:`kvlc.runtime.ipc.bell`, :func:`with_bell`), which the peer
maps with the storages: its notifications to this side are written there.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvlc.runtime.channel.wire import Shared, SharedStorage
from kvlc.runtime.ipc import cuda
from kvlc.runtime.ipc.bell import Bell, BellWriter
from kvlc.runtime.ipc.cuda import IpcError
from kvlc.runtime.shm import file_of, map_peer_file

log = logging.getLogger(__name__)


def host_key() -> str:
    """This host as a peer must share it to map our memory: its boot and its PID namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}:{ns}"


# ---------------------------------------------------------------- offering
def offer(bindings: Iterable) -> Shared | None:
    """What this agent can share of its storages (``Bound`` objects); None when nothing can be."""
    host = host_key()
    if not host:
        return None
    out = []
    for b in bindings:
        s = _one(b)
        if s is not None:
            out.append(s)
    return Shared(host=host, pid=os.getpid(), storages=tuple(out)) if out else None


def with_bell(shared: Shared | None, bell: Bell) -> Shared | None:
    """``shared`` (what :func:`offer` gave: None where nothing can be mapped) with ``bell`` for the one peer
    it goes to; None where this host has no key (a peer cannot tell it is on this host)."""
    if shared is None:
        host = host_key()
        return Shared(host=host, pid=os.getpid(), storages=(), bell=bell.offer()) if host else None
    return shared.model_copy(update={"bell": bell.offer()})


def _one(b) -> SharedStorage | None:
    if b.mem == "DRAM":
        got = file_of(b.addr, b.storage.size)
        if got is None:
            return None
        return SharedStorage(name=b.name, addr=b.addr, size=b.storage.size, mem="DRAM", device=b.device,
                             fd=got[0], offset=got[1])
    try:
        handle, off = cuda.export(b.addr, b.device)
        gpu = cuda.uuid(b.device)
    except IpcError as exc:
        log.info("storage '%s' is not shared with same-host peers: %s", b.name, exc)
        return None
    return SharedStorage(name=b.name, addr=b.addr, size=b.storage.size, mem="VRAM", device=b.device,
                         handle=handle, offset=off, gpu=gpu)


# ---------------------------------------------------------------- mapping
@dataclass
class Window:
    """One peer storage mapped here: the peer's ``[addr, addr + size)`` is our ``[base, base + size)``."""

    name: str
    mem: str
    addr: int
    size: int
    base: int
    device: int  # the GPU it is mapped on here (VRAM), or 0
    tensor: object = None  # DRAM: a uint8 tensor over the mapping (the CPU copy path reads it)
    _close: object = None

    @property
    def shift(self) -> int:
        return self.base - self.addr


@dataclass
class Mapped:
    """A peer's shared storages, as mapped into this process (one per peer NIXL agent)."""

    peer: str
    windows: list[Window] = field(default_factory=list)
    bell: BellWriter | None = None  # the peer's doorbell for this session, if it offered one
    closed: bool = False

    def close(self) -> None:
        """Unmap every window and the doorbell (idempotent); a window that fails to unmap is logged."""
        if self.closed:
            return
        self.closed = True
        if self.bell is not None:
            self.bell.close()
        for w in self.windows:
            w.tensor = None  # DRAM: the mapping goes with the last reference to it
            try:
                if w._close is not None:
                    w._close()
            except (IpcError, OSError, ValueError) as exc:
                log.warning("unmap %s of %s: %s", w.name, self.peer, exc)


def open_offer(peer: str, shared: Shared, devices: dict[str, int]) -> Mapped:
    """Map the storages of ``shared`` that this side can use; IpcError when the peer is on another
    host. ``devices``: mem → the GPU this side copies VRAM on (the one its own VRAM storages are on)."""
    if shared.host != host_key():
        raise IpcError(f"agent '{peer}' is on another host (or PID namespace); its memory cannot be mapped here")
    m = Mapped(peer)
    try:
        for s in shared.storages:
            m.windows.append(_map(s, shared.pid, devices))
        if shared.bell is not None:
            m.bell = BellWriter(shared.pid, shared.bell)
    except BaseException:
        m.close()
        raise
    return m


def _map(s: SharedStorage, pid: int, devices: dict[str, int]) -> Window:
    if s.mem == "VRAM":
        if "VRAM" not in devices:
            raise IpcError(f"storage '{s.name}' is VRAM but this side has no GPU storage to copy with")
        dev = devices["VRAM"]
        base = cuda.open_handle(s.handle, dev)
        return Window(s.name, "VRAM", s.addr, s.size, base + s.offset, dev,
                      _close=lambda b=base, d=dev: cuda.close_handle(b, d))
    return _map_dram(s, pid)


def _map_dram(s: SharedStorage, pid: int) -> Window:
    import torch

    try:
        m, at = map_peer_file(pid, s.fd, s.offset, s.size, f"storage '{s.name}'")
    except OSError as exc:
        raise IpcError(str(exc)) from exc
    t = torch.frombuffer(m, dtype=torch.uint8, count=s.size, offset=at)
    return Window(s.name, "DRAM", s.addr, s.size, t.data_ptr(), 0, tensor=t)
