"""A same-host GPU copy's whole start in one C call (``table.c``'s ``kvlc_ipc_start``, :meth:`KeptEvents.start`).

No GPU here: the driver is test_ipc_driver's stand-in, its functions made C function pointers (as libcuda's are) so
that ``table.c`` calls them by address, with a launch that moves the row table's bytes at once (unified addressing
on a CPU); every test checks content. The GPU suite's handovers and ``benchmarks/probes/launch_cost.py`` run the real
driver on the lent GPU.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlc.runtime.ipc import native
from kvlc.runtime.ipc.copy import move_rows
from kvlc.runtime.ipc.cuda import IpcError
from kvlc.runtime.ipc.driver import KeptEvents
from tests.runtime.test_ipc_driver import PRIMARY, FakeDriver, _Compiling, _rows_on_launch

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

if native.library() is None:
    pytest.skip(f"table.c: {native.status()}", allow_module_level=True)

_VP, _U = ctypes.c_void_p, ctypes.c_uint
_SIGNATURES = {  # the driver's functions table.c's start calls: their arguments (each returns an int, CUresult)
    "cuCtxGetCurrent": (_VP,), "cuCtxPushCurrent_v2": (_VP,), "cuCtxPopCurrent_v2": (_VP,),
    "cuEventCreate": (_VP, _U), "cuEventRecord": (_VP, _VP), "cuEventDestroy_v2": (_VP,),
    "cuStreamWaitEvent": (_VP, _VP, _U), "cuStreamSynchronize": (_VP,),
    "cuLaunchKernel": (_VP, _U, _U, _U, _U, _U, _U, _U, _VP, _VP, _VP),
}
_OUT = {"cuCtxGetCurrent", "cuCtxPopCurrent_v2", "cuEventCreate"}  # (their first argument: where the result goes)
_STARTS = {"cuEventRecord", "cuStreamWaitEvent", "cuEventCreate", "cuLaunchKernel"}  # a start's own calls


class _At:
    """A result's place at a C address, as the stand-in's ``_set`` writes it (``ref._obj.value``)."""

    def __init__(self, addr: int):
        self._obj = _VP.from_address(addr)


class _FromPython:
    """A driver function called from Python (KeptEvents' own calls): the same C function, counted; ``table.c`` takes
    its address (``_as_parameter_``)."""

    def __init__(self, drv: CStartDriver, name: str, fn):
        self.drv, self.name, self._as_parameter_ = drv, name, fn

    def __call__(self, *args):
        self.drv.from_python.append(self.name)
        self.drv.in_python += 1
        try:
            return self._as_parameter_(*args)
        finally:
            self.drv.in_python -= 1


class CStartDriver(FakeDriver):
    """The stand-in driver with table.c's functions as C function pointers (the rest stay Python). ``refuse``: a
    function name whose next call from ``table.c`` returns CUDA_ERROR_LAUNCH_FAILED (719); ``c_launch_moves``:
    whether a launch that came from C (not through Python) moves the bytes (False: one-call starts go wrong);
    ``from_c``: the names of the calls that came from C, in order."""

    def __init__(self, current: int | None = PRIMARY):
        super().__init__(current)
        self.params = {0x51: [8, 4, 8, 8]}  # copy_rows: its table, its rows, Triton's two scratch pointers
        self.on_launch = _rows_on_launch
        self.refuse: str | None = None
        self.c_launch_moves = True
        self.from_python: list[str] = []  # the names of the calls made from Python, in order
        self.from_c: list[str] = []
        self.in_python, self.synced = 0, []
        self._fns = {name: ctypes.CFUNCTYPE(ctypes.c_int, *args)(self._adapter(name))
                     for name, args in _SIGNATURES.items()}
        side, fns, me = self.kept, self._fns, self
        self.kept = type("KeptC", (), {"__getattr__": lambda _, name: _FromPython(me, name, fns[name]) if name in fns
                                       else getattr(side, name)})()

    def _adapter(self, name: str):
        def call(*args):
            args = [0 if a is None else a for a in args]
            if not self.in_python:
                self.from_c.append(name)
            if self.refuse == name and not self.in_python:
                self.refuse = None
                return 719
            if name in _OUT:
                args[0] = _At(args[0])
            if name == "cuLaunchKernel":
                args[9] = [int(v or 0) for v in (_VP * len(self.params[args[0]])).from_address(args[9])]
                if not (self.c_launch_moves or self.in_python):
                    return self._launch_nothing(*args)
            return getattr(self, "do_" + name)(*args)
        return call

    def _launch_nothing(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        self.launches.append((function, (gx, gy, gz), (bx, by, bz), shared, stream, None))
        return 0

    def do_cuStreamSynchronize(self, stream):
        self.synced.append(stream)
        return 0


def _copy(kernel, drv: CStartDriver):
    """A warmed GpuCopy on the stand-ins with the driver's calls (the row kernel's launch kept: its parameters
    stated)."""
    from kvlc.runtime.ipc.copy import GpuCopy
    from testkit.gpu_standin import TorchStandIn

    kern = _Compiling(kernel)
    cp = GpuCopy(0, block_words=16, torch=TorchStandIn(), kernel=kern)
    cp.events = KeptEvents(0, lambda device: 0xE, lib=drv)
    cp.warm()
    return cp, kern


@pytest.fixture(scope="module")
def kernel(interpreted):
    from tests.runtime.test_ipc_kernel import _Kernel

    return _Kernel(interpreted)


@pytest.fixture(scope="module")
def one(kernel):
    drv = CStartDriver()
    cp, kern = _copy(kernel, drv)
    return cp, kern, drv


def _u(v) -> np.ndarray:
    return np.array(v, dtype=np.uint64)


def test_warm_up_keeps_the_one_call_start_where_it_copies_right(one):
    """table.c loaded and every function a C pointer: warm-up checked the start in one call by content and kept it;
    a start is then one C call (no driver call from Python): it records the engine's stream, makes the copy's
    stream wait for it, launches with the row table read in place from the pinned ring, records the copy's event
    after it; the rows land; the event says when the copy ended."""
    cp, kern, drv = one
    assert cp.one_call and cp.kept_launch and cp.direct and cp.events.one_call
    a = torch.arange(256, dtype=torch.uint8)
    b = torch.zeros(256, dtype=torch.uint8)
    calls, launches, direct, waits = len(drv.from_python), len(drv.launches), kern.direct, len(drv.waits)
    in_c = len(drv.from_c)
    launch = cp.start(_u([a.data_ptr(), a.data_ptr() + 100]), _u([b.data_ptr() + 8, b.data_ptr() + 200]),
                      _u([40, 17]))
    want = np.zeros(256, dtype=np.uint8)
    want[8:48], want[200:217] = np.arange(40), np.arange(100, 117)
    assert np.array_equal(b.numpy(), want)
    assert not _STARTS & set(drv.from_python[calls:]) and kern.direct == direct  # no ctypes call, not Triton's
    assert drv.from_c[in_c:] == ["cuCtxGetCurrent", "cuEventRecord", "cuStreamWaitEvent", "cuEventCreate",
                                 "cuLaunchKernel", "cuEventRecord"]  # in this order, the device's context current
    assert len(drv.launches) == launches + 1
    function, grid, _, _, stream, values = drv.launches[-1]
    assert (function, grid, stream) == (0x51, (2, 1, 1), cp.stream.cuda_stream)
    ring = cp.ring.host_addr
    assert ring <= values[0] < ring + 8 * cp.ring.words and values[1] == 2  # the table, in place in the ring
    assert drv.waits[waits:] == [(cp.stream.cuda_stream, cp.events._waited.handle)]
    assert drv.recorded[cp.events._waited.handle] == 0xE and drv.recorded[launch.event.handle] == cp.stream.cuda_stream
    drv.pending.add(launch.event.handle)
    assert not launch.done()
    drv.pending.clear()
    assert launch.done() and drv.stack == [PRIMARY]


@settings(deadline=None, max_examples=30)
@given(data=st.data())
def test_one_call_starts_land_what_the_cpu_copy_lands(one, data):
    """Random rows (disjoint destinations, any lengths and offsets, several kernel blocks long): a one-call start
    leaves the destination as the CPU's row copy does, nothing else written."""
    cp, _, drv = one
    size = 1 << 13
    n = data.draw(st.integers(1, 10))
    cuts = sorted(data.draw(st.lists(st.integers(0, size), min_size=2 * n, max_size=2 * n, unique=True)))
    dst, lens = cuts[0::2], [e - s for s, e in zip(cuts[0::2], cuts[1::2])]
    src = [data.draw(st.integers(0, size - ln)) for ln in lens]
    a = torch.randint(0, 256, (size,), dtype=torch.uint8)
    got, want = torch.zeros(size, dtype=torch.uint8), torch.zeros(size, dtype=torch.uint8)
    calls = len(drv.from_python)
    cp.start(_u(src) + np.uint64(a.data_ptr()), _u(dst) + np.uint64(got.data_ptr()), _u(lens))
    move_rows(_u(src) + np.uint64(a.data_ptr()), _u(dst) + np.uint64(want.data_ptr()), _u(lens))
    assert torch.equal(got, want) and not _STARTS & set(drv.from_python[calls:])


def test_a_thread_without_the_devices_context_gets_it_for_the_start_and_its_own_back(kernel):
    """table.c pushes the device's context where the calling thread has another one current, and pops it after."""
    drv = CStartDriver(current=0x2000)
    cp, _ = _copy(kernel, drv)
    assert cp.one_call
    a, b = torch.arange(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    in_c = len(drv.from_c)
    cp.start(_u([a.data_ptr()]), _u([b.data_ptr()]), _u([64]))
    assert torch.equal(a, b) and drv.stack == [0x2000]
    calls = drv.from_c[in_c:]
    assert calls[:2] == ["cuCtxGetCurrent", "cuCtxPushCurrent_v2"] and calls[-1] == "cuCtxPopCurrent_v2"


@pytest.mark.parametrize("name, step", [
    ("cuCtxGetCurrent", "make the device's context current"),
    ("cuEventRecord", "record an event on the engine's stream"),
    ("cuStreamWaitEvent", "make the copy's stream wait for the engine's"),
    ("cuEventCreate", "create the copy's event"),
    ("cuLaunchKernel", "launch the copy kernel"),
])
def test_a_step_the_driver_refuses_before_the_copy_is_named_and_nothing_lands(one, name, step):
    """A refusal before the launch (or of the launch): IpcError names the step and the driver's error, nothing was
    launched or landed, no new event is left behind (ended copies' events may go), the context stack is as it was;
    the next start works."""
    cp, _, drv = one
    a, b = torch.arange(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    launches, live = len(drv.launches), set(drv.live)
    drv.refuse = name
    with pytest.raises(IpcError, match=f"{step}; nothing was launched: CUDA_ERROR_LAUNCH_FAILED"):
        cp.start(_u([a.data_ptr()]), _u([b.data_ptr()]), _u([64]))
    assert not b.numpy().any() and len(drv.launches) == launches and drv.live <= live and drv.stack == [PRIMARY]
    cp.start(_u([a.data_ptr()]), _u([b.data_ptr()]), _u([64]))
    assert torch.equal(a, b)


def test_a_refused_record_after_the_launch_waits_for_the_copy_first(one):
    """The event after the launch cannot be recorded: the copy's stream is waited for before the error is raised
    (no byte lands after it is told), the event made for it destroyed, the error names the step."""
    cp, _, drv = one
    a, b = torch.arange(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    live, synced = set(drv.live), len(drv.synced)
    recorded = drv.do_cuEventRecord
    drv.do_cuEventRecord = lambda ev, stream: 719 if stream == cp.stream.cuda_stream else recorded(ev, stream)
    try:
        with pytest.raises(IpcError, match="record an event after the copy; the copy's stream was waited for"):
            cp.start(_u([a.data_ptr()]), _u([b.data_ptr()]), _u([64]))
    finally:
        drv.do_cuEventRecord = recorded
    assert drv.synced[synced:] == [cp.stream.cuda_stream] and drv.live <= live and drv.stack == [PRIMARY]


def test_warm_up_turns_the_one_call_start_off_where_it_copies_wrong(kernel):
    """Launches from table.c move nothing here: warm-up finds it by content, turns the one-call start off and keeps
    the launch through the driver from Python, whose copies are right."""
    drv = CStartDriver()
    drv.c_launch_moves = False
    cp, kern = _copy(kernel, drv)
    assert not cp.one_call and cp.kept_launch and cp.direct
    a, b = torch.arange(100, dtype=torch.uint8), torch.zeros(100, dtype=torch.uint8)
    launches, direct = len(drv.launches), kern.direct
    cp.start(_u([a.data_ptr()]), _u([b.data_ptr()]), _u([100]))
    assert torch.equal(a, b) and len(drv.launches) == launches + 1 and kern.direct == direct
