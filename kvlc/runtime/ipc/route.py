"""The executor's door to the wire: parts to a same-host peer are copied here, the rest go to NIXL.

:class:`IpcRoute` has the interface the :class:`~kvlc.runtime.transfer.Executor` uses of a NIXL
agent (``initialize``, ``make_prepped``, ``post``, ``state``, ``send_notif``). A part whose peer
agent's storages are mapped here (:mod:`kvlc.runtime.ipc.memory`) and whose two memory types this
side can copy between (VRAM ↔ VRAM with CUDA IPC, DRAM ↔ DRAM with shared files, and this side's
pinned DRAM ↔ the peer's VRAM through unified addressing) becomes an :class:`IpcXfer`: created,
posted (ONE copy kernel launch; or, for long rows with host memory on one side, a call per row on
the GPU's copy engines: :meth:`IpcRoute.on_engine`), polled (done once its event says every byte landed) and
released like a NIXL request, so the executor's rules hold unchanged: nothing is
posted after a refusal or past the deadline, a copy in flight cannot be recalled and holds its
request until it ends, the peer hears ``done`` only after every part ended: rung on the doorbell
the peer offered for the session (:mod:`kvlc.runtime.ipc.bell`), or through NIXL's notifications
where it offered none or its ring is full. Everything else passes through to NIXL untouched.

Every row is checked against the peer's mapped windows before anything moves: a row outside them
refuses the part (:class:`~kvlc.runtime.ipc.cuda.IpcError`), nothing posted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvlc.runtime.ipc import cuda, native
from kvlc.runtime.ipc.copy import (CHUNK, ENGINE_FROM, BlockLaunch, GpuCopy, HostCopy, Launch, Rows, launch_rows,
                                   row_table)
from kvlc.runtime.ipc.cuda import IpcError
from kvlc.runtime.ipc.driver import DEFAULT_GPU_CALLS, GpuCalls
from kvlc.runtime.ipc.memory import Mapped, Window
from kvlc.runtime.nixl.core import XferState
from kvlc.runtime.staging.copy import Region, Regions, flat_bytes

log = logging.getLogger(__name__)
_U64 = (1 << 64) - 1  # a shift as the uint64 that adds it modulo 2**64
GRID_YZ = 65535  # CUDA's limit on a grid's second and third axes (a block launch's entries and pieces)
ENTRIES_KEPT = 64  # block tables whose entries a peer's windows keep (a part's, per partial tiles at its ends)
UNCUT = 1 << 62  # the chunk of a table whose rows go on the copy engine: no row cut (each one call)


@dataclass
class IpcXfer:
    """One part moved by a same-host copy; looks like a NIXL transfer to the executor."""

    what: str
    peer: str
    rows: Rows | None  # the launch's row table: sources, destinations (the peer's in its mapped window), lengths
    mem: str  # this side's memory
    remote_mem: str  # the peer's ("VRAM" on either side: a kernel on ``device``; DRAM both: memmove on the CPU)
    device: int
    route: Any = field(repr=False, default=None)
    windows: Any = field(repr=False, default=None)  # the peer's _Windows it copies through
    state: XferState = XferState.PROC
    error: str | None = None
    released: bool = False
    posted: bool = False  # a copy was launched (the route counts it in flight until released)
    launch: Launch | None = field(repr=False, default=None)
    blocks: BlockLaunch | None = field(repr=False, default=None)  # the part by its block ids instead of rows
    engine: bool = False  # its rows go on the GPU's copy engines (GpuCopy.start_engine), not the kernel

    def release(self) -> None:
        if not self.released:
            self.released, self.launch = True, None
            self.route.ended(self)


class _Windows:
    """A peer's mapped windows, sorted by the peer's addresses, for translating rows."""

    def __init__(self, mapped: Mapped):
        self.mapped = mapped
        ws = sorted(mapped.windows, key=lambda w: w.addr)
        self.windows: list[Window] = ws
        self.starts = np.array([w.addr for w in ws], dtype=np.uint64)
        self.stops = np.array([w.addr + w.size for w in ws], dtype=np.uint64)
        self.shifts = np.array([w.shift for w in ws], dtype=np.int64)
        self.mem_of = np.array([w.mem for w in ws])
        self.mems = {w.mem for w in ws}
        self.native = native.Windows.of(self.starts, self.stops, self.shifts,
                                        {m: self.mem_of == m for m in self.mems})  # what table.c reads
        self.users = 0  # copies created and not released yet
        self.retired = False
        self._host: HostCopy | None = None
        self._entries: dict = {}  # (block table, memory type, write) -> _Entries or None (no window holds it)

    def translate(self, rows: np.ndarray, mem: str, what: str) -> np.ndarray:
        """The peer's row addresses as this process sees them; IpcError if any row lies outside a window."""
        addr = rows[:, 0].astype(np.uint64, copy=False)
        lens = rows[:, 1].astype(np.uint64, copy=False)
        end = addr + lens
        if len(addr):  # the usual case first: every row in one window, one shift for all (no search per row)
            k = int(np.searchsorted(self.starts, addr.min(), side="right")) - 1
            stop = int(self.stops[k]) if k >= 0 else 0
            if (k >= 0 and self.mem_of[k] == mem and int(end.max()) <= stop and int(addr.max()) < stop
                    and not (end < addr).any()):  # (an empty row at a window's end: the search below places it)
                return addr + np.uint64(int(self.shifts[k]) & _U64)
        i = np.searchsorted(self.starts, addr, side="right").astype(np.int64) - 1
        j = np.maximum(i, 0)
        ok = (i >= 0) & (end <= self.stops[j]) & (end >= addr) & (self.mem_of[j] == mem)
        if not bool(ok.all()):
            raise _outside(rows, int(np.flatnonzero(~ok)[0]), mem, what)
        return (addr.astype(np.int64) + self.shifts[j]).astype(np.uint64)

    def table(self, local_rows: np.ndarray, remote_rows: np.ndarray, mem: str, write: bool, what: str,
              chunk: int = CHUNK) -> Rows:
        """A part's launch: its rows with the peer's side translated (:meth:`translate`), sources first
        (``write``: this side's), cut at ``chunk`` bytes (:func:`~kvlc.runtime.ipc.copy.row_table`); one
        pass in C where it is built (:mod:`kvlc.runtime.ipc.native`), the same table and refusal."""
        local_rows, remote_rows = np.asarray(local_rows), np.asarray(remote_rows)
        if native.library() is None or mem not in self.mems:
            return self._reference(local_rows, remote_rows, mem, write, what, chunk)
        table, got = native.build(local_rows, remote_rows, write, self.native, mem, chunk)
        if table is None:
            raise _outside(remote_rows, got, mem, what)
        return launch_rows(table, got)

    def blocks(self, form, mem: str, write: bool) -> BlockLaunch | None:
        """A part's launch by block ids (``form``: its :class:`~kvlc.compiler.request.blocks.BlockCopy`), or None
        unless every entry's extent on the peer's side (where any of its rows can lie) is inside the window of
        the peer's ``mem`` that holds its start: checked once per table (then the rows decide, and word any
        refusal: :meth:`table`). The entries of the partial tiles at a range's ends are a table's like any other
        (one table per binding, part and partial tiles: the last :data:`ENTRIES_KEPT` are kept per peer)."""
        key = (form.table, mem, write)
        got = self._entries.get(key, False)
        if got is False:
            if len(self._entries) >= ENTRIES_KEPT:  # the oldest goes (its entries on the device with it)
                del self._entries[next(iter(self._entries))]
            got = self._entries[key] = _Entries.of(self, form.table, mem, write)
        if got is None:
            return None
        return BlockLaunch(got.entries, form.ids, form.count, got.pieces, write, got.wide, got.vec, got.kept)

    def _reference(self, local_rows, remote_rows, mem: str, write: bool, what: str, chunk: int) -> Rows:
        mapped = self.translate(remote_rows, mem, what)
        mine = np.ascontiguousarray(local_rows[:, 0], dtype=np.uint64)
        lens = np.ascontiguousarray(local_rows[:, 1], dtype=np.uint64)
        return row_table(*((mine, mapped) if write else (mapped, mine)), lens, chunk)

    def host_copy(self, local: list) -> HostCopy:
        """The CPU copier over this side's DRAM storages and the peer's mapped DRAM windows."""
        if self._host is None:
            regions = [Region(b.addr, b.nbytes, flat_bytes(b.tensor)) for b in local if b.mem == "DRAM"]
            regions += [Region(w.base, w.size, w.tensor) for w in self.windows if w.mem == "DRAM"]
            self._host = HostCopy(Regions(regions))
        return self._host


@dataclass(frozen=True, eq=False)
class _Entries:
    """A block table's entries as the kernel reads them for one peer (its bases moved into the windows that
    hold each entry's extent), and the launch's constants: CHUNK pieces of the longest row, the alignment."""

    table: Any          # the BlockTable (kept: the cache is keyed by it)
    entries: np.ndarray  # int64, ENTRY per entry
    pieces: int
    wide: bool
    vec: bool
    kept: dict = field(default_factory=dict)  # the entries on the device (GpuCopy uploads them once)

    @classmethod
    def of(cls, w: "_Windows", table, mem: str, write: bool) -> "_Entries | None":
        lo, hi = table.remote_lo.astype(np.uint64), table.remote_hi.astype(np.uint64)
        k = np.searchsorted(w.starts, lo, side="right").astype(np.int64) - 1
        j = np.maximum(k, 0)
        if not len(lo) or not bool(((k >= 0) & (hi <= w.stops[j]) & (hi > lo) & (w.mem_of[j] == mem)).all()):
            return None
        moved = (table.remote_base.astype(np.uint64) + w.shifts[j].astype(np.uint64)).view(np.int64)  # mod 2**64
        cols = (table.local_base, table.local_stride, moved, table.remote_stride, table.length, table.slot,
                table.local_sub, table.local_block, table.remote_sub, table.remote_block)
        entries = np.ascontiguousarray(np.stack(cols, axis=1).reshape(-1), dtype=np.int64)
        low = int(np.bitwise_or.reduce(np.stack(cols[:5]).reshape(-1))) & 15
        pieces = max(1, -(-int(table.length.max()) // CHUNK))
        if max(table.entries, pieces) > GRID_YZ:  # the grid could not hold them: the rows go
            return None
        return cls(table, entries, pieces, not low & 7, not low)


def _outside(rows: np.ndarray, bad: int, mem: str, what: str) -> IpcError:
    addr, n = int(rows[bad, 0]) & _U64, int(rows[bad, 1]) & _U64
    return IpcError(f"{what}: row {bad} ([{addr:#x}, +{n}) of the peer's {mem}) lies outside every storage it "
                    "shared; nothing moved")


class IpcRoute:
    """The executor's agent: same-host copies for mapped peers, NIXL (``nixl``) for everything else.

    ``bindings``: this agent's bound storages (the local side of every copy); ``min_rows``: a part
    between VRAM on both sides with fewer rows goes through NIXL (``AgentSettings.ipc_min_rows``);
    ``gpu_calls``: :class:`~kvlc.runtime.ipc.copy.GpuCopy`'s ``calls`` (``AgentSettings.ipc_gpu_calls``);
    ``copy_engine``: long rows with host memory on one side go on the GPU's copy engines through kvlc's own
    calls where warm-up found them right (:meth:`on_engine`; ``AgentSettings.ipc_copy_engine``)."""

    def __init__(self, nixl: Any, bindings: dict, min_rows: int = 0, gpu_calls: GpuCalls = DEFAULT_GPU_CALLS,
                 copy_engine: bool = True):
        self.nixl = nixl
        self.min_rows = min_rows
        self.gpu_calls = gpu_calls
        self.copy_engine = copy_engine
        self.peers: dict[str, _Windows] = {}
        self.retired: list[_Windows] = []  # unmapped once no copy in flight uses them
        self.local = list(bindings.values())
        self.gpu = next((b.device for b in self.local if b.mem == "VRAM"), None)
        self._gpu_copy: GpuCopy | None = None
        self._dram_reach: bool | None = None  # see _gpu_reaches_dram
        self.copies = 0  # parts moved here
        self.in_flight = 0  # copies posted and not released yet
        self.rung = 0  # notifications written into peers' doorbells (not sent through NIXL)
        self.block_copies = 0  # parts a GPU copied by their block ids (no row table)
        self.engine_copies = 0  # parts a GPU copied on its copy engines (a call per row)

    # ------------------------------------------------------------------ peers
    def devices(self) -> dict[str, int]:
        """Memory type → the device this side copies it on (what mapping a peer's storages needs)."""
        out = {"DRAM": 0}
        if self.gpu is not None:
            out["VRAM"] = self.gpu
        return out

    def add(self, mapped: Mapped) -> None:
        """Copy to and from ``mapped.peer`` through its mapped storages from now on (a GPU's kernel is
        compiled now, not at the first request; where it cannot be, this raises and nothing changes)."""
        if any(w.mem == "VRAM" for w in mapped.windows):
            self._gpu().warm()
        native.library()  # table.c loaded now, not in the first copy's table
        old = self.peers.pop(mapped.peer, None)
        if old is not None:
            self._retire(old)
        self.peers[mapped.peer] = _Windows(mapped)

    def drop(self, peer: str) -> None:
        """The sessions with ``peer`` ended: its storages are unmapped once no copy in flight uses them."""
        w = self.peers.pop(peer, None)
        if w is not None:
            self._retire(w)

    def _retire(self, w: _Windows) -> None:
        w.retired = True
        if w.users:
            self.retired.append(w)
        else:
            w.mapped.close()

    def covers(self, peer: str, local_mem: str, remote_mem: str) -> bool:
        """Whether a part to ``peer`` between these memory types is copied here: equal types the peer
        shared, or this side's DRAM and the peer's VRAM where this side's GPU reaches its DRAM."""
        w = self.peers.get(peer)
        if w is None or remote_mem not in w.mems:
            return False
        if local_mem == remote_mem:
            return True
        return local_mem == "DRAM" and remote_mem == "VRAM" and self._gpu_reaches_dram()

    def copies_part(self, peer: str, local_mem: str, remote_mem: str, rows: int) -> bool:
        """Whether a part of ``rows`` rows to ``peer`` is copied here (:meth:`covers`, and not a VRAM-to-VRAM
        part of fewer than :attr:`min_rows` rows: NIXL moves those)."""
        few = local_mem == remote_mem == "VRAM" and rows < self.min_rows
        return not few and self.covers(peer, local_mem, remote_mem)

    def on_engine(self, local_mem: str, remote_mem: str, local_rows: np.ndarray) -> bool:
        """Whether a part copied here goes on the GPU's copy engines, a ``cuMemcpyAsync`` per row, instead of the
        kernel: host memory on one side and rows averaging :data:`ENGINE_FROM` bytes or more, where
        :attr:`copy_engine` is on and warm-up found the engine's copies right. VRAM on both sides keeps the
        kernel (or NIXL, under :attr:`min_rows` rows): a handover's 32-row parts took longer on kvlc's per-row
        calls than through NIXL (benchmarks/README.md, run 44)."""
        n = len(local_rows)
        if not n or {local_mem, remote_mem} != {"DRAM", "VRAM"} or not self.copy_engine or self.gpu is None:
            return False
        return int(np.asarray(local_rows)[:, 1].sum()) >= ENGINE_FROM * n and self._gpu().engine

    def _gpu_reaches_dram(self) -> bool:
        """Whether this side's GPU copies its DRAM storages in place: each one pinned and mapped at its
        own address (what ``allocate(pin=True)`` gives), so one kernel reads DRAM and writes a peer's VRAM."""
        if self._dram_reach is None:
            dram = [b for b in self.local if b.mem == "DRAM"]
            self._dram_reach = self.gpu is not None and bool(dram) and all(
                cuda.host_mapped(b.addr, b.nbytes, self.gpu) for b in dram)
        return self._dram_reach

    def close(self) -> None:
        """Unmap every peer (the agent closes: nothing is in flight any more)."""
        for w in list(self.peers.values()) + self.retired:
            w.mapped.close()
        self.peers.clear()
        self.retired.clear()

    # ------------------------------------------------------------------ transfers
    def initialize(self, op: str, local_rows: np.ndarray, local_mem: str, remote_rows: np.ndarray,
                   remote_mem: str, remote_agent: str, what: str = "transfer") -> Any:
        if not self.copies_part(remote_agent, local_mem, remote_mem, len(local_rows)):
            return self.nixl.initialize(op, local_rows, local_mem, remote_rows, remote_mem, remote_agent, what)
        w = self.peers[remote_agent]
        engine = self.on_engine(local_mem, remote_mem, local_rows)
        rows = w.table(local_rows, remote_rows, remote_mem, op == "WRITE", f"{op} {what}", UNCUT if engine else CHUNK)
        w.users += 1
        return IpcXfer(f"{op} {what} to {remote_agent!r} (same host)", remote_agent, rows,
                       local_mem, remote_mem, self.gpu or 0, route=self, windows=w, engine=engine)

    @staticmethod
    def by_blocks(local_mem: str, remote_mem: str) -> bool:
        """Whether a part between these memory types may go by its block form (:meth:`initialize_blocks`)."""
        return local_mem == remote_mem == "VRAM"

    def initialize_blocks(self, op: str, blocks: Any, local_mem: str, remote_mem: str, remote_agent: str,
                          rows: int, what: str = "transfer") -> IpcXfer | None:
        """A part's copy by its block form (:attr:`~kvlc.compiler.pairing.program.Part.blocks`, ``rows``: the
        part's length), without its rows; None where a GPU here does not copy it that way (the part is not
        copied here or not VRAM on both sides, the block kernel is off, an entry's extent lies outside the
        peer's windows): then :meth:`initialize` takes its rows. Host memory on either side goes by rows:
        their merged rows, long where ids run on, cross PCIe on the copy engines or through the row kernel
        (0.79-0.88 of the pinned copy), where the block kernel, a program per block's row, moved 0.49
        (benchmarks/README.md, run 36)."""
        if not self.by_blocks(local_mem, remote_mem) or not self.copies_part(remote_agent, local_mem, remote_mem, rows):
            return None
        w = self.peers[remote_agent]
        launch = w.blocks(blocks, remote_mem, op == "WRITE") if self._gpu().blocks else None
        if launch is None:
            return None
        w.users += 1
        self.block_copies += 1
        return IpcXfer(f"{op} {what} to {remote_agent!r} (same host)", remote_agent, None,
                       local_mem, remote_mem, self.gpu or 0, route=self, windows=w, blocks=launch)

    def make_prepped(self, *args, **kwargs) -> Any:
        return self.nixl.make_prepped(*args, **kwargs)

    def post(self, xfer: Any, notif: bytes = b"") -> XferState:
        if not isinstance(xfer, IpcXfer):
            return self.nixl.post(xfer, notif)
        try:
            gpu = "VRAM" in (xfer.mem, xfer.remote_mem)
            copier = self._gpu() if gpu else xfer.windows.host_copy(self.local)
            if xfer.blocks is not None:
                xfer.launch = copier.start_blocks(xfer.blocks)
            elif xfer.engine:
                xfer.launch = copier.start_engine(xfer.rows)
                self.engine_copies += 1
            else:
                xfer.launch = copier.start_rows(xfer.rows)
        except Exception as exc:  # a launch that fails moved nothing of this part
            xfer.state, xfer.error = XferState.ERR, f"{xfer.what}: the copy could not start: {exc}"
            return xfer.state
        self.copies += 1
        self.in_flight += 1
        xfer.posted = True
        return self.state(xfer)

    def state(self, xfer: Any) -> XferState:
        if not isinstance(xfer, IpcXfer):
            return self.nixl.state(xfer)
        if xfer.state is XferState.PROC and xfer.launch is not None and xfer.launch.done():
            xfer.state = XferState.DONE
        return xfer.state

    def telemetry(self, xfer: Any) -> dict[str, int] | None:
        return None if isinstance(xfer, IpcXfer) else self.nixl.telemetry(xfer)

    def _ring(self, agent_name: str, message: bytes) -> bool:
        """Into the doorbell ``agent_name`` offered this side, if it did and the ring has room."""
        w = self.peers.get(agent_name)
        bell = w.mapped.bell if w is not None else None
        if bell is not None and bell.ring(message):
            self.rung += 1
            return True
        return False

    def send_notif(self, agent_name: str, message: bytes) -> None:
        """Into the doorbell ``agent_name`` offered this side (if it did and the ring has room), else through NIXL."""
        if not self._ring(agent_name, message):
            self.nixl.send_notif(agent_name, message)

    def send_done(self, agent_name: str, message: bytes) -> None:
        """A ``done``: into the doorbell ``agent_name`` offered (as :meth:`send_notif`), else through NIXL's path
        for them (:meth:`kvlc.runtime.nixl.core.Agent.send_done`)."""
        if not self._ring(agent_name, message):
            self.nixl.send_done(agent_name, message)

    def ended(self, xfer: IpcXfer) -> None:
        """A copy was released: a retired peer none uses any more is unmapped now."""
        if xfer.posted:
            self.in_flight -= 1
        w = xfer.windows
        w.users -= 1
        if w.retired and w.users <= 0 and w in self.retired:
            self.retired.remove(w)
            w.mapped.close()

    def _gpu(self) -> GpuCopy:
        if self._gpu_copy is None:  # (made and warmed when a peer with VRAM is added)
            self._gpu_copy = GpuCopy(self.gpu, calls=self.gpu_calls)
        return self._gpu_copy
