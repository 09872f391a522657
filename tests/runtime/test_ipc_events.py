"""A GPU copy's ordering calls through the CUDA driver with the GIL kept (kvlc.runtime.ipc.events).

This machine has no GPU: the driver is stood in for by an object with libcuda's functions (each records its
call and answers as the driver does), which KeptEvents takes instead of ``libcuda.so.1``. The GPU suite's content
checks and ``benchmarks/probes/launch_cost.py`` run the real driver on the lent GPU.
"""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest

from kvlc.runtime.ipc.cuda import IpcError
from kvlc.runtime.ipc.events import KeptEvents, TorchEvents

PRIMARY, OTHER = 0x1000, 0x2000
NOT_READY = 600


class _Fn:
    def __init__(self, lib, name: str, kept: bool):
        self.lib, self.name, self.kept = lib, name, kept

    def __call__(self, *args):
        self.lib.calls.append((self.name, self.kept, args))
        return getattr(self.lib, "do_" + self.name)(*args)


class _Side:
    """``kept`` or ``free``: the same driver, each call recorded with the side it went through."""

    def __init__(self, lib, kept: bool):
        self.lib, self.kept = lib, kept

    def __getattr__(self, name):
        return _Fn(self.lib, name, self.kept)


class FakeDriver:
    """libcuda's calls KeptEvents makes: one context stack per test (``current``), events whose completion the
    test sets (``pending``), an error code to return from the next query (``fail``)."""

    def __init__(self, current: int | None = PRIMARY):
        self.calls: list = []
        self.stack = [current] if current else []
        self.handles = itertools.count(0x7000)
        self.live: set[int] = set()
        self.recorded: dict[int, int] = {}  # event -> stream
        self.waits: list[tuple[int, int]] = []
        self.pending: set[int] = set()
        self.fail = 0
        self.kept, self.free = _Side(self, True), _Side(self, False)

    @staticmethod
    def _set(ref, value) -> None:
        ref._obj.value = value

    def do_cuInit(self, flags):
        return 0

    def do_cuDevicePrimaryCtxRetain(self, ref, device):
        self._set(ref, PRIMARY)
        return 0

    def do_cuCtxGetCurrent(self, ref):
        self._set(ref, self.stack[-1] if self.stack else None)
        return 0

    def do_cuCtxPushCurrent_v2(self, ctx):
        self.stack.append(ctx)
        return 0

    def do_cuCtxPopCurrent_v2(self, ref):
        self._set(ref, self.stack.pop())
        return 0

    def _in_primary(self) -> None:
        assert self.stack and self.stack[-1] == PRIMARY, "a call outside the device's context"

    def do_cuEventCreate(self, ref, flags):
        self._in_primary()
        assert flags == 0x2  # timing off, as torch.cuda.Event()
        h = next(self.handles)
        self.live.add(h)
        self._set(ref, h)
        return 0

    def do_cuEventRecord(self, ev, stream):
        self._in_primary()
        assert ev in self.live
        self.recorded[ev] = stream
        return 0

    def do_cuStreamWaitEvent(self, stream, ev, flags):
        self._in_primary()
        self.waits.append((stream, ev))
        return 0

    def do_cuEventQuery(self, ev):
        if self.fail:
            return self.fail
        return NOT_READY if ev in self.pending else 0

    def do_cuEventSynchronize(self, ev):
        self.pending.discard(ev)
        return 0

    def do_cuEventDestroy_v2(self, ev):
        self.live.discard(ev)
        return 0

    def do_cuGetErrorName(self, code, ref):
        self._set(ref, b"CUDA_ERROR_LAUNCH_FAILED" if code == 719 else b"CUDA_ERROR_X")
        return 0


class _Stream:
    def __init__(self, handle: int):
        self.cuda_stream = handle


def test_a_copys_start_waits_for_the_callers_stream_and_records_after_it_all_with_the_gil_kept():
    """after_caller records the caller's current stream (its raw handle, asked each time) and makes the copy's
    stream wait for that event; recorded() makes a new event on the copy's stream; every call but the one that
    waits goes through the GIL-keeping library."""
    drv = FakeDriver()
    caller = {"now": 0xA}
    ev = KeptEvents(0, lambda device: caller["now"], lib=drv)
    ours = _Stream(0xB)
    ev.after_caller(ours)
    done = ev.recorded(ours)
    assert drv.recorded[ev._waited.handle] == 0xA and drv.waits == [(0xB, ev._waited.handle)]
    assert drv.recorded[done.handle] == 0xB and done.handle != ev._waited.handle
    caller["now"] = 0xC  # the engine switched streams: the next start waits for its new one
    ev.after_caller(ours)
    assert drv.recorded[ev._waited.handle] == 0xC and drv.waits[-1] == (0xB, ev._waited.handle)
    drv.pending.add(done.handle)
    assert done.query() is False
    done.synchronize()
    assert done.query() is True
    sides = {(name, kept) for name, kept, _ in drv.calls}
    assert ("cuEventSynchronize", False) in sides
    assert all(kept for name, kept, _ in drv.calls if name != "cuEventSynchronize")


@pytest.mark.parametrize("current", [None, OTHER])
def test_calls_from_a_thread_without_the_devices_context_push_it_and_give_the_old_one_back(current):
    """A thread with no context current, or another device's, gets the device's primary context for each call
    and its own back after it (an engine's thread keeps the device torch set for it)."""
    drv = FakeDriver(current)
    ev = KeptEvents(0, lambda device: 0, lib=drv)
    ev.after_caller(_Stream(5))
    done = ev.recorded(_Stream(5))
    assert done.query() is True
    assert drv.stack == ([current] if current else [])
    pushes = sum(1 for name, _, _ in drv.calls if name == "cuCtxPushCurrent_v2")
    pops = sum(1 for name, _, _ in drv.calls if name == "cuCtxPopCurrent_v2")
    assert pushes == pops >= 4


def test_on_the_devices_context_nothing_is_pushed():
    drv = FakeDriver(PRIMARY)
    ev = KeptEvents(0, lambda device: 0, lib=drv)
    ev.after_caller(_Stream(5))
    ev.recorded(_Stream(5)).query()
    assert not any(name in ("cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2") for name, _, _ in drv.calls)


def test_a_driver_error_is_raised_with_its_name_and_events_are_destroyed_when_dropped():
    drv = FakeDriver()
    ev = KeptEvents(0, lambda device: 0, lib=drv)
    done = ev.recorded(_Stream(1))
    h = done.handle
    drv.fail = 719
    with pytest.raises(IpcError, match=r"ask whether a copy ended: CUDA_ERROR_LAUNCH_FAILED \(719\)"):
        done.query()
    assert h in drv.live
    del done
    assert h not in drv.live


def test_no_driver_here_is_an_ipc_error():
    """This machine has no libcuda.so.1: KeptEvents cannot be made (GpuCopy then takes torch's calls)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        with pytest.raises(IpcError, match="no CUDA driver here"):
            KeptEvents(0, lambda device: 0)
    else:  # pragma: no cover - a GPU host
        pytest.skip("this host has a CUDA driver")


torch = pytest.importorskip("torch")
pytest.importorskip("triton")


def _gpu_copy(interpreted_kernel, events=None):
    from kvlc.runtime.ipc.copy import GpuCopy
    from testkit.gpu_standin import TorchStandIn

    cp = GpuCopy(0, block_words=16, torch=TorchStandIn(), kernel=interpreted_kernel)
    if events is not None:
        cp.events = events
    return cp


@pytest.fixture(scope="module")
def kernel():
    """The copy kernel run by Triton's interpreter, behind ``copy_rows[grid](...)`` (test_ipc_kernel's stand-in)."""
    import importlib.util
    import os
    from pathlib import Path

    from tests.runtime.test_ipc_kernel import _Kernel

    path = Path(__file__).resolve().parents[2] / "kvlc" / "runtime" / "ipc" / "kernel.py"
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        spec = importlib.util.spec_from_file_location("kvlc_ipc_kernel_events", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    return _Kernel(mod)


def test_gpu_copy_orders_each_copy_with_the_drivers_events(kernel):
    """With the driver's events, each start records the caller's stream, makes the copy's stream wait, launches,
    records after; the launch's event says when it ended; rows land as with torch's events."""
    drv = FakeDriver()
    cp = _gpu_copy(kernel)
    cp.events = KeptEvents(0, lambda device: 0xE, lib=drv)
    cp.warm()
    assert isinstance(cp.events, KeptEvents)
    a = torch.arange(64, dtype=torch.uint8)
    b = torch.zeros(64, dtype=torch.uint8)
    one = lambda v: np.array([v], dtype=np.uint64)  # noqa: E731
    before = len(drv.waits)
    launch = cp.start(one(a.data_ptr()), one(b.data_ptr()), one(40))
    assert (b.numpy()[:40] == a.numpy()[:40]).all() and not b.numpy()[40:].any()
    assert drv.waits[before:] == [(cp.stream.cuda_stream, cp.events._waited.handle)]
    assert drv.recorded[cp.events._waited.handle] == 0xE
    assert drv.recorded[launch.event.handle] == cp.stream.cuda_stream
    drv.pending.add(launch.event.handle)
    assert not launch.done()
    drv.pending.clear()
    assert launch.done()


def test_gpu_copy_falls_back_to_torchs_events_where_the_drivers_fail(kernel):
    """Warm-up tries the driver's event calls first; where one fails, torch's are used and copies stay right."""
    drv = FakeDriver()
    drv.do_cuStreamWaitEvent = lambda stream, ev, flags: 719
    cp = _gpu_copy(kernel)
    cp.events = KeptEvents(0, lambda device: 0, lib=drv)
    cp.warm()
    assert isinstance(cp.events, TorchEvents) and cp.host_table and cp.vec
    a = torch.arange(32, dtype=torch.uint8)
    b = torch.zeros(32, dtype=torch.uint8)
    one = lambda v: np.array([v], dtype=np.uint64)  # noqa: E731
    cp.start(one(a.data_ptr()), one(b.data_ptr()), one(32))
    assert (b.numpy() == a.numpy()).all()


def test_a_gpu_copy_with_torch_stand_ins_takes_torchs_events(kernel):
    """The tests' stand-ins for torch.cuda have no driver behind them: torch's calls."""
    assert isinstance(_gpu_copy(kernel).events, TorchEvents)
