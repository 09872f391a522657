"""Running one part's rows as copies between this process's memory and a peer's mapped memory.

The rows arrive as three arrays, source address, destination address and length (the
descriptors :func:`kvlc.compiler.request.instantiate.instantiate` built, the peer's side already
moved into its mapped window): no layout arithmetic here.

* GPU (:class:`GpuCopy`): rows longer than :data:`CHUNK` are cut into chunks, the table goes up
  in one host-to-device copy, and ONE Triton kernel (:mod:`kvlc.runtime.ipc.kernel`) moves every
  row, one program per chunk, on a stream of its own; an event recorded after it says when every
  byte landed.
* CPU (:class:`HostCopy`): the same rows, one ``memmove`` each, synchronously (every row checked
  against the regions first). Triton's interpreter runs the GPU kernel itself on the CPU in the tests.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlc.runtime.staging.copy import Regions

log = logging.getLogger(__name__)

CHUNK = 256 << 10  # bytes one kernel program moves at most (long rows are cut so every SM gets work)
BLOCK_WORDS = 1024  # 8-byte words one program moves per step
NUM_WARPS = 4


def split(src: np.ndarray, dst: np.ndarray, lens: np.ndarray, chunk: int = CHUNK
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows cut into pieces of at most ``chunk`` bytes, in order (``chunk`` a multiple of 16)."""
    n = ((lens + np.uint64(chunk - 1)) // np.uint64(chunk)).astype(np.int64)
    if not len(lens) or int(n.max()) <= 1:
        return src, dst, lens
    which = np.repeat(np.arange(len(lens)), n)
    k = np.arange(len(which), dtype=np.uint64) - np.repeat(np.cumsum(n) - n, n).astype(np.uint64)
    off = k * np.uint64(chunk)
    return src[which] + off, dst[which] + off, np.minimum(lens[which] - off, np.uint64(chunk))


def row_table(src: np.ndarray, dst: np.ndarray, lens: np.ndarray, chunk: int = CHUNK) -> tuple[np.ndarray, int]:
    """The kernel's row table (sources, destinations, lengths: int64, after :func:`split`) and the
    alignment every address and length shares: 16, 8 (the kernel moves 8-byte words) or 1 (bytes)."""
    src, dst, lens = split(src, dst, lens, chunk)
    table = np.concatenate([src, dst, lens])
    low = int(np.bitwise_or.reduce(table)) & 15 if len(table) else 0
    return table.view(np.int64), 16 if not low else 8 if not low & 7 else 1


@dataclass
class Launch:
    """A copy in flight: ``done()`` once every byte landed."""

    event: Any = None
    keep: tuple = ()  # what the copy reads until it ends (the row table)

    def done(self) -> bool:
        return self.event is None or bool(self.event.query())


class _Ring:
    """A pinned host buffer and a device buffer of int64 row tables, handed out in order and taken
    back once the copy that read a span ended (its event): no allocation per request."""

    def __init__(self, torch, device: int, words: int):
        self.host = torch.empty(words, dtype=torch.int64, pin_memory=True)
        self.dev = torch.empty(words, dtype=torch.int64, device=f"cuda:{device}")
        self.words, self.head = words, 0
        self.spans: list[tuple[int, int, Any]] = []  # (start, stop, event) in use, oldest first

    def take(self, n: int) -> int | None:
        """Where ``n`` words may be written now (None: the table is larger than the ring)."""
        if n > self.words:
            return None
        at = self.head if self.head + n <= self.words else 0
        while self.spans and self._overlaps(at, at + n):
            self.spans.pop(0)[2].synchronize()  # the oldest copy still reading there: wait (rare)
        self.spans = [sp for sp in self.spans if not sp[2].query()] if len(self.spans) > 64 else self.spans
        return at

    def _overlaps(self, a: int, b: int) -> bool:
        return any(s < b and a < e for s, e, _ in self.spans)

    def used(self, at: int, n: int, event) -> None:
        self.spans.append((at, at + n, event))
        self.head = at + n


class GpuCopy:
    """Copies rows on GPU ``device`` with one kernel launch per part, after the work queued on the
    calling thread's current stream (what the engine wrote before asking is what gets copied)."""

    RING_WORDS = 1 << 20  # 8 MiB of row tables (~350,000 rows) in flight at most before waiting

    def __init__(self, device: int):
        import torch

        from kvlc.runtime.ipc import kernel  # Triton: only where a GPU copies

        self.torch, self.kernel, self.device = torch, kernel, device
        self.stream = torch.cuda.Stream(device=device)
        self.block_words, self.num_warps = BLOCK_WORDS, NUM_WARPS
        self.ring = _Ring(torch, device, self.RING_WORDS)
        self.vec = True  # 16-byte hints (off where this Triton cannot compile them: see warm)

    def start(self, src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> Launch:
        torch = self.torch
        rows, align = row_table(src, dst, lens)
        n = len(rows) // 3
        with torch.cuda.device(self.device):
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                at = self.ring.take(len(rows))
                if at is None:  # larger than the ring: a table of its own
                    keep = (torch.from_numpy(rows).pin_memory(),)
                    table = keep[0].to(f"cuda:{self.device}", non_blocking=True)
                else:
                    self.ring.host.numpy()[at:at + len(rows)] = rows
                    table = self.ring.dev[at:at + len(rows)]
                    table.copy_(self.ring.host[at:at + len(rows)], non_blocking=True)
                    keep = ()
                block = self.block_words if align >= 8 else 8 * self.block_words
                self.kernel.copy_rows[(n,)](table, n, BLOCK=block, WIDE=align >= 8, VEC=self.vec and align >= 16,
                                            num_warps=self.num_warps)
                ev = torch.cuda.Event()
                ev.record(self.stream)
        if at is not None:
            self.ring.used(at, len(rows), ev)
        return Launch(ev, keep + (table,))

    def warm(self) -> None:
        """Compile the kernel's variants now (16-byte, 8-byte and byte rows), on a scratch buffer of
        its own, not at the first request."""
        torch = self.torch
        scratch = torch.zeros(128, dtype=torch.uint8, device=f"cuda:{self.device}")
        base = np.uint64(scratch.data_ptr())
        for length in (16, 8, 3):
            try:
                self.start(np.array([base], dtype=np.uint64), np.array([base + np.uint64(64)], dtype=np.uint64),
                           np.array([length], dtype=np.uint64)).event.synchronize()
            except Exception:  # noqa: BLE001 - the hints are an optimisation: without them the kernel is the same
                if length != 16 or not self.vec:
                    raise
                self.vec = False
                log.warning("the copy kernel's 16-byte hints do not compile here; 8-byte words it is", exc_info=True)


class HostCopy:
    """Copies rows between DRAM regions (ours and a peer's mapped ones), one ``memmove`` per row, in
    order, after checking every row lies in a region (:class:`StagingError` otherwise, nothing copied)."""

    def __init__(self, regions: Regions):
        self.regions = regions

    def start(self, src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> Launch:
        self.regions.locate(np.stack([src, lens], axis=1), "copy source")
        self.regions.locate(np.stack([dst, lens], axis=1), "copy destination")
        move = ctypes.memmove
        for s, d, n in zip(src.tolist(), dst.tolist(), lens.tolist()):
            move(d, s, n)
        return Launch()
