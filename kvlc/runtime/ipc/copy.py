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
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlc.runtime.staging.copy import Regions

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


def row_table(src: np.ndarray, dst: np.ndarray, lens: np.ndarray, chunk: int = CHUNK) -> tuple[np.ndarray, bool]:
    """The kernel's row table (sources, destinations, lengths: int64, after :func:`split`) and whether
    every address and length is a multiple of 8 (the kernel then moves 8-byte words)."""
    src, dst, lens = split(src, dst, lens, chunk)
    table = np.concatenate([src, dst, lens])
    wide = not bool(np.bitwise_or.reduce(table) & np.uint64(7)) if len(table) else True
    return table.view(np.int64), wide


@dataclass
class Launch:
    """A copy in flight: ``done()`` once every byte landed."""

    event: Any = None
    keep: tuple = ()  # what the copy reads until it ends (the row table)

    def done(self) -> bool:
        return self.event is None or bool(self.event.query())


class GpuCopy:
    """Copies rows on GPU ``device`` with one kernel launch per part."""

    def __init__(self, device: int):
        import torch

        from kvlc.runtime.ipc import kernel  # Triton: only where a GPU copies

        self.torch, self.kernel, self.device = torch, kernel, device
        self.stream = torch.cuda.Stream(device=device)
        self.block_words, self.num_warps = BLOCK_WORDS, NUM_WARPS

    def start(self, src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> Launch:
        torch = self.torch
        rows, wide = row_table(src, dst, lens)
        n = len(rows) // 3
        host = torch.from_numpy(rows).pin_memory()
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            table = host.to(f"cuda:{self.device}", non_blocking=True)
            block = self.block_words if wide else 8 * self.block_words
            self.kernel.copy_rows[(n,)](table, n, BLOCK=block, WIDE=wide, num_warps=self.num_warps)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return Launch(ev, (host, table))


    def warm(self) -> None:
        """Compile the kernel now (both variants), on a scratch buffer of its own, not at the first request."""
        torch = self.torch
        scratch = torch.zeros(64, dtype=torch.uint8, device=f"cuda:{self.device}")
        base = np.uint64(scratch.data_ptr())
        for length in (8, 3):  # 8-byte words, then bytes
            self.start(np.array([base], dtype=np.uint64), np.array([base + np.uint64(32)], dtype=np.uint64),
                       np.array([length], dtype=np.uint64)).event.synchronize()


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
