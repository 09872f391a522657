"""A GPU copy's ordering calls through the CUDA driver with the GIL kept (kvlc.runtime.ipc.driver).

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
from kvlc.runtime.ipc.driver import KeptEvents, TorchEvents

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
        self.launches: list = []
        self.params = {}
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

    params: dict = {}  # function -> its parameters' sizes (cuFuncGetParamInfo)
    on_launch = None  # (function, grid, values) -> None: what a launch does

    def do_cuFuncGetParamInfo(self, function, i, off, size):
        got = self.params.get(function)
        if got is None or i >= len(got):
            return 1  # CUDA_ERROR_INVALID_VALUE: past the last parameter
        self._set(off, sum(got[:i]))
        self._set(size, got[i])
        return 0

    def do_cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        self._in_primary()
        sizes = self.params[function]
        values = [(ctypes.c_uint64 if n == 8 else ctypes.c_int32).from_address(params[i]).value
                  for i, n in enumerate(sizes)]
        self.launches.append((function, (gx, gy, gz), (bx, by, bz), shared, stream, values))
        if self.on_launch is not None:
            self.on_launch(function, (gx, gy, gz), values)
        return 0

    def do_cuGetErrorName(self, code, ref):
        self._set(ref, b"CUDA_ERROR_LAUNCH_FAILED" if code == 719 else b"CUDA_ERROR_X")
        return 0


class _NoParamInfo(FakeDriver):
    """A driver before CUDA 12.4: no cuFuncGetParamInfo."""

    def __init__(self):
        super().__init__()
        self.kept = type("NoInfo", (), {"__getattr__": lambda _, n: (_ for _ in ()).throw(AttributeError(n))
                                        if n == "cuFuncGetParamInfo" else _Fn(self, n, True)})()


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


def _compiled(function: int = 0x51, **md):
    from types import SimpleNamespace

    meta = dict(num_warps=4, warp_size=32, shared=128, num_ctas=1, launch_cooperative_grid=False, launch_pdl=False,
                global_scratch_size=0, profile_scratch_size=0)
    meta.update(md)
    return SimpleNamespace(function=function, metadata=SimpleNamespace(**meta))


def test_a_kept_launch_packs_the_kernels_arguments_and_null_scratch_pointers():
    """The driver says the function takes (8, 4) and Triton's two scratch pointers: the launch passes a pointer,
    an int32 and two NULLs, on the grid, with num_warps x 32 threads and the kernel's shared memory."""
    from kvlc.runtime.ipc.driver import KeptLaunch

    drv = FakeDriver()
    drv.params = {0x51: [8, 4, 8, 8]}
    ev = KeptEvents(0, lambda device: 0, lib=drv)
    kept = KeptLaunch.of(ev, _compiled(), (8, 4))
    assert kept is not None and kept.extra == 2
    kept.launch((7, 1, 1), (0xDEADBEEF000, 300), 0x99)
    assert drv.launches == [(0x51, (7, 1, 1), (128, 1, 1), 128, 0x99, [0xDEADBEEF000, 300, 0, 0])]


def test_each_kept_launch_passes_its_own_arguments_through_the_one_parameter_block():
    """The parameter block is made once and filled per launch: every launch carries exactly its own values (a
    negative int32, an address with the top bit set), the scratch pointers stay NULL, a wrong count is refused."""
    from kvlc.runtime.ipc.driver import KeptLaunch

    drv = FakeDriver()
    drv.params = {0x51: [8, 4, 8, 8]}
    kept = KeptLaunch.of(KeptEvents(0, lambda device: 0, lib=drv), _compiled(), (8, 4))
    calls = [(0xDEADBEEF000, 300), (1 << 63 | 0x10, -7), (0x1000, 0), (0xDEADBEEF000, 2**31 - 1)]
    for i, args in enumerate(calls):
        kept.launch((i + 1, 1, 1), args, 0x99)
    assert [(grid[0], values) for _, grid, _, _, _, values in drv.launches] == [
        (1, [0xDEADBEEF000, 300, 0, 0]), (2, [1 << 63 | 0x10, -7, 0, 0]), (3, [0x1000, 0, 0, 0]),
        (4, [0xDEADBEEF000, 2**31 - 1, 0, 0])]
    with pytest.raises(ValueError, match="takes 2 arguments, got 3"):
        kept.launch((1, 1, 1), (1, 2, 3), 0x99)
    assert len(drv.launches) == 4


@pytest.mark.parametrize("params, md", [
    ([8, 8, 8, 8], {}),          # an argument of another size than given
    ([8, 4, 4], {}),             # an extra parameter that is not a pointer
    ([8, 4, 8, 8, 8], {}),       # more extras than Triton's two scratch pointers
    ([8], {}),                   # fewer parameters than arguments
    ([8, 4, 8, 8], {"global_scratch_size": 64}),
    ([8, 4, 8, 8], {"profile_scratch_size": 64}),
    ([8, 4, 8, 8], {"num_ctas": 2}),
    ([8, 4, 8, 8], {"launch_pdl": True}),
    ([8, 4, 8, 8], {"launch_cooperative_grid": True}),
    ([8, 4, 8, 8], {"cluster_dims": (2, 1, 1)}),
    (None, {}),                  # the driver cannot say
])
def test_a_kept_launch_is_only_made_where_the_driver_states_exactly_the_kernels_parameters(params, md):
    from kvlc.runtime.ipc.driver import KeptLaunch

    drv = FakeDriver()
    if params is not None:
        drv.params = {0x51: params}
    ev = KeptEvents(0, lambda device: 0, lib=drv)
    assert KeptLaunch.of(ev, _compiled(**md), (8, 4)) is None
    assert not drv.launches


def test_no_kept_launch_without_cufuncgetparaminfo():
    from kvlc.runtime.ipc.driver import KeptLaunch

    drv = _NoParamInfo()
    drv.params = {0x51: [8, 4, 8, 8]}
    assert KeptLaunch.of(KeptEvents(0, lambda device: 0, lib=drv), _compiled(), (8, 4)) is None


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
def kernel(interpreted):
    """The copy kernel run by Triton's interpreter, behind ``copy_rows[grid](...)`` (test_ipc_kernel's stand-in)."""
    from tests.runtime.test_ipc_kernel import _Kernel

    return _Kernel(interpreted)


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


class _Compiling:
    """Triton's call as the GPU copy sees it on a GPU: the interpreted kernel runs, and the call returns a compiled
    kernel (a function handle per kernel, metadata) whose ``[grid](...)`` runs the interpreted kernel again (Triton's
    direct launcher)."""

    HANDLES = {"copy_rows": 0x51, "copy_blocks": 0x52}

    def __init__(self, kernel):
        self.kernel, self.direct = kernel, 0

    def __getattr__(self, name):
        inner = getattr(self.kernel, name)
        outer = self

        class _Grid:
            def __getitem__(self, grid):
                def run(*args, **kw):
                    inner[grid](*args, **kw)
                    return outer._compiled(name, kw)
                return run
        return _Grid()

    def _compiled(self, name, kw):
        consts = {k: v for k, v in kw.items() if k != "num_warps"}
        outer, inner = self, getattr(self.kernel, name)

        class _C:
            function = self.HANDLES[name]
            metadata = _compiled().metadata

            def __getitem__(self, grid):
                def run(*args, stream=None):
                    outer.direct += 1
                    n = len(args) - len(consts)
                    inner[grid](*args[:n], **dict(zip(consts, args[n:])))
                return run
        return _C()


def _rows_on_launch(function, grid, values):
    """What copy_rows does, from its launch's parameters: the table's rows (sources, destinations, lengths) moved."""
    table, n = values[0], values[1]
    t = np.ctypeslib.as_array((ctypes.c_uint64 * (3 * n)).from_address(table))
    for src, dst, ln in zip(t[:n], t[n:2 * n], t[2 * n:]):
        ctypes.memmove(int(dst), int(src), int(ln))


@pytest.mark.parametrize("moves", [True, False])
def test_warm_up_keeps_the_drivers_launch_only_where_it_copies_right(kernel, moves):
    """The row kernel's direct launch goes through the driver (the GIL kept) where its parameters are stated; warm-up
    checks it by content: a launch that moves the rows is kept, one that does not is dropped for Triton's launcher
    (the direct launch stays), and copies are right either way. The block kernel's parameters are not the ones
    stated for it here: Triton's launcher."""
    drv = FakeDriver()
    drv.params = {0x51: [8, 4, 8, 8], 0x52: [8, 8, 8, 4]}  # (copy_blocks: entries, ids, write: not what is stated)
    drv.on_launch = _rows_on_launch if moves else None
    kern = _Compiling(kernel)
    cp = _gpu_copy(kern)
    cp.events = KeptEvents(0, lambda device: 0, lib=drv)
    cp.warm()
    assert cp.direct and cp.blocks and cp.kept_launch is moves
    assert {f for f, *_ in drv.launches} == {0x51}
    a = torch.arange(200, dtype=torch.uint8)
    b = torch.zeros(200, dtype=torch.uint8)
    one = lambda v: np.array([v], dtype=np.uint64)  # noqa: E731
    launches, direct = len(drv.launches), kern.direct
    cp.start(one(a.data_ptr()), one(b.data_ptr()), one(136))
    assert (b.numpy()[:136] == a.numpy()[:136]).all() and not b.numpy()[136:].any()
    assert (len(drv.launches), kern.direct) == ((launches + 1, direct) if moves else (launches, direct + 1))


def test_the_agents_setting_chooses_the_gpu_copys_calls(monkeypatch):
    """``AgentSettings.ipc_gpu_calls`` (``KVLC_IPC_GPU_CALLS``) reaches the route's GpuCopy; the driver's by
    default; anything but torch or driver is refused where the settings are made."""
    import pydantic

    from kvlc.runtime.ipc import route as route_mod
    from kvlc.runtime.settings import AgentSettings

    assert AgentSettings(insecure=True).ipc_gpu_calls == "driver"
    monkeypatch.setenv("KVLC_IPC_GPU_CALLS", "torch")
    assert AgentSettings(insecure=True).ipc_gpu_calls == "torch"
    with pytest.raises(pydantic.ValidationError, match="ipc_gpu_calls"):
        AgentSettings(insecure=True, ipc_gpu_calls="cuda")
    made = []
    monkeypatch.setattr(route_mod, "GpuCopy", lambda device, **kw: made.append((device, kw)) or "copy")
    for given, calls in ((("driver",), "driver"), (("torch",), "torch"), ((), "driver")):
        made.clear()
        r = route_mod.IpcRoute(None, {}, 64, *given)
        r.gpu = 0
        assert r._gpu() == "copy" and made == [(0, {"calls": calls})]
    from kvlc.runtime.ipc.copy import GpuCopy

    with pytest.raises(ValueError, match="calls must be one of torch, driver; got 'cuda'"):
        GpuCopy(0, calls="cuda")  # (refused before anything is made)
