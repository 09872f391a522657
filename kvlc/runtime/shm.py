"""DRAM a same-host peer can map: tensors in shared-memory files (memfd) of this process.

:func:`shared_dram` allocates; :func:`file_of` says which file (descriptor, offset) holds a
range, so :mod:`kvlc.runtime.ipc.memory` can offer it. A file's descriptor is closed when its
tensor is collected; mappings made of it (here or in a peer) stay valid until they go.
:func:`map_peer_file` is the other end: a peer process's file mapped here.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from dataclasses import dataclass


@dataclass
class _File:
    fd: int
    size: int
    map: mmap.mmap


_files: dict[int, _File] = {}  # base address → the shared file mapped there
_lock = threading.Lock()


def shared_dram(nbytes: int, name: str = "kvlc"):
    """A zeroed uint8 CPU tensor of ``nbytes`` in a shared-memory file of this process."""
    import torch

    fd = os.memfd_create(name[:200], os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, max(1, nbytes))
        m = mmap.mmap(fd, max(1, nbytes))
    except BaseException:
        os.close(fd)
        raise
    t = torch.frombuffer(m, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
    base = t.data_ptr()
    with _lock:
        _files[base] = _File(fd, nbytes, m)
    weakref.finalize(t.untyped_storage(), _forget, base)
    return t


def _forget(base: int) -> None:
    with _lock:
        f = _files.pop(base, None)
    if f is not None:
        os.close(f.fd)


def file_of(addr: int, size: int) -> tuple[int, int] | None:
    """(descriptor, offset) of the shared file of this process holding ``[addr, addr + size)``, or None."""
    with _lock:
        for base, f in _files.items():
            if base <= addr and addr + size <= base + f.size:
                return f.fd, addr - base
    return None


def map_peer_file(pid: int, fd: int, offset: int, size: int, what: str) -> tuple[mmap.mmap, int]:
    """Map ``[offset, offset + size)`` of the file open as descriptor ``fd`` in process ``pid`` (opened at
    /proc/<pid>/fd/<fd>: a process of this host, PID namespace and user): the mapping, from the page that
    holds ``offset``, and where ``offset`` lies in it. OSError naming ``what`` where it cannot be opened,
    holds fewer bytes than that, or cannot be mapped."""
    page = mmap.ALLOCATIONGRANULARITY
    start = offset - offset % page
    try:
        f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
    except OSError as exc:
        raise OSError(f"cannot open {what} of process {pid}: {exc}") from exc
    try:
        if os.fstat(f).st_size < offset + size:
            raise OSError(f"{what} of process {pid}: its file holds fewer than the {offset + size} bytes offered")
        return mmap.mmap(f, offset - start + size, offset=start), offset - start
    except ValueError as exc:
        raise OSError(f"cannot map {what} of process {pid}: {exc}") from exc
    finally:
        os.close(f)
