"""Same-host copies: a peer's storages mapped here, a request's rows copied in one pass.

:mod:`~kvlc.runtime.ipc.memory` offers and maps storages (CUDA IPC handles for VRAM, shared
files for DRAM), :mod:`~kvlc.runtime.ipc.copy` runs rows as ONE Triton kernel on a GPU (a
``memmove`` per row on the CPU), :mod:`~kvlc.runtime.ipc.route` puts both behind the executor's NIXL door.
"""
