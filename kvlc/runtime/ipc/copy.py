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


CHUNKS = (16 << 10, 4 << 10, 1 << 10)  # bytes: rows cut into equal chunks of one of these run mask-free


@dataclass(frozen=True)
class Chunks:
    """Rows as equal chunks (:func:`chunk_table`): offsets in 8-byte words from two base addresses."""

    table: np.ndarray  # int64: every chunk's source offset, then every chunk's destination offset
    words: int         # 8-byte words per chunk
    src_base: int      # addresses, multiples of 16, at or below every row's
    dst_base: int
    src_span: int      # words from the base past the last byte a row reaches
    dst_span: int
    vec: bool          # every offset a multiple of 16 bytes


def chunk_table(src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> Chunks | None:
    """The rows as chunks of one size of :data:`CHUNKS` (the largest dividing every length), or None
    where they do not cut so (an address not a multiple of 8, a length of none): the general kernel
    takes those."""
    if not len(lens) or int(np.bitwise_or.reduce(np.concatenate([src, dst]))) & 7:
        return None
    g = int(np.gcd.reduce(lens.astype(np.int64)))
    size = next((c for c in CHUNKS if g % c == 0), 0)
    if not size:
        return None
    n = (lens // np.uint64(size)).astype(np.int64)
    which = np.repeat(np.arange(len(lens)), n)
    k = (np.arange(len(which)) - np.repeat(np.cumsum(n) - n, n)).astype(np.uint64) * np.uint64(size)
    sb, db = int(src.min()) & ~15, int(dst.min()) & ~15
    so = (src[which] + k - np.uint64(sb)) // np.uint64(8)
    do = (dst[which] + k - np.uint64(db)) // np.uint64(8)
    vec = not (int(np.bitwise_or.reduce(np.concatenate([src, dst]))) & 15)
    return Chunks(np.concatenate([so, do]).view(np.int64), size // 8, sb, db,
                  int(((src + lens).max() - np.uint64(sb)) // np.uint64(8)) + 1,
                  int(((dst + lens).max() - np.uint64(db)) // np.uint64(8)) + 1, vec)


def over(torch, addr: int, words: int, device: int):
    """An int64 tensor over ``words`` words of GPU memory at ``addr`` (memory this process may reach:
    its own, or a peer's mapped), made from its address alone (no copy, no ownership)."""

    class _At:
        __cuda_array_interface__ = {"shape": (words,), "typestr": "<i8", "data": (addr, False), "version": 3}

    return torch.as_tensor(_At(), device=f"cuda:{device}")


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
        # copy_chunks where rows allow: off, measured slower on the H200 (0.15-0.26 of d2d against the row
        # kernel's 0.37-0.69, and its host table up to 5.9 ms for 131,072 chunks; benchmarks/README.md, run 3)
        self.chunked = False

    def start(self, src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> Launch:
        torch = self.torch
        chunks = chunk_table(src, dst, lens) if self.chunked else None
        if chunks is not None:
            rows, n = chunks.table, len(chunks.table) // 2
        else:
            rows, align = row_table(src, dst, lens)
            n = len(rows) // 3
        with torch.cuda.device(self.device):
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                at, table, keep = self._upload(rows)
                if chunks is not None:
                    keep += (over(torch, chunks.src_base, chunks.src_span, self.device),
                             over(torch, chunks.dst_base, chunks.dst_span, self.device))
                    self.kernel.copy_chunks[(n,)](table, n, keep[-2], keep[-1], CHW=chunks.words,
                                                  VEC=self.vec and chunks.vec, num_warps=self.num_warps)
                else:
                    block = self.block_words if align >= 8 else 8 * self.block_words
                    self.kernel.copy_rows[(n,)](table, n, BLOCK=block, WIDE=align >= 8,
                                                VEC=self.vec and align >= 16, num_warps=self.num_warps)
                ev = torch.cuda.Event()
                ev.record(self.stream)
        if at is not None:
            self.ring.used(at, len(rows), ev)
        return Launch(ev, keep + (table,))

    def _upload(self, rows: np.ndarray):
        """(ring offset or None, the table on the GPU, what the copy keeps alive): on the copy stream."""
        torch = self.torch
        at = self.ring.take(len(rows))
        if at is None:  # larger than the ring: a table of its own
            host = torch.from_numpy(rows).pin_memory()
            return None, host.to(f"cuda:{self.device}", non_blocking=True), (host,)
        self.ring.host.numpy()[at:at + len(rows)] = rows
        table = self.ring.dev[at:at + len(rows)]
        table.copy_(self.ring.host[at:at + len(rows)], non_blocking=True)
        return at, table, ()

    def warm(self) -> None:
        """Compile the kernel's variants now (16-byte, 8-byte and byte rows; every chunk size), on a
        scratch buffer of its own, not at the first request."""
        torch = self.torch
        scratch = torch.zeros(2 * CHUNKS[0], dtype=torch.uint8, device=f"cuda:{self.device}")
        base = scratch.data_ptr()
        for length in (16, 8, 3) + CHUNKS:
            try:
                self._warm_one(base, base + CHUNKS[0], length)
            except Exception:  # noqa: BLE001 - the hints are an optimisation: without them the kernel is the same
                if length != 16 or not self.vec:
                    raise
                self.vec = False
                log.warning("the copy kernel's 16-byte hints do not compile here; 8-byte words it is", exc_info=True)

    def _warm_one(self, src: int, dst: int, length: int) -> None:
        one = lambda v: np.array([v], dtype=np.uint64)  # noqa: E731
        self.start(one(src), one(dst), one(length)).event.synchronize()


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
