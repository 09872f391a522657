"""The few CUDA driver calls that map a peer's VRAM: IPC handles of allocations, opened and closed.

Reached through ctypes on ``libcuda.so.1`` (the driver every CUDA host has), so nothing is
compiled. Every call runs with the device's primary context current (the one torch uses), pushed
for the call and popped after it, whichever thread calls. Errors raise :class:`IpcError` with the
driver's name of the error.
"""

from __future__ import annotations

import ctypes
import threading
from contextlib import contextmanager

from kvlc.errors import TransferError

HANDLE_BYTES = 64
_LAZY_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: map memory of another GPU through peer access


class IpcError(TransferError):
    """A peer's memory cannot be shared or mapped here (no driver, another host, a refused handle)."""


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


_lib = None
_lock = threading.Lock()


def _driver():
    global _lib
    with _lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as exc:
                raise IpcError(f"no CUDA driver here (libcuda.so.1: {exc})") from exc
            lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _Handle, ctypes.c_uint]
            lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
            _lib = lib
        return _lib


def _check(code: int, what: str) -> None:
    if code:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(code, ctypes.byref(name))
        raise IpcError(f"{what}: {(name.value or b'CUDA error').decode()} ({code})")


@contextmanager
def _on(device: int):
    """The device's primary context, current for the block."""
    lib = _driver()
    ctx = ctypes.c_void_p()
    _check(lib.cuInit(0), "cuInit")
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), ctypes.c_int(device)), f"retain the context of GPU {device}")
    try:
        _check(lib.cuCtxPushCurrent_v2(ctx), f"make the context of GPU {device} current")
        try:
            yield lib
        finally:
            lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    finally:
        lib.cuDevicePrimaryCtxRelease_v2(ctypes.c_int(device))


def export(addr: int, device: int) -> tuple[bytes, int]:
    """(IPC handle of the allocation holding ``addr``, ``addr``'s offset in it)."""
    with _on(device) as lib:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        _check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(addr)),
               f"find the allocation of {addr:#x} on GPU {device}")
        h = _Handle()
        _check(lib.cuIpcGetMemHandle(ctypes.byref(h), base), f"export the allocation at {base.value:#x}")
        return bytes(h), addr - base.value  # all 64 bytes (the array field's value would stop at a NUL)


def open_handle(handle: bytes, device: int) -> int:
    """Map a peer's allocation into GPU ``device``'s context; returns its base address here."""
    if len(handle) != HANDLE_BYTES:
        raise IpcError(f"a CUDA IPC handle has {HANDLE_BYTES} bytes, got {len(handle)}")
    with _on(device) as lib:
        h = _Handle.from_buffer_copy(handle)
        ptr = ctypes.c_uint64()
        _check(lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, _LAZY_PEER_ACCESS),
               f"open a peer's memory handle on GPU {device}")
        return ptr.value


def close_handle(base: int, device: int) -> None:
    """Unmap what :func:`open_handle` mapped."""
    with _on(device) as lib:
        _check(lib.cuIpcCloseMemHandle(ctypes.c_uint64(base)), f"close a peer's memory at {base:#x}")


def uuid(device: int) -> str:
    """GPU ``device``'s UUID (as ``nvidia-smi -L`` prints it, without the ``GPU-`` prefix)."""
    import torch

    return str(torch.cuda.get_device_properties(device).uuid)


_DEVICE_POINTER = 3  # CU_POINTER_ATTRIBUTE_DEVICE_POINTER


def host_mapped(addr: int, size: int, device: int) -> bool:
    """Whether host memory ``[addr, addr + size)`` is page-locked and mapped for GPU ``device`` at the
    same address (pinned memory under unified addressing: a kernel there reads and writes it in
    place). Memory that is not (pageable, or no driver here) is False, never an error."""
    try:
        with _on(device) as lib:
            for a in (addr, addr + max(size, 1) - 1):
                ptr = ctypes.c_uint64()
                if lib.cuPointerGetAttribute(ctypes.byref(ptr), _DEVICE_POINTER, ctypes.c_uint64(a)) or ptr.value != a:
                    return False
    except IpcError:
        return False
    return True
