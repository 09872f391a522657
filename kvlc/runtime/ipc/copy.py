"""Running one part's rows as copies between this process's memory and a peer's mapped memory.

The rows arrive as three arrays, source address, destination address and length (the
descriptors :func:`kvlc.compiler.request.instantiate.instantiate` built, the peer's side already
moved into its mapped window): no layout arithmetic here.

* GPU (:class:`GpuCopy`): rows longer than :data:`CHUNK` are cut, the table is written into a pinned
  ring that the kernel reads in place (uploaded first where warm-up found that it cannot), and ONE
  Triton kernel (:mod:`kvlc.runtime.ipc.kernel`) moves every row, one program per row, on a stream of
  its own; an event recorded after it says when every byte landed.
* GPU, long rows (:meth:`GpuCopy.start_engine`): one ``cuMemcpyAsync`` per row on the same stream, which the
  GPU's copy engines move (the route's choice for parts whose rows average :data:`ENGINE_FROM` bytes or more:
  across PCIe the copy engine reads pinned host memory at the pinned copy's rate, where the kernel's
  loads fall short of it); the same event after them.
* CPU (:class:`HostCopy`): the same rows, one ``memmove`` each, synchronously (every row checked
  against the regions first). Triton's interpreter runs the GPU kernel itself on the CPU in the tests.
"""

from __future__ import annotations

import ctypes
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvlc.clib import address, libc
from kvlc.runtime.ipc import native
from kvlc.runtime.ipc.cuda import IpcError
from kvlc.runtime.ipc.driver import DEFAULT_GPU_CALLS, GPU_CALLS, GpuCalls, KeptEvents, KeptLaunch, TorchEvents
from kvlc.runtime.staging.copy import Regions

log = logging.getLogger(__name__)

CHUNK = 256 << 10  # bytes one kernel program moves at most (long rows are cut so every SM gets work)
BLOCK_WORDS = 1024  # 8-byte words one program moves per step
NUM_WARPS = 4
ENGINE_FROM = 256 << 10  # rows averaging this many bytes or more may go on the copy engine, one call each
#                          (a call costs the host a few µs: shorter rows would wait for their calls)


def split(src: np.ndarray, dst: np.ndarray, lens: np.ndarray, chunk: int = CHUNK
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows cut into pieces of at most ``chunk`` bytes, in order (``chunk`` a multiple of 16)."""
    if not len(lens) or int(lens.max()) <= chunk:  # no row to cut (the usual case: blocks of up to 256 KiB)
        return src, dst, lens
    n = ((lens + np.uint64(chunk - 1)) // np.uint64(chunk)).astype(np.int64)
    which = np.repeat(np.arange(len(lens)), n)
    k = np.arange(len(which), dtype=np.uint64) - np.repeat(np.cumsum(n) - n, n).astype(np.uint64)
    off = k * np.uint64(chunk)
    return src[which] + off, dst[which] + off, np.minimum(lens[which] - off, np.uint64(chunk))


@dataclass(frozen=True)
class Rows:
    """One launch of :func:`kvlc.runtime.ipc.kernel.copy_rows`: its row table and constants."""

    table: np.ndarray  # int64: sources, destinations, lengths in bytes (``rows`` of each)
    rows: int          # programs: one per row after cutting rows at ``chunk`` bytes
    wide: bool         # every address and length a multiple of 8: 8-byte words (else bytes)
    vec: bool          # ... and of 16


def row_table(src: np.ndarray, dst: np.ndarray, lens: np.ndarray, chunk: int = CHUNK) -> Rows:
    """The launch that copies rows ``(src, dst, lens)`` (uint64 arrays): rows cut at ``chunk`` bytes."""
    src, dst, lens = split(src, dst, lens, chunk)
    table = np.concatenate([src, dst, lens])
    low = int(np.bitwise_or.reduce(table)) & 15 if len(table) else 0
    return launch_rows(table.view(np.int64), low)


def launch_rows(table: np.ndarray, low: int) -> Rows:
    """The launch of a built table (int64: sources, destinations, lengths; ``low``: the OR of its words'
    low four bits)."""
    return Rows(table, len(table) // 3, not low & 7, not low)


ENTRY = 10  # int64s per entry of a block launch: local base, stride; peer base (mapped), stride; length; id slot;
#             kernel blocks per tile and the run's block on each side (local, then the peer's)


@dataclass(frozen=True, eq=False)
class BlockLaunch:
    """One launch of :func:`kvlc.runtime.ipc.kernel.copy_blocks`: a part in block form
    (:class:`kvlc.compiler.request.blocks.BlockCopy`), the peer's bases moved into its mapped window."""

    entries: np.ndarray  # int64, ENTRY per entry (fixed per table and peer: uploaded once)
    ids: np.ndarray      # int64: the request's slots and ids (BlockCopy.ids)
    count: int           # the most ids of a slot (the grid's first axis)
    pieces: int          # CHUNK-byte pieces of the longest row (its third)
    write: bool          # the local rows are the sources
    wide: bool           # every base, stride and length a multiple of 8
    vec: bool            # ... and of 16
    kept: dict = field(default_factory=dict)  # device -> the entries there (shared by the launches of one table)


@dataclass
class Launch:
    """A copy in flight: ``done()`` once every byte landed."""

    event: Any = None
    keep: tuple = ()  # what the copy reads until it ends (the row table)

    def done(self) -> bool:
        return self.event is None or bool(self.event.query())


class _Span:
    """Words of the pinned ring that a kernel reads in place: their address, which the driver's launch passes
    (:meth:`data_ptr`), and the tensor over them, made only where Triton's launcher takes the table (a torch
    slice per request cost more than the copy of its words into the ring)."""

    __slots__ = ("addr", "ring", "at", "n")

    def __init__(self, ring: "_Ring", at: int, n: int):
        self.addr, self.ring, self.at, self.n = ring.host_addr + 8 * at, ring, at, n

    def data_ptr(self) -> int:
        return self.addr

    def tensor(self):
        return self.ring.host[self.at:self.at + self.n]


class _Ring:
    """A pinned host buffer and a device buffer of int64 row tables, handed out in order and taken
    back once the copy that read a span ended (its event): no allocation per request. Spans start
    at even words (16 bytes), as the compiled kernel assumes of its table."""

    def __init__(self, torch, device: int, words: int):
        self.host = torch.empty(words, dtype=torch.int64, pin_memory=True)
        self.host_np = self.host.numpy()
        self.host_addr = address(self.host_np)
        self.dev = torch.empty(words, dtype=torch.int64, device=f"cuda:{device}")
        self.words, self.head = words, 0
        self.spans: deque = deque()  # [start, stop, event] in use, oldest first

    def take(self, n: int) -> int | None:
        """Where ``n`` words may be written now (None: the table is larger than the ring)."""
        if n > self.words:
            return None
        at = self.head if self.head + n <= self.words else 0
        spans = self.spans
        while spans and spans[0][2].query():  # ended copies give their spans back, oldest first
            spans.popleft()
        while spans and any(s < at + n and at < e for s, e, _ in spans):
            spans.popleft()[2].synchronize()  # the oldest copy still reading there: wait (rare)
        return at

    def used(self, at: int, n: int, event) -> None:
        self.spans.append((at, at + n, event))
        self.head = at + n + (n & 1)


class GpuCopy:
    """Copies rows on GPU ``device`` with one kernel launch per part, after the work queued on the
    calling thread's current stream (what the engine wrote before asking is what gets copied).

    The compiled kernel of each variant is kept and launched directly (Triton's launcher without its
    per-call argument binding); :meth:`warm` checks that path by content and falls back to Triton's
    ordinary call where it does not hold. ``calls``: ``"torch"`` orders and launches through torch's events and
    Triton's launcher; ``"driver"`` through the CUDA driver with the GIL kept (:mod:`kvlc.runtime.ipc.driver`),
    where warm-up finds them right (``AgentSettings.ipc_gpu_calls``)."""

    RING_WORDS = 1 << 20  # 8 MiB of row tables (~350,000 rows) in flight at most before waiting

    def __init__(self, device: int, block_words: int = BLOCK_WORDS, num_warps: int = NUM_WARPS, *,
                 torch: Any = None, kernel: Any = None, calls: GpuCalls = DEFAULT_GPU_CALLS):
        if calls not in GPU_CALLS:
            raise ValueError(f"GpuCopy: calls must be one of {', '.join(GPU_CALLS)}; got {calls!r}")
        stand_in = torch is not None  # (the tests pass stand-ins for torch.cuda and Triton's interpreted kernel)
        if torch is None:
            import torch
        if kernel is None:
            from kvlc.runtime.ipc import kernel  # Triton: only where a GPU copies

        self.torch, self.kernel, self.device = torch, kernel, device
        self.stream = torch.cuda.Stream(device=device)
        self.block_words, self.num_warps = block_words, num_warps
        self.ring = _Ring(torch, device, self.RING_WORDS)
        self.vec = True  # 16-byte hints (off where this Triton cannot compile them: see warm)
        self.host_table = True  # the kernel reads the row table in the pinned ring (off where that fails: see warm)
        self._caller: tuple = (None, None)  # (raw handle, Stream) of the caller's stream last seen
        self.events = self._events(calls == "driver" and not stand_in)  # the ordering calls (see warm)
        self.direct = True  # launch the kept compiled kernels directly (off where warm finds that wrong)
        self._compiled: dict[tuple, Any] = {}
        self.kept_launch = True  # the direct launch through the driver with the GIL kept, where it applies (see warm)
        self._kept: dict[tuple, KeptLaunch | None] = {}
        self.one_call = True  # a kept launch's whole start in one C call, where it applies (see warm)
        self.blocks = True  # parts in block form copy by their ids (off where warm finds that wrong)
        self.engine = self.events.kept_gil  # long rows may go on the copy engine: the driver's calls (see warm)

    def _events(self, driver: bool) -> TorchEvents | KeptEvents:
        """With ``driver``, the CUDA driver's event calls with the GIL kept (:mod:`kvlc.runtime.ipc.driver`) where
        the driver and torch's raw stream handle can be reached; else torch's."""
        raw = getattr(self.torch._C, "_cuda_getCurrentRawStream", None)
        if driver and raw is not None:
            try:
                return KeptEvents(self.device, raw)
            except (IpcError, OSError, AttributeError) as exc:
                log.warning("CUDA events through torch (they let the GIL go): the driver's cannot be used here: %s",
                            exc)
        return TorchEvents(self.torch, self._caller_stream)

    def start(self, src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> Launch:
        """Copy rows ``(src, dst, lens)`` (uint64 arrays): :meth:`start_rows` of their :func:`row_table`."""
        return self.start_rows(row_table(src, dst, lens))

    def start_rows(self, g: Rows) -> Launch:
        """Launch the copy of a built row table (:func:`row_table`, or the route's native builder)."""
        block = self.block_words if g.wide else 8 * self.block_words
        consts = {"BLOCK": block, "WIDE": g.wide, "VEC": self.vec and g.vec}
        return self._start(g.table, "copy_rows", (g.rows, 1, 1), lambda table: (table, g.rows), consts)

    def start_blocks(self, b: "BlockLaunch") -> Launch:
        """Launch the copy of a part in block form (:class:`BlockLaunch`): only its ids go up; the entries went
        once per table and peer (kept here)."""
        entries = self._entries(b)
        block = self.block_words if b.wide else 8 * self.block_words
        consts = {"CHUNK": CHUNK, "BLOCK": block, "WIDE": b.wide, "VEC": self.vec and b.vec}
        grid = (b.count, len(b.entries) // ENTRY, b.pieces)
        return self._start(b.ids, "copy_blocks", grid, lambda ids: (entries, ids, int(b.write)), consts, (entries,))

    def start_engine(self, g: Rows) -> Launch:
        """Copy a built row table's rows on the GPU's copy engines: one ``cuMemcpyAsync`` per row (the table uncut:
        each row one call) on our stream after the caller's queued work, the GIL kept; only where :attr:`engine`
        (the driver's calls, checked by warm-up). Where the driver refuses a row, the rows before it are waited
        for and :class:`~kvlc.runtime.ipc.cuda.IpcError` says which."""
        if not self.engine:
            raise IpcError("the copy engine's path is off here (torch's calls, or warm-up found it wrong): "
                           "the rows go through the kernel (start_rows)")
        self.events.after_caller(self.stream)
        self.events.copy_rows(g.table, g.rows, self.stream.cuda_stream)
        return Launch(self.events.recorded(self.stream))

    def _start(self, words: np.ndarray, name: str, grid: tuple, args: Callable[[Any], tuple], consts: dict,
               keep: tuple = ()) -> Launch:
        """After the caller's queued work: ``words`` into the ring (or up), kernel ``name`` launched on our stream
        with ``args(table)`` (``table``: where the kernel reads ``words``), an event after it. In one C call where
        the kernel's launch through the driver is kept and the words fit the ring (:meth:`KeptLaunch.start`)."""
        one = self._one_call(name, consts)
        at = self.ring.take(len(words)) if one is not None else None
        if at is not None:
            span = _Span(self.ring, at, len(words))
            words = np.ascontiguousarray(words, dtype=np.int64)
            ev = one.start(grid, _ints(args(span)), self.stream.cuda_stream, span.addr, words)
            self.ring.used(at, len(words), ev)
            return Launch(ev, (span,) + keep)
        self.events.after_caller(self.stream)  # what the engine queued before asking
        at, table, kept = self._upload(words)
        self._go(name, grid, args(table), consts)
        ev = self.events.recorded(self.stream)
        if at is not None:
            self.ring.used(at, len(words), ev)
        return Launch(ev, kept + (table,) + keep)

    def _entries(self, b: "BlockLaunch"):
        """A block launch's entries on the device: uploaded on first use, kept in :attr:`BlockLaunch.kept` (which the
        launches of one table and peer share: the route's cache, dropped with the peer)."""
        got = b.kept.get(self.device)
        if got is None:
            torch = self.torch
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):  # ordered before the launch
                got = torch.empty(len(b.entries), dtype=torch.int64, device=f"cuda:{self.device}")
                got.copy_(torch.from_numpy(np.ascontiguousarray(b.entries, dtype=np.int64)))
            b.kept[self.device] = got
        return got

    def _caller_stream(self):
        """The calling thread's current stream on this device: the Stream object is kept while the stream
        stays the same (building one cost more than the event record itself on an H100 host)."""
        torch = self.torch
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is None:
            return torch.cuda.current_stream(self.device)
        handle = raw(self.device)
        if handle != self._caller[0]:
            self._caller = (handle, torch.cuda.current_stream(self.device))
        return self._caller[1]

    def _go(self, name: str, grid: tuple, args: tuple, consts: dict) -> None:
        """Launch kernel ``name`` on our stream: its kept compiled form directly where there is one (constants
        passed in order after the arguments), else through Triton's call, whose compiled kernel is kept."""
        torch = self.torch
        key = self._key(name, consts)
        compiled = self._compiled.get(key) if self.direct else None
        kept = self._kept_launch(key, compiled, args) if compiled is not None else None
        if kept is not None:  # the driver's launch, the GIL kept
            kept.launch(grid, _ints(args), self.stream.cuda_stream)
            return
        args = tuple(a.tensor() if isinstance(a, _Span) else a for a in args)  # Triton's launchers take tensors
        if compiled is not None and torch.cuda.current_device() == self.device:
            compiled[grid](*args, *consts.values(), stream=self.stream.cuda_stream)  # no context to enter
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            if compiled is not None:
                compiled[grid](*args, *consts.values(), stream=self.stream.cuda_stream)
                return
            k = getattr(self.kernel, name)[grid](*args, **consts, num_warps=self.num_warps)
        if k is not None and hasattr(k, "__getitem__"):
            self._compiled[key] = k

    def _key(self, name: str, consts: dict) -> tuple:
        return (name, *consts.values(), self.num_warps)

    @property
    def one_call_on(self) -> bool:
        """Whether a kept launch's start may go in one C call: :attr:`one_call` on, the driver's calls able to
        (``table.c`` loaded) and the launch through the driver kept."""
        return self.one_call and self.events.one_call and self.kept_launch

    def _one_call(self, name: str, consts: dict) -> KeptLaunch | None:
        """The kept launch of kernel ``name`` whose whole start goes in one C call (:meth:`KeptEvents.start`): where
        :attr:`one_call_on`, the kernel was launched directly through the driver before (its :class:`KeptLaunch`
        made) and its table is read in place; else None."""
        if not (self.one_call_on and self.direct and self.host_table):
            return None
        return self._kept.get(self._key(name, consts))

    def _kept_launch(self, key: tuple, compiled: Any, args: tuple) -> KeptLaunch | None:
        """The kept compiled kernel's launch through the driver with the GIL kept (:class:`KeptLaunch`), made at its
        first direct launch; None where the events are torch's, :attr:`kept_launch` is off or it does not apply."""
        if not (self.kept_launch and self.events.kept_gil):
            return None
        if key not in self._kept:
            sizes = tuple(8 if hasattr(a, "data_ptr") else 4 for a in args)
            self._kept[key] = KeptLaunch.of(self.events, compiled, sizes)
        return self._kept[key]

    def _upload(self, rows: np.ndarray):
        """(ring offset or None, the table the kernel reads, what the copy keeps alive).

        With :attr:`host_table` the kernel reads the table where it was written, in the pinned ring
        (unified addressing: no copy to the device, no call on the stream); else it goes up to the
        device ring on the copy stream first."""
        torch = self.torch
        at = self.ring.take(len(rows))
        if at is None:  # larger than the ring: a table of its own
            host = torch.empty(len(rows), dtype=torch.int64, pin_memory=True)
            host.numpy()[:] = rows
            if self.host_table:
                return None, host, (host,)
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                return None, host.to(f"cuda:{self.device}", non_blocking=True), (host,)
        rows = np.ascontiguousarray(rows, dtype=np.int64)  # (numpy's copy of a large table lets the GIL go)
        libc.memmove(self.ring.host_addr + 8 * at, address(rows), 8 * len(rows))
        if self.host_table:
            return at, _Span(self.ring, at, len(rows)), ()
        table = self.ring.dev[at:at + len(rows)]
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            table.copy_(self.ring.host[at:at + len(rows)], non_blocking=True)
        return at, table, ()

    def warm(self) -> None:
        """Compile the kernel's variants now (16-byte, 8-byte and byte rows, short and cut ones) on
        a scratch buffer of its own, not at the first request. Every copy is checked by content: first
        through Triton's call (which compiles), then through the direct launch. Each optimisation is
        dropped where its copies are not right here, in this order: the table read in place from
        pinned host memory, the 16-byte hints, the direct launch. The driver's event calls are tried first: where
        they fail here, torch's are used."""
        torch = self.torch
        self._warm_events()
        n = 4 * CHUNK
        scratch = torch.zeros(2 * n, dtype=torch.uint8, device=f"cuda:{self.device}")
        pattern = torch.arange(n, dtype=torch.int64, device=scratch.device).remainder_(251).to(torch.uint8)
        lengths = (16, 8, 3, 8 * self.block_words + 16, CHUNK + 24)
        direct, self.direct = self.direct, False
        tried = [(h, v) for v in (self.vec, False) for h in (self.host_table, False)]  # host table dropped first
        for i, (self.host_table, self.vec) in enumerate(dict.fromkeys(tried)):
            try:
                for length in lengths:
                    self._warm_one(scratch, pattern, length)
                break
            except Exception:  # noqa: BLE001 - each is an optimisation: without it the copy is the same
                if i == len(dict.fromkeys(tried)) - 1:
                    raise
                self._compiled.clear()
                log.warning("the copy kernel does not copy right with the table in pinned host memory=%s and "
                            "16-byte hints=%s here; trying without", self.host_table, self.vec, exc_info=True)
        self.direct = direct
        if direct and not self._through_direct(lambda: [self._warm_one(scratch, pattern, n) for n in lengths]):
            self.direct = False
            log.warning("the copy kernel's direct launch does not copy right here; Triton's call it is")
        self._warm_blocks(scratch, pattern)
        self._warm_engine(scratch, pattern)

    def _warm_engine(self, scratch, pattern) -> None:
        """Check the copy engine's path by content (pinned host memory to the GPU and back, a long row and a short
        one, odd lengths and offsets); where it does not copy right here, long rows go through the kernel."""
        if not self.engine:
            return
        torch, n = self.torch, len(pattern)
        host = torch.empty(2 * n, dtype=torch.uint8, pin_memory=True)
        base, dev = host.data_ptr(), scratch.data_ptr()
        rows = ((0, n - 40), (n - 37, 29))  # (offset, length): the first ends where the second starts, less 3
        try:
            host[:n].copy_(pattern.cpu())
            host[n:].zero_()
            scratch.zero_()
            for src, dst in ((base, dev), (dev, base + n)):  # up, then back down
                table = np.array([[src + o for o, _ in rows], [dst + o for o, _ in rows], [ln for _, ln in rows]],
                                 dtype=np.uint64).reshape(-1)
                self.start_engine(launch_rows(table.view(np.int64), 1)).event.synchronize()
            want = np.zeros(n, dtype=np.uint8)
            pat = pattern.cpu().numpy()
            for o, ln in rows:
                want[o:o + ln] = pat[o:o + ln]
            if not np.array_equal(host[n:].numpy(), want):
                raise RuntimeError("the copy engine's rows landed wrong")
        except Exception:  # noqa: BLE001 - an optimisation: the kernel copies the same rows
            self.engine = False
            log.warning("the copy engine's path does not copy right here; long rows go through the kernel",
                        exc_info=True)

    def _through_direct(self, check) -> bool:
        """Whether ``check()`` passes through the direct launch: the driver's with the GIL kept where it applies, its
        whole start in one C call where that applies too (``check()`` runs twice then: the first makes the kept
        launches, the second starts them in one call); where one fails, :attr:`one_call` goes off, then
        :attr:`kept_launch`, and ``check()`` runs again; else Triton's launcher."""
        for _ in range(3):
            one_call = self.one_call_on
            try:
                check()
                if one_call and self._any_kept():
                    check()  # the kept launches made by the pass above now start in one C call
                return True
            except Exception:  # noqa: BLE001 - each is an optimisation: Triton's call copies the same
                if one_call and self._any_kept():
                    self.one_call = False
                    log.warning("a copy's start in one C call does not copy right here; its calls are made one by "
                                "one", exc_info=True)
                    continue
                if not (self.kept_launch and self._any_kept()):
                    log.warning("a copy through the direct launch was wrong here", exc_info=True)
                    return False
                self.kept_launch = False
                log.warning("the copy kernel's launch through the driver does not copy right here; Triton's "
                            "launcher it is", exc_info=True)
        return False

    def _any_kept(self) -> bool:
        return any(v is not None for v in self._kept.values())

    def _warm_events(self) -> None:
        if not self.events.kept_gil:
            return
        try:
            self.events.after_caller(self.stream)
            ev = self.events.recorded(self.stream)
            ev.synchronize()
            if not ev.query():
                raise IpcError("an event synchronized with is not complete")
        except Exception:  # noqa: BLE001 - an optimisation: torch's calls order the copy the same
            log.warning("the CUDA driver's event calls fail here; torch's it is (they let the GIL go)", exc_info=True)
            self.events = TorchEvents(self.torch, self._caller_stream)
            self.engine = False  # (its calls are the driver's)

    def _warm_blocks(self, scratch, pattern) -> None:
        """Check the block kernel by content (16-byte and byte rows, both directions, rows over a piece, a tile of
        two kernel blocks, a partial tile's entry); where it does not copy right here, parts move by their rows
        (:attr:`blocks` off)."""
        def check() -> None:
            for unit, write in ((16, True), (16, False), (1, True)):
                self._warm_blocks_one(scratch, pattern, unit, write)
        direct, self.direct = self.direct, False
        try:
            check()  # Triton's call (compiles)
            ok = True
        except Exception:  # noqa: BLE001 - the block form is an optimisation: the rows copy the same bytes
            ok = False
            log.warning("the block copy kernel does not copy right here", exc_info=True)
        self.direct = direct
        if ok and direct:
            ok = self._through_direct(check)
        if not ok:
            self.blocks = False
            log.warning("the block copy kernel does not copy right here; parts move by their rows")

    def _warm_blocks_one(self, scratch, pattern, unit: int, write: bool) -> None:
        n = len(pattern)
        scratch[:n].copy_(pattern)
        scratch[n:].zero_()
        stride, base = 5 * n // 16, scratch.data_ptr()
        src, dst = base, base + n  # the sources: the pattern's half; the local side is either
        first = CHUNK + 2 * unit if unit == 16 and write else 32 * unit  # two pieces (once: it is the same code)
        lens = (first, 16 * unit if unit > 1 else 3)
        offs = (0, CHUNK + 4 * unit)
        # slot 0: two tiles, local ids (2, 0), remote (1, 2); slot 1: one tile of two local kernel blocks (5, 1)
        # and one remote (0), read by an entry of the tile's second local block (another block size's tiles);
        # slot 2: one tile, ids 3 and 3, read by a short entry (a partial tile's, as a range's end gives)
        ids = np.array([9, 11, 2, 13, 15, 1, 16, 17, 1, 2, 0, 1, 2, 5, 1, 0, 3, 3], dtype=np.int64)
        local, remote = (src, dst) if write else (dst, src)
        sub = CHUNK + 1024  # the sub-block entry's offset: between the rows above (CHUNK + 20 units) and the next id's
        size = 3 * unit  # the partial tile's row
        rows = [(local + o, stride, remote + o, stride, ln, 0, 1, 0, 1, 0) for o, ln in zip(offs, lens)]
        rows.append((local + sub, stride, remote + sub, stride, 16 * unit, 1, 2, 1, 1, 0))
        rows.append((local, stride, remote, stride, size, 2, 1, 0, 1, 0))
        entries = np.array(rows, dtype=np.int64).reshape(-1)
        b = BlockLaunch(entries, ids, 2, 2, write, unit % 8 == 0, unit % 16 == 0)
        self.start_blocks(b).event.synchronize()
        want = np.zeros(n, dtype=np.uint8)
        pat = pattern.cpu().numpy()
        moves = [(o, ln, il, ir) for o, ln in zip(offs, lens) for il, ir in ((2, 1), (0, 2))]
        moves += [(sub, 16 * unit, 1, 0), (0, size, 3, 3)]
        for o, ln, il, ir in moves:
            s_at, d_at = (il, ir) if write else (ir, il)
            want[d_at * stride + o:d_at * stride + o + ln] = pat[s_at * stride + o:s_at * stride + o + ln]
        if not np.array_equal(scratch[n:].cpu().numpy(), want):
            raise RuntimeError(f"the block copy kernel moved {unit}-byte rows wrong (write={write})")

    def _warm_one(self, scratch, pattern, length: int) -> None:
        n = len(pattern)
        scratch[:n].copy_(pattern)
        scratch[n:].zero_()
        one = lambda v: np.array([v], dtype=np.uint64)  # noqa: E731
        base = scratch.data_ptr()
        self.start(one(base), one(base + n), one(length)).event.synchronize()
        got = scratch[n:]
        if not bool((got[:length] == pattern[:length]).all()) or bool(got[length:].any()):
            raise RuntimeError(f"the copy kernel moved {length} bytes wrong")


def _ints(args: tuple) -> tuple[int, ...]:
    """A kernel's arguments as the driver's launch takes them: a tensor's (or ring span's) address, else the int."""
    return tuple(a.data_ptr() if hasattr(a, "data_ptr") else int(a) for a in args)


class HostCopy:
    """Copies rows between DRAM regions (ours and a peer's mapped ones), one ``memmove`` per row, in
    order, after checking every row lies in a region (:class:`StagingError` otherwise, nothing copied)."""

    def __init__(self, regions: Regions):
        self.regions = regions

    def start_rows(self, g: Rows) -> Launch:
        """Copy a built row table's rows (cut rows copy as their pieces, in order)."""
        t = g.table.view(np.uint64)
        return self.start(t[:g.rows], t[g.rows:2 * g.rows], t[2 * g.rows:])

    def start(self, src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> Launch:
        self._check(src, lens, "copy source")
        self._check(dst, lens, "copy destination")
        move_rows(src, dst, lens)
        return Launch()

    def _check(self, addr: np.ndarray, lens: np.ndarray, what: str) -> None:
        """StagingError unless every row lies in a region: in C where ``table.c`` is built (numpy's
        check releases the GIL at every step on a thousand rows); :meth:`Regions.locate` where it is not,
        and to word a refusal (the same verdict: tests/runtime/test_ipc_table.py)."""
        if native.library() is not None:
            addr, lens = np.ascontiguousarray(addr, np.uint64), np.ascontiguousarray(lens, np.uint64)
            if native.first_outside(addr, lens, self.regions.bases, self.regions.ends) < 0:
                return
        self.regions.locate(np.stack([addr, lens], axis=1), what)


# ``ctypes.memmove`` releases the GIL around every call: with another Python thread busy (an engine's loop),
# each row would wait up to the switch interval (5 ms) to get it back. Rows shorter than RELEASE_FROM are
# moved by kvlc.clib.libc's memmove, which keeps it (tests/runtime/test_gil.py); a longer row's copy lets
# the others run.
RELEASE_FROM = 1 << 20


def move_rows(src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> None:
    """``memmove`` each row (uint64 arrays, checked by the caller), in order; rows under
    :data:`RELEASE_FROM` bytes keep the GIL."""
    for s, d, n in zip(src.tolist(), dst.tolist(), lens.tolist()):
        (libc.memmove if n < RELEASE_FROM else ctypes.memmove)(d, s, n)
