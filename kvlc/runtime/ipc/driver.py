"""A GPU copy's driver calls with the GIL kept: events recorded on streams, a stream that waits for one, the
question whether one completed, rows queued on the copy engines (:class:`KeptEvents`), and the kernel's launch
(:class:`KeptLaunch`).

A same-host copy on a GPU (:class:`~kvlc.runtime.ipc.copy.GpuCopy`) records an event on the engine's current
stream, makes its own stream wait for it (so the copy reads what the engine wrote before asking), launches, and
records an event after the launch, which every later progress turn asks (``query``). torch's calls for these let
the GIL go around the driver call (pybind's ``gil_scoped_release``): where another Python thread of the engine is
runnable, the caller then waits for it to give the GIL back, up to the interpreter's switch interval (5 ms) per
call: three calls a copy's start and one each time its state is asked. None of these calls waits for the GPU, so
:class:`KeptEvents` makes them through the CUDA driver (``libcuda.so.1``) loaded with :class:`ctypes.PyDLL`,
which keeps the GIL; only :meth:`KeptEvent.synchronize`, which does wait, lets it go.
:class:`TorchEvents` is the same interface through torch (where the driver cannot be reached, or a CPU's
stand-ins for ``torch.cuda`` in the tests).

Where ``table.c`` is loaded, a kept launch's whole start (the ordering after the engine's stream, the table into the
pinned ring, the launch, the event after it) is one C call (:meth:`KeptEvents.start`) that calls the driver's functions
by address, instead of eight calls through ctypes from Python.

Triton's launcher lets the GIL go around its launch too. :class:`KeptLaunch` launches a kernel Triton compiled
(and loaded) with ``cuLaunchKernel`` instead, its parameters packed here: only where the driver states the
compiled function's parameters (``cuFuncGetParamInfo``) and they are exactly the kernel's arguments (8-byte
pointers, 4-byte ints) followed by the pointers Triton appends for scratch memory, which these kernels do not
use (NULL, as Triton passes them), on one CTA with no cooperative or dependent launch. Anything else keeps
Triton's launcher.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any, Literal, get_args

import numpy as np

from kvlc.clib import address
from kvlc.runtime.ipc import native
from kvlc.runtime.ipc.cuda import IpcError

_NOT_READY = 600  # CUDA_ERROR_NOT_READY: the event's work has not completed yet
_DISABLE_TIMING = 0x2  # CU_EVENT_DISABLE_TIMING (what torch.cuda.Event() creates)
_U64 = (1 << 64) - 1
PARAMS_MOST = 64  # parameters asked of a function at most (these kernels have a handful)

GpuCalls = Literal["torch", "driver"]  # how a GPU copy orders and launches its kernel (AgentSettings.ipc_gpu_calls)
GPU_CALLS: tuple[str, ...] = get_args(GpuCalls)
DEFAULT_GPU_CALLS: GpuCalls = "driver"  # checked by content and measured on an H100 (benchmarks/README.md, run 38)


class TorchEvents:
    """Events through ``torch.cuda`` (its calls let the GIL go). ``caller``: the calling thread's current stream
    on the copy's device (a torch Stream)."""

    kept_gil = False
    one_call = False  # (a copy's start is always several calls through torch)

    def __init__(self, torch: Any, caller: Callable[[], Any]):
        self.torch, self.caller = torch, caller
        self._waited = torch.cuda.Event()

    def after_caller(self, stream: Any) -> None:
        """``stream`` runs what is queued next on it only after what the caller's current stream has queued now."""
        self._waited.record(self.caller())
        stream.wait_event(self._waited)

    def recorded(self, stream: Any) -> Any:
        """A new event recorded on ``stream`` now (``query()``: whether the work queued before it completed)."""
        ev = self.torch.cuda.Event()
        ev.record(stream)
        return ev


class _Lib:
    """``libcuda.so.1``'s calls used here, twice: ``kept`` (PyDLL: the GIL stays) and ``free`` (CDLL: it goes,
    for the one call that waits)."""

    _made: _Lib | None = None
    _lock = threading.Lock()

    def __init__(self):
        try:
            self.kept, self.free = ctypes.PyDLL("libcuda.so.1"), ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise IpcError(f"no CUDA driver here (libcuda.so.1: {exc})") from exc
        vp = ctypes.c_void_p
        for lib in (self.kept, self.free):
            for name, args in (("cuEventCreate", [ctypes.POINTER(vp), ctypes.c_uint]),
                               ("cuEventRecord", [vp, vp]), ("cuStreamWaitEvent", [vp, vp, ctypes.c_uint]),
                               ("cuEventQuery", [vp]), ("cuEventSynchronize", [vp]), ("cuEventDestroy_v2", [vp]),
                               ("cuStreamSynchronize", [vp]),
                               ("cuCtxGetCurrent", [ctypes.POINTER(vp)]), ("cuCtxPushCurrent_v2", [vp]),
                               ("cuCtxPopCurrent_v2", [ctypes.POINTER(vp)]),
                               ("cuDevicePrimaryCtxRetain", [ctypes.POINTER(vp), ctypes.c_int]),
                               ("cuDevicePrimaryCtxRelease_v2", [ctypes.c_int]),
                               ("cuGetErrorName", [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]),
                               ("cuInit", [ctypes.c_uint]),
                               ("cuLaunchKernel", [vp, *[ctypes.c_uint] * 7, vp, vp, vp]),
                               ("cuMemcpyAsync", [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, vp])):
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, ctypes.c_int
            info = getattr(lib, "cuFuncGetParamInfo", None)  # (CUDA 12.4 on: without it, Triton's launcher)
            if info is not None:
                size_p = ctypes.POINTER(ctypes.c_size_t)
                info.argtypes, info.restype = [vp, ctypes.c_size_t, size_p, size_p], ctypes.c_int

    @classmethod
    def get(cls) -> _Lib:
        with cls._lock:
            if cls._made is None:
                cls._made = cls()
            return cls._made


class KeptEvent:
    """A CUDA event of :class:`KeptEvents` (created with timing off); destroyed when collected."""

    __slots__ = ("handle", "_owner")

    def __init__(self, handle: int, owner: KeptEvents):
        self.handle, self._owner = handle, owner

    def query(self) -> bool:
        """Whether the work queued before its last record completed (the GIL kept)."""
        return self._owner.query(self)

    def synchronize(self) -> None:
        """Wait until it completed (the GIL let go while waiting)."""
        self._owner.synchronize(self)

    def __del__(self):
        try:
            self._owner.destroy(self.handle)
        except Exception:  # noqa: BLE001 - collected at exit: the driver may be gone already
            pass


class KeptEvents:
    """The same interface as :class:`TorchEvents` through the CUDA driver with the GIL kept, on GPU ``device``'s
    primary context (torch's), made current for each call where the thread has another one (or none) and
    restored after. ``raw_stream(device)``: the calling thread's current stream handle (torch's
    ``_cuda_getCurrentRawStream``). Raises :class:`IpcError` where the driver cannot be reached."""

    kept_gil = True

    def __init__(self, device: int, raw_stream: Callable[[int], int], lib: Any = None):
        self.device, self.raw_stream = device, raw_stream
        self.lib = lib if lib is not None else _Lib.get()
        k = self.lib.kept
        self._check(k.cuInit(0), "cuInit")
        ctx = ctypes.c_void_p()
        self._check(k.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device), f"retain the context of GPU {device}")
        self.ctx = ctx.value
        self._waited = self._new()
        self._queue_fn = self._address(self.lib.kept.cuMemcpyAsync)  # its address for table.c's loop, or None
        self._one = self._start_driver()  # the driver's functions for table.c's one-call start, or None
        self._start_block = native.Start(ctx=self.ctx, waited=self._waited.handle) if self._one else None
        self._start_lock = threading.Lock()  # one start at a time fills the block

    @property
    def one_call(self) -> bool:
        """Whether :meth:`start` runs (``table.c`` loaded, every driver function it calls a C function)."""
        return self._one is not None

    def _start_driver(self) -> native.Driver | None:
        """The driver's functions by address for ``table.c``'s copy start; None where that library is not loaded or
        one of them is no C function (then a start is several calls from here)."""
        k = self.lib.kept
        names = {"ctx_get": "cuCtxGetCurrent", "ctx_push": "cuCtxPushCurrent_v2", "ctx_pop": "cuCtxPopCurrent_v2",
                 "event_create": "cuEventCreate", "event_record": "cuEventRecord",
                 "event_destroy": "cuEventDestroy_v2", "stream_wait": "cuStreamWaitEvent",
                 "stream_sync": "cuStreamSynchronize", "launch": "cuLaunchKernel"}
        got = {field: self._address(getattr(k, name, None)) for field, name in names.items()}
        return None if None in got.values() else native.Driver(**got)

    def _check(self, code: int, what: str) -> None:
        if code:
            name = ctypes.c_char_p()
            self.lib.kept.cuGetErrorName(code, ctypes.byref(name))
            raise IpcError(f"{what}: {(name.value or b'CUDA error').decode()} ({code})")

    def _call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)``'s result (a driver call's: its code), with the device's context current for the call:
        pushed where the thread has another one (or none) and popped after."""
        cur = ctypes.c_void_p()
        k = self.lib.kept
        if not k.cuCtxGetCurrent(ctypes.byref(cur)) and cur.value == self.ctx:
            return fn(*args)
        self._check(k.cuCtxPushCurrent_v2(self.ctx), f"make the context of GPU {self.device} current")
        try:
            return fn(*args)
        finally:
            k.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))

    def _do(self, what: str, fn: Any, *args: Any) -> None:
        self._check(self._call(fn, *args), what)

    def _new(self) -> KeptEvent:
        ev = ctypes.c_void_p()
        self._do("create a CUDA event", self.lib.kept.cuEventCreate, ctypes.byref(ev), _DISABLE_TIMING)
        return KeptEvent(ev.value, self)

    def after_caller(self, stream: Any) -> None:
        k = self.lib.kept
        self._do("record an event on the engine's stream", k.cuEventRecord, self._waited.handle,
                 self.raw_stream(self.device))
        self._do("make the copy's stream wait for the engine's", k.cuStreamWaitEvent, stream.cuda_stream,
                 self._waited.handle, 0)

    def recorded(self, stream: Any) -> KeptEvent:
        ev = self._new()
        self._do("record an event after a copy", self.lib.kept.cuEventRecord, ev.handle, stream.cuda_stream)
        return ev

    def query(self, ev: KeptEvent) -> bool:
        code = self._call(self.lib.kept.cuEventQuery, ev.handle)
        if code == _NOT_READY:
            return False
        self._check(code, "ask whether a copy ended")
        return True

    def copy_rows(self, table: np.ndarray, rows: int, stream: int) -> None:
        """Queue one ``cuMemcpyAsync`` per row of a launch table (int64: sources, destinations, lengths, ``rows`` of
        each) on ``stream`` (unified addresses: the GPU's copy engines move the bytes, between its memory, a peer's
        mapped memory and pinned host memory alike), the GIL kept and the device's context current once for all
        rows: in ``table.c``'s loop where it is loaded and the driver's function has an address, else here. Where
        the driver refuses a row, the rows queued before it are waited for (none lands after the error is
        reported) and :class:`IpcError` names the row."""
        t = np.ascontiguousarray(table, dtype=np.int64)
        u = t.view(np.uint64)
        if self._queue_fn is not None:
            bad = self._call(native.queue, self._queue_fn, t, rows, stream)
        else:
            bad = self._call(self._queue_rows, self.lib.kept.cuMemcpyAsync, u[:rows].tolist(),
                             u[rows:2 * rows].tolist(), u[2 * rows:3 * rows].tolist(), stream)
        if bad is not None:
            row, code = bad
            ev = self._new()
            self._call(self.lib.kept.cuEventRecord, ev.handle, stream)
            self.synchronize(ev)
            self._check(code, f"queue the copy of row {row} ({int(u[2 * rows + row])} bytes, {int(u[row]):#x} -> "
                              f"{int(u[rows + row]):#x}); the {row} rows before it were copied")

    @staticmethod
    def _address(fn: Any) -> int | None:
        """The address ``table.c`` calls for ``fn``: None where that library is not loaded or ``fn`` is no C function
        (then the calls are made from here)."""
        if native.library() is None or fn is None:
            return None
        try:
            return ctypes.cast(fn, ctypes.c_void_p).value or None
        except (ctypes.ArgumentError, TypeError):
            return None

    @staticmethod
    def _queue_rows(fn: Any, src: list[int], dst: list[int], lens: list[int], stream: int) -> tuple[int, int] | None:
        for i, (s, d, n) in enumerate(zip(src, dst, lens)):
            code = fn(d, s, n, stream)
            if code:
                return i, code
        return None

    def synchronize(self, ev: KeptEvent) -> None:
        self._do("wait for a copy to end", self.lib.free.cuEventSynchronize, ev.handle)

    def start(self, function: int, grid: tuple[int, int, int], threads: int, shared: int, stream: int, params: Any,
              ring: int, words: np.ndarray) -> KeptEvent:
        """A copy's start in one call of ``table.c`` (only where :attr:`one_call`): ``words`` (C-contiguous int64,
        the row table or ids the kernel reads in place) written at ``ring``, the copy's ``stream`` made to wait for
        what the caller's current stream queued, ``function`` launched on ``grid`` with the parameter block
        ``params``, and the new event recorded after it, which is returned: what :meth:`after_caller`, a
        :class:`KeptLaunch`'s launch and :meth:`recorded` do, in one C call instead of eight through ctypes.
        Raises :class:`IpcError` naming the step the driver refused; a refusal after the launch waits for the
        copy's stream first (no byte lands after the error)."""
        b = self._start_block
        with self._start_lock:
            b.caller, b.stream, b.ring = self.raw_stream(self.device), stream, ring
            b.words, b.nbytes = (address(words), 8 * len(words)) if len(words) else (None, 0)
            b.function, b.threads, b.shared, b.params = function, threads, shared, ctypes.addressof(params)
            b.grid[0], b.grid[1], b.grid[2] = grid
            got = native.start(self._one, b)
        if got.step < 0:
            return KeptEvent(got.event, self)
        what = native.START_STEPS[got.step] + ("; the copy's stream was waited for" if got.step == native.START_AFTER
                                                else "; nothing was launched")
        self._check(got.code, what)
        raise IpcError(f"{what}: the driver gave no error code")

    def params(self, function: int, info: Any) -> list[int] | None:
        """The byte size of each parameter of ``function`` (``cuFuncGetParamInfo``), None where it cannot say."""
        out: list[int] = []
        off, size = ctypes.c_size_t(), ctypes.c_size_t()
        for i in range(PARAMS_MOST + 1):
            if self._call(info, function, i, ctypes.byref(off), ctypes.byref(size)):
                return out if i else None  # (past the last parameter: an invalid index)
            out.append(int(size.value))
        return None

    def launch(self, function: int, grid: tuple[int, int, int], threads: int, shared: int, stream: int,
               params: Any) -> None:
        self._do("launch the copy kernel", self.lib.kept.cuLaunchKernel, function, grid[0], grid[1], grid[2],
                 threads, 1, 1, shared, stream, params, None)

    def destroy(self, handle: int) -> None:
        """Destroy an event (one still pending is released once its work completed)."""
        self._call(self.lib.kept.cuEventDestroy_v2, handle)


class KeptLaunch:
    """One compiled Triton kernel launched through ``cuLaunchKernel`` with the GIL kept (see the module docstring).
    ``sizes``: the bytes of each argument it is launched with (8: a pointer, 4: an int), then ``extra`` NULL
    pointers. Made by :meth:`of`, which says None where that does not match the compiled function exactly."""

    def __init__(self, owner: KeptEvents, function: int, sizes: tuple[int, ...], extra: int, threads: int,
                 shared: int):
        self.owner, self.function, self.sizes, self.extra = owner, function, sizes, extra
        self.threads, self.shared = threads, shared
        # The parameter block, made once: each launch sets the values (cuLaunchKernel copies them during the call).
        # Building it per launch (ctypes values, an array type) cost 4.0 µs against 0.4 on this project's VM.
        self._values = [ctypes.c_uint64() if n == 8 else ctypes.c_int32() for n in sizes]
        self._values += [ctypes.c_void_p(None) for _ in range(extra)]
        self._params = (ctypes.c_void_p * len(self._values))(*[ctypes.addressof(v) for v in self._values])
        self._lock = threading.Lock()  # one launch at a time fills the block

    @classmethod
    def of(cls, owner: KeptEvents, compiled: Any, sizes: tuple[int, ...]) -> KeptLaunch | None:
        """The kept launch of ``compiled`` (a Triton CompiledKernel that ran once: loaded) for arguments of ``sizes``
        bytes, or None: no ``cuFuncGetParamInfo`` here, the function's parameters not ``sizes`` and then only
        8-byte ones (at most two), scratch memory, more than one CTA, a cooperative or dependent launch."""
        md = getattr(compiled, "metadata", None)
        function = getattr(compiled, "function", None)
        info = getattr(owner.lib.kept, "cuFuncGetParamInfo", None)
        if md is None or not function or info is None:
            return None
        plain = (getattr(md, "num_ctas", 1) == 1 and not getattr(md, "launch_cooperative_grid", False)
                 and not getattr(md, "launch_pdl", False) and not getattr(md, "global_scratch_size", 0)
                 and not getattr(md, "profile_scratch_size", 0)
                 and tuple(getattr(md, "cluster_dims", (1, 1, 1))) in ((1, 1, 1), (0, 0, 0)))
        if not plain:
            return None
        got = owner.params(function, info)
        if got is None or tuple(got[:len(sizes)]) != tuple(sizes):
            return None
        extra = got[len(sizes):]
        if len(extra) > 2 or any(n != 8 for n in extra):
            return None
        threads = int(md.num_warps) * int(getattr(md, "warp_size", 32))
        return cls(owner, int(function), tuple(sizes), len(extra), threads, int(md.shared))

    def launch(self, grid: tuple[int, int, int], args: tuple[int, ...], stream: int) -> None:
        """Launch on ``grid`` with ``args`` (ints: addresses and values, in the kernel's order) on ``stream``."""
        with self._lock:
            self._fill(args)
            self.owner.launch(self.function, grid, self.threads, self.shared, stream, self._params)

    def start(self, grid: tuple[int, int, int], args: tuple[int, ...], stream: int, ring: int,
              words: np.ndarray) -> KeptEvent:
        """The whole start of a copy with this launch in one C call (:meth:`KeptEvents.start`): its event."""
        with self._lock:
            self._fill(args)
            return self.owner.start(self.function, grid, self.threads, self.shared, stream, self._params, ring, words)

    def _fill(self, args: tuple[int, ...]) -> None:
        if len(args) != len(self.sizes):
            raise ValueError(f"the copy kernel takes {len(self.sizes)} arguments, got {len(args)}")
        for v, a, n in zip(self._values, args, self.sizes):
            v.value = a & _U64 if n == 8 else a
