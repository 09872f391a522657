"""Loading kvlc's C libraries, built by ``pip install`` as optional extensions and loaded with ctypes so that
one build loads under any CPython of its platform: plain C (no Python API) or, where a library reads Python
objects, Python's limited C API.

Every library is loaded with ``ctypes.PyDLL``: the GIL stays held during a call. kvlc's C calls are short
(microseconds to a few milliseconds for the largest requests), and releasing the GIL around one hands it to
any other Python thread that is busy (an engine's own loop, kvlc's progress thread) until that thread gives it
back: up to the switch interval, 5 ms. Measured on this project's 2-core VM with one busy Python thread: 25 of
400 calls of ``getpid`` through ``ctypes.CDLL`` took over 1 ms (5.2 ms at p99); through ``PyDLL`` none (1 µs
at p99).

Each library has a Python reference that runs where it is not loaded; ``KVLC_NATIVE=0`` turns every one
off. :class:`Library` loads one on first use and says, in one line, which path runs and why.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path


class Library:
    """The library ``<stem>*.so`` (or .dylib / .pyd) in ``folder``, built from ``source``, whose ``abi_symbol()``
    returns ``abi``; ``signatures``: function name -> (argument types, result type). ``fallback`` says what runs
    where it is not loaded (the end of every reason :meth:`status` gives)."""

    def __init__(self, folder: Path, stem: str, source: str, abi_symbol: str, abi: int, fallback: str,
                 signatures: dict[str, tuple[tuple, type]]):
        self._args = (folder, stem, source, abi_symbol, abi, fallback, signatures)
        self._loaded: tuple[ctypes.CDLL | None, str] | None = None
        self._lock = threading.Lock()

    def library(self) -> ctypes.CDLL | None:
        """The loaded C library, or None (the reference runs; :meth:`status` says why)."""
        return self._load()[0]

    def status(self) -> str:
        """One line: which path runs, and why."""
        return self._load()[1]

    def _load(self) -> tuple[ctypes.CDLL | None, str]:
        if self._loaded is None:
            with self._lock:
                if self._loaded is None:
                    self._loaded = _open(*self._args)
        return self._loaded


def _open(folder: Path, stem: str, source: str, abi_symbol: str, abi: int, fallback: str,
          signatures: dict[str, tuple[tuple, type]]) -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get("KVLC_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None, f"off (KVLC_NATIVE=0): {fallback}"
    found = [p for ext in ("so", "dylib", "pyd") for p in sorted(folder.glob(f"{stem}*.{ext}"))]
    if not found:
        return None, (f"not built (no {stem} library next to {source}; reinstall with a C compiler: "
                      f"pip install -e .): {fallback}")
    try:
        lib = ctypes.PyDLL(str(found[0]))  # the GIL held during calls (see the module docstring)
    except OSError as exc:
        return None, f"{found[0].name} does not load ({exc}): {fallback}"
    got = getattr(lib, abi_symbol)()
    if got != abi:
        return None, f"{found[0].name} is ABI {got}, this kvlc wants {abi} (a stale build: pip install -e . again): {fallback}"
    for name, (args, result) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    return lib, f"native ({found[0].name})"


def address(a) -> int:
    """The address of a C-contiguous numpy array's first element, for a C call. Through the buffer protocol (0.3 µs
    on this project's VM) where the array is writable and not empty; else numpy's ``ctypes.data``, which builds an
    object on every call (1.2-2.1 µs; a request asks for three to five addresses)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError, BufferError):
        return a.ctypes.data


# The process's C library through ctypes.PyDLL (the GIL held during a call: see the module docstring), for the
# few calls kvlc makes of it on its hot paths: a non-blocking socket's write and peek, a row's memmove.
libc = ctypes.PyDLL(None, use_errno=True)
libc.write.argtypes, libc.write.restype = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t), ctypes.c_ssize_t
libc.recv.argtypes, libc.recv.restype = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_ssize_t
libc.memmove.argtypes, libc.memmove.restype = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t), ctypes.c_void_p
