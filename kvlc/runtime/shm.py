"""DRAM a same-host peer can map: tensors in shared-memory files (memfd) of this process.

:func:`shared_dram` allocates; :func:`file_of` says which file (descriptor, offset) holds a
range, so :mod:`kvlc.runtime.ipc.memory` can offer it. A file's descriptor is closed when its
tensor is collected; mappings made of it (here or in a peer) stay valid until they go.
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
