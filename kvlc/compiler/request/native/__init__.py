"""The per-request hot path in C (``rows.c``, ``ids.c``), loaded through ctypes; the Python code it mirrors is the
reference.

``rows.c`` is a plain C library (no Python API); ``ids.c`` reads the engine's lists of block ids through
Python's limited C API (one build for every CPython from 3.11). Both are built by ``pip install`` (setup.py,
optional extensions: a machine without a C compiler installs and runs on the reference) and loaded with
ctypes, so one build loads on any CPython; a GPU host without a compiler can carry them.
:func:`library` is None when it is not built, or when ``KVLC_NATIVE=0`` (the reference then runs,
with the same results: ``tests/test_native.py`` proves them identical); :func:`status` says which.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from kvlc import clib

ABI_VERSION = 4
PIECE = 14  # int64s per piece record (rows.c)

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


_LIB = clib.Library(Path(__file__).resolve().parent, "_rows", "kvlc/compiler/request/native/rows.c",
                   "kvlc_abi_version", ABI_VERSION, "the Python reference runs",
                   {"kvlc_ids_ok": ((_PTR, _I64, _I64, ctypes.c_int), ctypes.c_int),
                    "kvlc_emit": ((_PTR, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64), _I64),
                    "kvlc_breaks": ((_PTR, _I64, _I64), _I64)})
library = _LIB.library  # the loaded C library, or None (the Python reference runs; status() says why)
status = _LIB.status    # one line: which per-request path runs, and why


_IDS = clib.Library(Path(__file__).resolve().parent, "_ids", "kvlc/compiler/request/native/ids.c",
                    "kvlc_ids_abi_version", 1, "the Python reference reads the ids",
                    {"kvlc_seq_ids": ((ctypes.py_object, ctypes.c_int, _I64, _PTR, _I64, _I64, _I64, ctypes.c_int),
                                      ctypes.c_int)})
ids_library = _IDS.library  # ids.c loaded, or None (check.py's reference reads every list)
ids_status = _IDS.status
_SEQ_KIND = {list: 0, tuple: 1}


def seq_ids(seq, lo: int, hi: int | None, capacity: int, distinct: bool, count: int | None = None
            ) -> np.ndarray | None:
    """The ids of a list or tuple of plain ints as int64, ``[lo, hi)`` of them checked (``hi`` None: to the end;
    each in ``[0, capacity)``; none twice if ``distinct``); None where the reference must decide (another type,
    not ``count`` items where one is given, an item that is not a plain int or does not fit, an id out of range
    or repeated: it words the refusal)."""
    kind = _SEQ_KIND.get(type(seq))
    lib = ids_library()
    if kind is None or lib is None or (count is not None and len(seq) != count):
        return None
    hi = len(seq) if hi is None else hi
    out = np.empty(len(seq), dtype=np.int64)
    got = lib.kvlc_seq_ids(seq, kind, len(out), address(out), lo, hi, capacity, 1 if distinct else 0)
    if got < 0:
        raise MemoryError(f"no memory for a bitmap of {capacity} block ids")
    return out if got == 0 else None


address = clib.address  # the address of a C-contiguous array's first element (for the calls below)


def ids_ok(ids: np.ndarray, capacity: int, distinct: bool) -> bool:
    """Whether every id (a C-contiguous int64 array) lies in ``[0, capacity)`` and, if ``distinct``, none repeats."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    got = library().kvlc_ids_ok(address(ids), len(ids), capacity, 1 if distinct else 0)
    if got < 0:
        raise MemoryError(f"no memory for a bitmap of {capacity} block ids")
    return bool(got)


def breaks(ids: np.ndarray, at: int, n: int) -> int:
    """Of ``n`` tiles whose local ids are ``ids[at:at + n]`` and remote ids the ``n`` after them (a C-contiguous
    int64 array holding all of them), those after the first whose local or remote id does not follow the tile
    before it: ``rows.c``'s count, which :attr:`kvlc.compiler.request.blocks.BlockCopy.runs` takes where the
    library is loaded (its numpy form is the reference)."""
    if at < 0 or n < 0 or at + 2 * n > len(ids):
        raise ValueError(f"breaks: tiles [{at}, {at} + 2 * {n}) lie outside {len(ids)} ids")
    return int(library().kvlc_breaks(address(ids), at, n))


def emit(table: int, buf: int, rows: int, pieces: int, npieces: int, ids: int, parts: int, nparts: int) -> None:
    """rows.c's ``kvlc_emit``: addresses of the packed table and of one request's buffer (its rows first:
    (2, rows, 3) int64), of its piece records, ids and (start, rows) part pairs (rows left written back)."""
    bad = library().kvlc_emit(table, pieces, npieces, ids, buf, rows * 3, parts, nparts)
    if bad:
        raise AssertionError(f"native rows: piece {bad - 1} reads a block id outside its group's ids")
