"""Descriptor-driven copies between registered regions and a bounce buffer (gather / scatter).

The staging path hands this module descriptor ranges (``addr, len`` pairs, as the
compiler's ``instantiate`` built them) and a contiguous span of a bounce buffer.
:class:`Regions` maps an address range to the tensor that backs it (refusing any
range outside every registered region); :class:`Copier` moves the ranges with as
few copy calls as it can:

* ranges of one region, one length and one device as the bounce buffer: ONE
  ``index_select`` (gather) or ``index_copy_`` (scatter) over an overlapping
  ``as_strided`` row view of the region, on the widest element (16 on a GPU, 8, 4, 2 or 1
  bytes) that divides every offset and the length (int64 rows run ~4x faster than bytes);
* small ranges of a pinned host region with the bounce buffer on a GPU: the same indexed
  copy, by a GPU kernel over a CUDA view of the host memory (unified addressing);
* a range of 1 MiB or more, or a range whose region lives on another device than
  the bounce buffer (host ↔ GPU): one ``copy_`` of that slice.

No layout arithmetic: ranges are copied as given, packed one after the other.
On a GPU the copies are queued on the given stream (nothing waits here); on the
CPU they run synchronously.

>>> import torch, numpy as np
>>> src = torch.arange(64, dtype=torch.uint8)
>>> regs = Regions([Region(src.data_ptr(), 64, src)])
>>> bounce = torch.zeros(16, dtype=torch.uint8)
>>> pieces = np.array([[src.data_ptr() + 8, 4], [src.data_ptr() + 40, 4]], dtype=np.uint64)
>>> Copier(regs).gather(pieces, bounce)
>>> bounce[:8].tolist()
[8, 9, 10, 11, 40, 41, 42, 43]
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlc.errors import TransferError

BIG_RANGE = 1 << 20  # ranges at least this long are copied one by one (a copy call is ~10 us; they run at full speed)
_WIDTHS = (8, 4, 2, 1)
HOST_ALIAS = os.environ.get("KVLC_STAGING_HOST_ALIAS", "1") != "0"


class StagingError(TransferError):
    """A staged transfer cannot proceed: a range outside every region, a bad message, a full buffer."""


@dataclass(frozen=True)
class Region:
    """A registered memory range and the flat uint8 tensor that backs it (``base`` = its data_ptr)."""

    base: int
    nbytes: int
    tensor: Any

    @property
    def end(self) -> int:
        return self.base + self.nbytes


def flat_bytes(tensor: Any) -> Any:
    """A contiguous tensor's bytes as a 1-D uint8 view."""
    import torch

    return tensor.reshape(-1).view(torch.uint8)


class Regions:
    """Registered regions, sorted by address; :meth:`locate` finds the region of every range."""

    def __init__(self, regions: Sequence[Region]):
        self.regions = sorted(regions, key=lambda r: r.base)
        for a, b in zip(self.regions, self.regions[1:]):
            if b.base < a.end:
                raise StagingError(f"regions overlap: [{a.base:#x}, {a.end:#x}) and [{b.base:#x}, {b.end:#x})")
        self.bases = np.array([r.base for r in self.regions], dtype=np.uint64)  # uint64, sorted
        self.ends = np.array([r.end for r in self.regions], dtype=np.uint64)

    @classmethod
    def of_tensors(cls, tensors: Sequence[Any]) -> Regions:
        """One region per contiguous tensor (its whole storage of bytes)."""
        return cls([Region(int(t.data_ptr()), int(t.numel()) * int(t.element_size()), flat_bytes(t))
                    for t in tensors])

    def locate(self, pieces: np.ndarray, what: str = "range") -> np.ndarray:
        """Index of the region holding each (addr, len) row; :class:`StagingError` if any lies outside."""
        addr = pieces[:, 0].astype(np.uint64, copy=False)
        length = pieces[:, 1].astype(np.uint64, copy=False)
        idx = np.searchsorted(self.bases, addr, side="right").astype(np.int64) - 1
        ok = idx >= 0
        safe = np.where(ok, idx, 0)
        if len(self.regions):
            end = self.ends[safe]
            # room = end - addr only where addr < end: no uint64 sum that could wrap past 2**64
            room = np.where(addr < end, end - np.minimum(addr, end), np.uint64(0))
            ok &= (length > 0) & (length <= room)
        else:
            ok = np.zeros_like(ok)
        if not ok.all():
            bad = int(np.flatnonzero(~ok)[0])
            raise StagingError(
                f"{what} {bad} [{int(addr[bad]):#x}, +{int(pieces[bad, 1])}) lies outside every registered "
                f"region ({len(self.regions)} regions); the peer asked to move bytes this agent does not "
                f"expose — check that both sides run the same transfer program"
            )
        return safe


def _width(starts: int, length: int, extra: int, cuda: bool) -> int:
    """The widest element that divides every row start (their gcd: ``starts``), the length and ``extra``."""
    g = math.gcd(starts, length, extra)
    return next(w for w in ((16,) if cuda else ()) + _WIDTHS if g % w == 0)


class Copier:
    """Gathers ranges into, and scatters them out of, a contiguous bounce span (see the module doc)."""

    def __init__(self, regions: Regions, stream: Any = None):
        self.regions = regions
        self.stream = stream
        self.calls = 0  # copy calls issued (for benchmarks and tests)
        self._aliases: dict = {}
        self._spans: dict[str, _Span] = {}  # per device (see _span)
        self._rings: dict[str, _PinnedRing] = {}  # per CUDA device

    def warm(self, device: Any) -> None:
        """Pay first-use costs now, not in the first staged request: the pinned upload ring and the
        indexed-copy kernels of every element width (CUDA loads a kernel's module at its first launch)."""
        import torch

        if device.type == "cuda":
            self._ring(device)
        idx = torch.zeros(1, dtype=torch.int64, device=device)
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else _nullctx()
        with ctx:
            for dtype in (torch.complex128, torch.int64, torch.int32, torch.int16, torch.uint8):
                rows, out = torch.zeros(2, 2, dtype=dtype, device=device), torch.empty(1, 2, dtype=dtype, device=device)
                torch.index_select(rows, 0, idx, out=out)
                rows.index_copy_(0, idx, out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def upload(self, values: np.ndarray, device: Any) -> Any:
        """``values`` (a 1-D int64 array) on ``device``, queued on the stream without waiting.

        A copy from pageable memory would make the host wait for the stream (and, with two
        processes on one GPU, for the other's time slice) at every indexed copy; this goes through
        a ring of pinned buffers instead (one wait only if the ring laps a copy still in flight)."""
        import torch

        if device.type != "cuda":
            return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
        with torch.cuda.stream(self.stream) if self.stream is not None else _nullctx():
            return self._ring(device).put(np.ascontiguousarray(values, dtype=np.int64))

    def _upload_here(self, values: np.ndarray, device: Any) -> Any:
        """:meth:`upload` from inside a copy (the copy stream is current already)."""
        if device.type != "cuda":
            return self.upload(values, device)
        return self._ring(device).put(np.ascontiguousarray(values, dtype=np.int64))

    def _ring(self, device: Any) -> _PinnedRing:
        """This copier's pinned upload ring for ``device`` (made at first use, or by :meth:`warm`)."""
        ring = self._rings.get(str(device))
        if ring is None:
            ring = self._rings[str(device)] = _PinnedRing(device)
        return ring

    def upload_into(self, values: np.ndarray, dst: Any) -> None:
        """Copy int64 ``values`` into the GPU byte tensor ``dst`` straight from a pinned ring buffer,
        queued on the stream (no intermediate device tensor, the host does not wait)."""
        import torch

        ring = self._ring(dst.device)
        values = np.ascontiguousarray(values, dtype=np.int64)
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else _nullctx()
        with ctx:
            if values.size > ring.SIZE:  # larger than a ring buffer: a plain (waiting) copy
                dst.copy_(torch.from_numpy(values).view(torch.uint8))
            else:
                ring.put_into(values, dst)

    def gather(self, pieces: np.ndarray, bounce: Any) -> None:
        """Copy each (addr, len) range, in order, into ``bounce`` (a 1-D uint8 tensor span)."""
        self._run(pieces, bounce, gather=True)

    def scatter(self, bounce: Any, pieces: np.ndarray) -> None:
        """Copy consecutive spans of ``bounce``, in order, into each (addr, len) range."""
        self._run(pieces, bounce, gather=False)

    def _run(self, pieces: np.ndarray, bounce: Any, gather: bool) -> None:
        import torch

        pieces = np.asarray(pieces, dtype=np.uint64).reshape(-1, 2)
        if not len(pieces):
            return
        where = self.regions.locate(pieces, "gather range" if gather else "scatter range")
        lens = pieces[:, 1].astype(np.int64)
        offs = np.concatenate(([0], np.cumsum(lens)[:-1]))
        if int(offs[-1] + lens[-1]) > bounce.numel():
            raise StagingError(f"{int(offs[-1] + lens[-1])} bytes do not fit a bounce span of {bounce.numel()}")
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else _nullctx()
        span = self._span(bounce.device, where)
        with ctx:
            # Runs of consecutive pieces with one length (and one region, unless every region lies on
            # the bounce buffer's device: then one view spans them all) share one indexed copy.
            key = lens if span is not None else where * (1 << 40) + lens
            cut = np.flatnonzero(np.diff(key)) + 1
            for lo, hi in zip(np.concatenate(([0], cut)), np.concatenate((cut, [len(pieces)]))):
                region = span if span is not None else self.regions.regions[int(where[lo])]
                self._group(pieces[lo:hi], region, int(lens[lo]), int(offs[lo]), bounce, gather)

    def _span(self, device: Any, where: np.ndarray) -> Region | None:
        """One byte view from the lowest to the highest of this process's regions on ``device``, when the
        ranges (already checked to lie inside regions: ``where``) touch more than one region, all of them
        on ``device``; None otherwise. Only the checked ranges are ever read or written through it."""
        if len(where) < 2 or where.min() == where.max():
            return None
        key = str(device)
        if key not in self._spans:
            on = [i for i, r in enumerate(self.regions.regions) if r.tensor.device == device]
            first, last = (self.regions.regions[on[0]], self.regions.regions[on[-1]]) if on else (None, None)
            members = np.zeros(len(self.regions.regions), dtype=bool)
            members[on] = True
            self._spans[key] = _Span(members, _view(first.base, last.end - first.base, device)
                                     if len(on) > 1 else None)
        span = self._spans[key]
        if span.view is None or not (span.members.all() or span.members[where].all()):
            return None
        return span.view

    def _group(self, pieces, region: Region, length: int, at: int, bounce, gather: bool) -> None:
        src = region.tensor
        rel = (pieces[:, 0] - np.uint64(region.base)).astype(np.int64)
        n = len(pieces)
        span = bounce[at:at + n * length]
        if src.device != bounce.device and n > 1 and length < BIG_RANGE:
            alias = self._alias(region, bounce.device)
            if alias is not None:  # small host ranges: one GPU kernel reads/writes pinned host memory
                self._indexed(alias, rel, length, span, gather, n, region.base)
                return
        if n == 1 or length >= BIG_RANGE or src.device != bounce.device:
            for i, off in enumerate(rel.tolist()):
                part = span[i * length:(i + 1) * length]
                view = src[off:off + length]
                (part.copy_(view, non_blocking=True) if gather else view.copy_(part, non_blocking=True))
                self.calls += 1
            return
        self._indexed(src, rel, length, span, gather, n, region.base)

    def _alias(self, region: Region, device: Any) -> Any:
        """A CUDA tensor over a pinned host region (same address under unified addressing), or None.

        Many small host ranges then move in one indexed kernel over PCIe instead of one DMA copy
        call (~10 us) each. Off with ``KVLC_STAGING_HOST_ALIAS=0``; None for pageable memory.
        """
        key = (region.base, str(device))
        if key not in self._aliases:
            self._aliases[key] = None
            if HOST_ALIAS and device.type == "cuda" and region.tensor.is_pinned():
                import torch

                try:
                    self._aliases[key] = torch.as_tensor(_Cai(region.base, region.nbytes), device=device)
                except Exception:  # no unified addressing: fall back to one copy per range
                    self._aliases[key] = None
        return self._aliases[key]

    def _indexed(self, src, rel: np.ndarray, length: int, span, gather: bool, n: int, base_addr: int) -> None:
        import torch

        starts = int(np.gcd.reduce(rel))
        w = _width(starts, length, math.gcd(bounce_addr(span), base_addr), src.device.type == "cuda")
        g = math.gcd(starts, length)  # row starts: every multiple of g bytes
        # 16-byte elements (complex128, moved bit for bit) on the GPU: wider loads, fewer PCIe requests
        dtype = {16: torch.complex128, 8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[w]
        elems = src.numel() // w
        base = src[:elems * w].view(dtype)
        if g == length and (elems * w) % length == 0:  # rows do not overlap: a plain (contiguous) view,
            view = base.view(-1, length // w)          # which index_select / index_copy_ run ~4x faster on
        else:
            rows = (src.numel() - length) // g + 1
            view = base.as_strided((rows, length // w), (g // w, 1))
        idx = self._upload_here(rel // g, src.device)
        out = span.view(dtype).view(n, length // w)
        if gather:
            torch.index_select(view, 0, idx, out=out)
        else:
            view.index_copy_(0, idx, out)
        self.calls += 1


class _PinnedRing:
    """Pinned host buffers cycled for uploads to one GPU; each is reused once its copy completed."""

    SIZE = 1 << 17  # int64 values per buffer (a chunk has at most 8,192 ranges)
    COUNT = 16

    def __init__(self, device: Any):
        import torch

        self.device = device
        self.host = [torch.empty(self.SIZE, dtype=torch.int64).pin_memory() for _ in range(self.COUNT)]
        self.events: list[Any] = [None] * self.COUNT
        self.at = 0

    def _next(self) -> Any:
        """The next ring buffer, once the copy last made from it completed."""
        k, self.at = self.at, (self.at + 1) % self.COUNT
        if self.events[k] is not None:
            self.events[k].synchronize()
        return k

    def put_into(self, values: np.ndarray, dst: Any) -> None:
        """Queue a copy of ``values`` (at most SIZE int64) into ``dst`` (bytes) on the current stream."""
        import torch

        k = self._next()
        buf = self.host[k][:values.size]
        buf.numpy()[:] = values
        dst.copy_(buf.view(torch.uint8), non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self.events[k] = ev

    def put(self, values: np.ndarray) -> Any:
        """``values`` on the device, copied on the current stream (the caller makes the copy stream
        current: :meth:`Copier._run` does)."""
        import torch

        if values.size > self.SIZE:  # larger than a buffer: the plain (waiting) copy
            return torch.from_numpy(values).to(self.device, non_blocking=True)
        k = self._next()
        buf = self.host[k][:values.size]
        buf.numpy()[:] = values
        out = buf.to(self.device, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self.events[k] = ev
        return out


@dataclass(frozen=True)
class _Span:
    """The regions on one device (a mask over region indices), and one view from the lowest to the
    highest (None: fewer than two)."""

    members: np.ndarray
    view: Region | None


def _view(base: int, nbytes: int, device: Any) -> Region | None:
    """A flat uint8 tensor over ``nbytes`` of this process's memory at ``base`` on ``device`` (no copy)."""
    import torch

    try:
        if device.type == "cuda":
            return Region(base, nbytes, torch.as_tensor(_Cai(base, nbytes), device=device))
        import ctypes

        raw = (ctypes.c_uint8 * nbytes).from_address(base)
        return Region(base, nbytes, torch.from_numpy(np.ctypeslib.as_array(raw)))
    except Exception:  # no view possible here: copy region by region
        return None


class _Cai:
    """``__cuda_array_interface__`` of a byte range (how torch is handed a pinned host address)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (nbytes,), "typestr": "|u1",
                                         "version": 3, "strides": None}


def bounce_addr(t: Any) -> int:
    return int(t.data_ptr())


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
