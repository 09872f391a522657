"""The same-host copy's row table in C (``table.c``), loaded through ctypes; the numpy code it mirrors
is the reference (``kvlc.runtime.ipc.route._Windows.translate``, then :func:`kvlc.runtime.ipc.copy.row_table`).

``table.c`` is a plain C library (no Python API), built by ``pip install`` (setup.py, an optional
extension) and loaded with ctypes, so one build loads on any CPython (a GPU host can carry it).
:func:`library` is None when it is not built or when ``KVLC_NATIVE=0``; the reference then runs,
with the same tables and refusals (``tests/runtime/test_ipc_table.py``).

On a GPU, ``table.c`` also makes a copy's driver calls, by the functions' addresses: the copy engines' rows
(:func:`queue`) and a kernel copy's whole start (:func:`start`); without it they are made one by one from Python
(``kvlc.runtime.ipc.driver``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvlc import clib

ABI_VERSION = 4
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


_LIB = clib.Library(Path(__file__).resolve().parent, "_table", "kvlc/runtime/ipc/table.c", "kvlc_ipc_abi_version",
                   ABI_VERSION, "numpy builds the row table and a GPU copy's driver calls go one by one from Python",
                   {"kvlc_ipc_table": ((_PTR, _PTR, _I64, ctypes.c_int, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64,
                                        _PTR, _PTR), _I64),
                    "kvlc_ipc_inside": ((_PTR, _PTR, _I64, _PTR, _PTR, _I64), _I64),
                    "kvlc_ipc_queue": ((_PTR, _PTR, _I64, _PTR, _PTR), _I64),
                    "kvlc_ipc_start": ((_PTR, _PTR, _PTR, _PTR), _I64)})
library = _LIB.library  # the loaded C library, or None (numpy builds the table; status() says why)
status = _LIB.status    # one line: which row-table builder runs, and why


def _rows(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.int64).reshape(-1, 3)


@dataclass(frozen=True)
class Windows:
    """A peer's mapped windows as ``table.c`` reads them: addresses of C-contiguous arrays, sorted by start
    (uint64 starts and stops, int64 shifts; per memory type, int64 0/1 whether each window holds it)."""

    count: int
    starts: int
    stops: int
    shifts: int
    usable: dict  # memory type -> address of its 0/1 array
    keep: tuple   # the arrays themselves (alive as long as this)

    @classmethod
    def of(cls, starts: np.ndarray, stops: np.ndarray, shifts: np.ndarray, usable: dict) -> "Windows":
        arrays = [np.ascontiguousarray(a) for a in (starts, stops, shifts)]
        ok = {m: np.ascontiguousarray(a, dtype=np.int64) for m, a in usable.items()}
        return cls(len(starts), *(a.ctypes.data for a in arrays), {m: a.ctypes.data for m, a in ok.items()},
                   (*arrays, *ok.values()))


def build(local: np.ndarray, remote: np.ndarray, write: bool, windows: Windows, mem: str,
          chunk: int) -> tuple[np.ndarray | None, int]:
    """``table.c``'s launch table of a part: ``(table, low bits)``, or ``(None, index of the first peer row
    outside every window holding ``mem``)``. ``local`` / ``remote``: the part's (n, 3) rows; ``write``:
    the local rows are the sources. One pass where no row is longer than ``chunk`` (the usual case)."""
    lib = library()
    local, remote = _rows(local), _rows(remote)
    n, la, ra = len(local), local.ctypes.data, remote.ctypes.data
    info = np.empty(2, dtype=np.int64)  # the table's rows, the OR of its words' low bits
    cap = n
    while True:
        table = np.empty(3 * cap, dtype=np.int64)
        got = lib.kvlc_ipc_table(la, ra, n, 1 if write else 0, windows.starts, windows.stops, windows.shifts,
                                 windows.usable[mem], windows.count, chunk, cap, table.ctypes.data, info.ctypes.data)
        if got >= 0:
            return None, int(got)
        rows = int(info[0])
        if got == -1:
            return (table if rows == cap else table.reshape(3, cap)[:, :rows].reshape(-1)), int(info[1])
        cap = rows  # rows cut at the chunk: room for every piece


def first_outside(addr: np.ndarray, lens: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> int:
    """``table.c``'s check of DRAM rows against regions: -1 when every row (C-contiguous uint64 ``addr``,
    ``lens``) has bytes and lies inside one region (``starts`` / ``stops``: C-contiguous uint64, sorted, not
    overlapping), else the index of the first that does not."""
    return int(library().kvlc_ipc_inside(addr.ctypes.data, lens.ctypes.data, len(addr), starts.ctypes.data,
                                         stops.ctypes.data, len(starts)))


def queue(fn: int, table: np.ndarray, rows: int, stream: int) -> tuple[int, int] | None:
    """``table.c``'s loop over a launch table (C-contiguous int64: sources, destinations, lengths, ``rows`` of
    each): one call of the driver function at address ``fn`` (``cuMemcpyAsync``'s signature) per row on
    ``stream``, the GIL held. None when every row was queued, else ``(row, code)`` of the row it refused."""
    if table.dtype != np.int64 or not table.flags.c_contiguous or len(table) < 3 * rows:
        raise ValueError(f"queue: a C-contiguous int64 table of 3 x {rows} words, got {table.dtype} x {len(table)}")
    code = np.zeros(1, dtype=np.int64)
    got = int(library().kvlc_ipc_queue(fn, table.ctypes.data, rows, stream, code.ctypes.data))
    return None if got < 0 else (got, int(code[0]))


class Driver(ctypes.Structure):
    """``table.c``'s ``struct kvlc_driver``: the driver's functions a copy's start calls, by address."""

    _fields_ = [(name, _PTR) for name in ("ctx_get", "ctx_push", "ctx_pop", "event_create", "event_record",
                                           "event_destroy", "stream_wait", "stream_sync", "launch")]


class Start(ctypes.Structure):
    """``table.c``'s ``struct kvlc_start``: one copy's start (see :func:`start`)."""

    _fields_ = [("ctx", _PTR), ("caller", _PTR), ("waited", _PTR), ("stream", _PTR), ("ring", _PTR),
                ("words", _PTR), ("nbytes", _I64), ("function", _PTR), ("grid", ctypes.c_uint32 * 3),
                ("threads", ctypes.c_uint32), ("shared", ctypes.c_uint32), ("params", _PTR)]


START_STEPS = ("make the device's context current", "record an event on the engine's stream",
               "make the copy's stream wait for the engine's", "create the copy's event", "launch the copy kernel",
               "record an event after the copy")  # table.c's steps, in its order
START_AFTER = len(START_STEPS) - 1  # the step after the launch: a failure there waited for the copy's stream


@dataclass(frozen=True)
class Started:
    """What :func:`start` did: ``event`` (the new event's handle) where ``step`` is -1, else 0, the step that failed
    (an index of :data:`START_STEPS`) and the driver's ``code``."""

    event: int
    step: int
    code: int


def start(driver: Driver, s: Start) -> Started:
    """``table.c``'s copy start in one call, the GIL held. A failure before the launch launched nothing; after it,
    the copy's stream was waited for and the new event destroyed."""
    event, code = ctypes.c_void_p(), ctypes.c_int64()
    step = int(library().kvlc_ipc_start(ctypes.byref(driver), ctypes.byref(s), ctypes.byref(event),
                                        ctypes.byref(code)))
    return Started(event.value or 0, step, int(code.value))
