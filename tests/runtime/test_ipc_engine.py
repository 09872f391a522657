"""Long rows on a GPU's copy engines: ``GpuCopy.start_engine`` (a ``cuMemcpyAsync`` per row through the driver,
the GIL kept) and the same-host route's choice of it (``IpcRoute.on_engine``).

No GPU here: the driver is test_ipc_driver's stand-in with a ``cuMemcpyAsync`` that moves the bytes at once
(unified addressing on a CPU: every address is this process's), so every test checks content. The GPU suite's
mixed DRAM -> VRAM case and its handovers run the real driver on the lent GPU.
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlc.runtime.ipc.copy import CHUNK, ENGINE_FROM, move_rows, row_table
from kvlc.runtime.ipc.cuda import IpcError
from kvlc.runtime.ipc.driver import KeptEvents, TorchEvents
from kvlc.runtime.ipc.memory import Mapped, Window
from kvlc.runtime.ipc.route import IpcRoute, _Windows
from kvlc.runtime.nixl.core import XferState
from tests.runtime.test_ipc_driver import FakeDriver

torch = pytest.importorskip("torch")
pytest.importorskip("triton")


class CopyingDriver(FakeDriver):
    """The stand-in driver with ``cuMemcpyAsync``: each row moved when queued (recorded with its stream), the
    row ``refuse`` refused (CUDA_ERROR_INVALID_VALUE), or every row one byte short (``short``: a copy gone wrong)."""

    def __init__(self, refuse: int | None = None, short: bool = False):
        super().__init__()
        self.copies: list[tuple[int, int, int, int]] = []
        self.refuse, self.short = refuse, short

    def do_cuMemcpyAsync(self, dst, src, n, stream):
        self._in_primary()
        if len(self.copies) == self.refuse:
            self.refuse = None
            return 1
        self.copies.append((dst, src, n, stream))
        ctypes.memmove(dst, src, n - 1 if self.short and n else n)
        return 0


COPY_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p)


class CDriver(CopyingDriver):
    """The same, with ``cuMemcpyAsync`` a C function pointer (as libcuda's is): ``table.c``'s loop calls it."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.fn = COPY_FN(lambda d, s, n, stream: self.do_cuMemcpyAsync(d, s, n, stream or 0))
        side, fn = self.kept, self.fn
        self.kept = type("KeptC", (), {"__getattr__": lambda _, name: fn if name == "cuMemcpyAsync"
                                       else getattr(side, name)})()


@pytest.fixture(scope="module")
def kernel(interpreted):
    from tests.runtime.test_ipc_kernel import _Kernel

    return _Kernel(interpreted)


def _copy(kernel, drv=None, warm: bool = True):
    """A GpuCopy on the stand-ins (warmed: 4 s with the interpreted kernel), with the driver's calls (``drv``) or
    torch's (None)."""
    from kvlc.runtime.ipc.copy import GpuCopy
    from testkit.gpu_standin import TorchStandIn

    cp = GpuCopy(0, block_words=16, torch=TorchStandIn(), kernel=kernel)
    if drv is not None:
        cp.events = KeptEvents(0, lambda device: 0xE, lib=drv)
        cp.engine = True  # (a stand-in torch takes torch's events, and the engine off, when made)
    if warm:
        cp.warm()
    return cp


@pytest.fixture(scope="module")
def engine(kernel):
    """A warmed GpuCopy whose driver's copies land right (shared: each test reads the driver's records from its
    own start)."""
    drv = CopyingDriver()
    return _copy(kernel, drv), drv


@pytest.fixture(scope="module")
def engine_c(kernel):
    """A warmed GpuCopy whose rows are queued by table.c's loop (skipped where table.c is not built)."""
    from kvlc.runtime.ipc import native

    if native.library() is None:
        pytest.skip(f"table.c: {native.status()}")
    drv = CDriver()
    return _copy(kernel, drv), drv


@pytest.fixture(scope="module")
def broken(kernel):
    """A warmed GpuCopy whose driver's copies land one byte short: warm-up turned its engine off."""
    return _copy(kernel, CopyingDriver(short=True))


def _table(src: list[int], dst: list[int], lens: list[int]):
    u = lambda v: np.array(v, dtype=np.uint64)  # noqa: E731
    return row_table(u(src), u(dst), u(lens), chunk=1 << 62)


def test_long_rows_go_one_call_each_after_the_callers_stream_with_the_gil_kept(engine):
    """Each row is one cuMemcpyAsync on the copy's stream (a row longer than the kernel's piece is not cut), queued
    after the wait on the caller's stream and before the event that says when they all ended; every call keeps the
    GIL; the bytes land and nothing else changes."""
    cp, drv = engine
    assert cp.engine and isinstance(cp.events, KeptEvents)
    a = torch.randint(0, 256, (4 * CHUNK,), dtype=torch.uint8)
    b = torch.zeros(4 * CHUNK, dtype=torch.uint8)
    pa, pb = a.data_ptr(), b.data_ptr()
    rows = [(0, 2 * CHUNK, CHUNK + 5), (CHUNK + 8, 8, 1000), (2 * CHUNK + 16, CHUNK, 4096)]  # (src, dst, len)
    before, copies = len(drv.calls), len(drv.copies)
    launch = cp.start_engine(_table([pa + s for s, _, _ in rows], [pb + d for _, d, _ in rows], [n for *_, n in rows]))
    assert drv.copies[copies:] == [(pb + d, pa + s, n, cp.stream.cuda_stream) for s, d, n in rows]
    want = np.zeros(4 * CHUNK, dtype=np.uint8)
    for s, d, n in rows:
        want[d:d + n] = a.numpy()[s:s + n]
    assert np.array_equal(b.numpy(), want)
    names = [name for name, kept, _ in drv.calls[before:]]
    assert all(kept for _, kept, _ in drv.calls[before:])
    waited = names.index("cuStreamWaitEvent")
    first = names.index("cuMemcpyAsync")
    last = len(names) - 1 - names[::-1].index("cuMemcpyAsync")
    after = len(names) - 1 - names[::-1].index("cuEventRecord")
    assert waited < first and last < after and names.count("cuMemcpyAsync") == len(rows)
    assert drv.recorded[launch.event.handle] == cp.stream.cuda_stream
    drv.pending.add(launch.event.handle)
    assert not launch.done()
    drv.pending.clear()
    assert launch.done()


def _lands_as_the_cpu_copy(cp, drv, src: list[int], dst: list[int], lens: list[int], size: int) -> None:
    """Rows (offsets into a random source and a zeroed destination of ``size`` bytes) copied by ``cp.start_engine``
    leave the destination as the CPU's row copy (``move_rows``) does; one call per row, in order, on the copy's
    stream."""
    a = torch.randint(0, 256, (size,), dtype=torch.uint8)
    got, want = torch.zeros(size, dtype=torch.uint8), torch.zeros(size, dtype=torch.uint8)
    u = lambda base, v: np.array(v, dtype=np.uint64) + np.uint64(base)  # noqa: E731
    before = len(drv.copies)
    cp.start_engine(_table(list(u(a.data_ptr(), src)), list(u(got.data_ptr(), dst)), lens))
    move_rows(u(a.data_ptr(), src), u(want.data_ptr(), dst), np.array(lens, dtype=np.uint64))
    assert torch.equal(got, want)
    assert [(d, s_, ln) for d, s_, ln, _ in drv.copies[before:]] == [
        (got.data_ptr() + d, a.data_ptr() + s_, ln) for s_, d, ln in zip(src, dst, lens)]
    assert {st for *_, st in drv.copies[before:]} == {cp.stream.cuda_stream}


def _random_rows(cuts: list[int], src_at) -> tuple[list[int], list[int], list[int]]:
    """(sources, destinations, lengths): disjoint destinations between sorted ``cuts``, each source ``src_at(len)``."""
    dst, lens = cuts[0::2], [e - s for s, e in zip(cuts[0::2], cuts[1::2])]
    return [src_at(ln) for ln in lens], dst, lens


@settings(deadline=None, max_examples=40)
@given(data=st.data())
def test_the_engine_lands_what_the_cpu_copy_lands(engine, data):
    """Random rows (disjoint destinations, any lengths and offsets): the engine's copy leaves the destination as
    the CPU's row copy (``move_rows``) does."""
    size = 1 << 14
    n = data.draw(st.integers(1, 12))
    cuts = sorted(data.draw(st.lists(st.integers(0, size), min_size=2 * n, max_size=2 * n, unique=True)))
    _lands_as_the_cpu_copy(*engine, *_random_rows(cuts, lambda ln: data.draw(st.integers(0, size - ln))), size)


def test_table_cs_loop_queues_the_same_rows_as_the_python_loop(engine_c):
    """With the driver's function a C pointer and table.c loaded, the rows are queued by table.c's loop (warm-up
    checked it by content): random tables land what the CPU's row copy lands, one call per row in order on the
    copy's stream; a refused row is named after the rows before it landed."""
    import random

    cp, drv = engine_c
    assert cp.engine and cp.events._queue_fn == ctypes.cast(drv.fn, ctypes.c_void_p).value
    rng = random.Random(7)
    size = 1 << 13
    for _ in range(20):
        n = rng.randint(1, 10)
        cuts = sorted(rng.sample(range(size + 1), 2 * n))
        _lands_as_the_cpu_copy(cp, drv, *_random_rows(cuts, lambda ln: rng.randint(0, size - ln)), size)
    a = torch.arange(64, dtype=torch.uint8)
    b = torch.zeros(64, dtype=torch.uint8)
    drv.refuse = len(drv.copies) + 2
    with pytest.raises(IpcError, match=r"row 2 \(8 bytes.*the 2 rows before it were copied"):
        cp.start_engine(_table([a.data_ptr() + 8 * i for i in range(4)], [b.data_ptr() + 8 * i for i in range(4)],
                               [8] * 4))
    assert b.numpy()[:16].tolist() == list(range(16)) and not b.numpy()[16:].any()


def test_a_row_the_driver_refuses_is_named_after_the_rows_before_it_ended(engine):
    """The driver refuses the second row: the first was queued and is waited for (nothing lands after the error is
    told), the error names the row; the third is never queued."""
    cp, drv = engine
    a = torch.arange(64, dtype=torch.uint8)
    b = torch.zeros(64, dtype=torch.uint8)
    drv.refuse = len(drv.copies) + 1
    before = len(drv.calls)
    with pytest.raises(IpcError, match=r"row 1 \(8 bytes.*the 1 rows before it were copied"):
        cp.start_engine(_table([a.data_ptr(), a.data_ptr() + 8, a.data_ptr() + 16],
                               [b.data_ptr(), b.data_ptr() + 8, b.data_ptr() + 16], [8, 8, 8]))
    assert b.numpy()[:8].tolist() == list(range(8)) and not b.numpy()[8:].any()
    names = [name for name, _, _ in drv.calls[before:]]
    assert names.count("cuMemcpyAsync") == 2 and names.index("cuEventSynchronize") > names.index("cuMemcpyAsync")


def test_warm_up_turns_the_engine_off_where_its_copies_are_wrong_or_its_calls_are_torchs(kernel, broken):
    """A driver whose copies land wrong: warm-up turns the engine off (rows then go through the kernel, which
    copies right); torch's calls: no engine."""
    assert not broken.engine and isinstance(broken.events, KeptEvents)
    with pytest.raises(IpcError, match="copy engine's path is off here"):
        broken.start_engine(_table([0], [0], [1]))
    a = torch.arange(64, dtype=torch.uint8)
    b = torch.zeros(64, dtype=torch.uint8)
    broken.start_rows(_table([a.data_ptr()], [b.data_ptr() + 8], [40]))
    assert b.numpy()[8:48].tolist() == list(range(40)) and not b.numpy()[:8].any() and not b.numpy()[48:].any()
    torch_calls = _copy(kernel, warm=False)
    assert isinstance(torch_calls.events, TorchEvents) and not torch_calls.engine


# ---------------------------------------------------------------------------------------------- the route's choice
PEER = 5 << 40  # the peer's addresses of its VRAM storage (mapped here onto a CPU buffer)


def _route(cp, peer_buf, copy_engine: bool = True, min_rows: int = 64) -> IpcRoute:
    """A route on GPU 0 with this side's DRAM pinned and mapped (as allocate(pin=True) gives), a GpuCopy on the
    stand-ins, and one peer whose VRAM storage is ``peer_buf``."""
    local = {"kv": SimpleNamespace(device=0, mem="VRAM", addr=0, nbytes=0)}
    route = IpcRoute(SimpleNamespace(initialize=lambda *a, **k: "nixl"), local, min_rows, copy_engine=copy_engine)
    route._gpu_copy = cp
    route._dram_reach = True
    route.peers["peer"] = _Windows(Mapped("peer", [Window("kv", "VRAM", PEER, peer_buf.numel(),
                                                          peer_buf.data_ptr(), 0)]))
    return route


def _rows(addrs, lens) -> np.ndarray:
    return np.array([[a, n, 0] for a, n in zip(addrs, lens)], dtype=np.uint64)


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_host_rows_averaging_a_piece_go_on_the_engine_and_land(engine, op):
    """DRAM here and the peer's VRAM, rows averaging ENGINE_FROM bytes or more (one short, one long): the part goes
    on the copy engine, a call per row, uncut; pushed (WRITE) or pulled (READ), every byte lands and nothing else
    changes."""
    cp, drv = engine
    mine = torch.randint(0, 256, (3 * ENGINE_FROM,), dtype=torch.uint8)
    theirs = torch.randint(0, 256, (4 * ENGINE_FROM,), dtype=torch.uint8)
    src0, dst0 = (mine.clone(), theirs.clone())
    route = _route(cp, theirs)
    lens = [ENGINE_FROM // 2, ENGINE_FROM * 3 // 2 + 16]
    local = _rows([mine.data_ptr(), mine.data_ptr() + ENGINE_FROM], lens)
    remote = _rows([PEER + 3 * ENGINE_FROM, PEER + 8], lens)
    assert route.on_engine("DRAM", "VRAM", local)
    x = route.initialize(op, local, "DRAM", remote, "VRAM", "peer")
    assert x.engine and x.rows.rows == 2  # (not cut at the kernel's piece)
    copies = len(drv.copies)
    assert route.post(x) is XferState.DONE and route.engine_copies == 1 and len(drv.copies) == copies + 2
    x.release()
    a, b = (src0.numpy(), theirs.numpy()) if op == "WRITE" else (dst0.numpy(), mine.numpy())
    want = (dst0 if op == "WRITE" else src0).numpy().copy()
    pairs = [(0, 3 * ENGINE_FROM), (ENGINE_FROM, 8)]  # (mine, theirs) offsets of each row
    for (m, t), n in zip(pairs, lens):
        s, d = (m, t) if op == "WRITE" else (t, m)
        want[d:d + n] = a[s:s + n]
    assert np.array_equal(b, want)
    untouched = mine if op == "WRITE" else theirs
    assert torch.equal(untouched, src0 if op == "WRITE" else dst0)


def test_the_route_chooses_the_engine_for_long_host_rows_only(engine, broken):
    """Host rows averaging under ENGINE_FROM bytes: the kernel; VRAM on both sides: never the engine (few rows
    still go through NIXL, many by the kernel); with the engine off (the setting, or warm-up finding it wrong)
    long host rows go through the kernel."""
    theirs = torch.zeros(1 << 20, dtype=torch.uint8)
    route = _route(engine[0], theirs)
    short = _rows([0, 4096], [ENGINE_FROM // 2, ENGINE_FROM // 2 - 16])
    long = _rows([0], [ENGINE_FROM])
    assert not route.on_engine("DRAM", "VRAM", short)
    assert route.on_engine("DRAM", "VRAM", long) and route.on_engine("VRAM", "DRAM", long)
    assert not route.on_engine("VRAM", "VRAM", _rows(range(3), [1 << 20] * 3))
    assert not route.on_engine("DRAM", "DRAM", long)
    assert not route.copies_part("peer", "VRAM", "VRAM", 63)
    x = route.initialize("WRITE", _rows([0], [64]), "VRAM", _rows([PEER], [64]), "VRAM", "peer")
    assert x == "nixl"
    x = route.initialize("WRITE", short, "DRAM", _rows([PEER, PEER + 8192], [ENGINE_FROM // 2, 64]), "VRAM", "peer")
    assert not x.engine and x.rows.rows == 2
    x.release()
    for off in (_route(engine[0], theirs, copy_engine=False), _route(broken, theirs)):
        assert not off.on_engine("DRAM", "VRAM", long)
        x = off.initialize("WRITE", long, "DRAM", _rows([PEER], [ENGINE_FROM]), "VRAM", "peer")
        assert not x.engine and x.rows.rows == 1  # (the kernel's piece: ENGINE_FROM is CHUNK)
        x.release()


def test_the_agents_setting_reaches_the_route(monkeypatch):
    """``AgentSettings.ipc_copy_engine`` (``KVLC_IPC_COPY_ENGINE``) is on by default and reaches the agent's route."""
    pytest.importorskip("nixl")
    from runtime_engines import TEST_LAYOUTS

    from kvlc import compile_spec
    from kvlc.runtime import KvAgent, allocate
    from kvlc.runtime.settings import AgentSettings

    assert AgentSettings(insecure=True).ipc_copy_engine is True
    monkeypatch.setenv("KVLC_IPC_COPY_ENGINE", "false")
    assert AgentSettings(insecure=True).ipc_copy_engine is False
    plan = compile_spec(TEST_LAYOUTS / "dense-tp1.yaml")
    for on in (True, False):
        with KvAgent(plan, 0, allocate(plan), AgentSettings(insecure=True, ipc_copy_engine=on)) as a:
            assert a.route.copy_engine is on
