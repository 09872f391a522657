"""What is staged, and through what: the policy, chunking, bounce buffers (see :mod:`kvlc.runtime.staging`).

>>> l = np.array([[0, 6], [100, 6]], dtype=np.uint64); r = np.array([[50, 6], [200, 6]], dtype=np.uint64)
>>> [len(a) for a, _ in split_chunks(l, r, 8)]
[2, 1]
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlc.errors import KvlcError
from kvlc.runtime.staging_copy import StagingError
from kvlc.runtime.staging_wire import MAX_ROWS_PER_CHUNK, ROWS_RESERVE, BounceInfo

DEFAULT_SLOT_BYTES = 32 << 20
DEFAULT_SLOTS = 4


class StageMode(str, enum.Enum):
    """When to stage a part: by the policy's thresholds, always, or never."""

    AUTO = "auto"
    ALWAYS = "always"
    NEVER = "never"


@dataclass(frozen=True)
class StagingPolicy:
    """Which transfers go through bounce buffers.

    ``auto`` stages a part whose memory types differ on the two sides (``mixed``), or
    that has at least ``min_descriptors`` rows of at most ``max_mean_bytes`` on average.
    The defaults come from the H200 measurements: posting costs ~5.7 us per descriptor
    while gather + WRITE + scatter cost ~1.2 ns per byte, so staging wins well below
    ~1 MiB per descriptor once there are hundreds of them.

    >>> p = StagingPolicy()
    >>> p.decide(4086, 4086 * 65536, "VRAM", "VRAM"), p.decide(32, 256 << 20, "VRAM", "VRAM")
    (True, False)
    >>> StagingPolicy(mode="never").decide(4086, 1 << 20, "VRAM", "DRAM")
    False
    """

    mode: StageMode = StageMode.AUTO
    min_descriptors: int = 256
    max_mean_bytes: int = 512 << 10
    mixed: bool = True

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mode", StageMode(self.mode))
        except ValueError:
            raise KvlcError(f"StagingPolicy.mode: got {self.mode!r}; use one of "
                            f"{[m.value for m in StageMode]}") from None
        for name in ("min_descriptors", "max_mean_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise KvlcError(f"StagingPolicy.{name}: expected a positive integer, got {v!r}")

    def decide(self, rows: int, nbytes: int, local_mem: str, remote_mem: str) -> bool:
        """Whether a part of ``rows`` descriptors and ``nbytes`` bytes should be staged."""
        if self.mode is not StageMode.AUTO or not rows:
            return self.mode is StageMode.ALWAYS and rows > 0
        if self.mixed and local_mem != remote_mem:
            return True
        return rows >= self.min_descriptors and nbytes / rows <= self.max_mean_bytes


def _align8(n: int) -> int:
    return (n + 7) & ~7


class BounceBuffer:
    """``slots`` x ``slot_bytes`` bytes (plus room for each chunk's ranges), allocated and registered
    with NIXL once.

    ``device`` None: DRAM (host memory); an int: VRAM on that CUDA device.
    """

    def __init__(self, agent: Any, slot_bytes: int = DEFAULT_SLOT_BYTES, slots: int = DEFAULT_SLOTS,
                 device: int | None = None):
        import torch

        if slot_bytes < 4096 or slots < 1:
            raise KvlcError(f"bounce buffer: need slot_bytes >= 4096 and slots >= 1, got {slot_bytes}, {slots}")
        self.agent, self.slot_bytes, self.slots = agent, int(slot_bytes), int(slots)
        self.stride = self.slot_bytes + ROWS_RESERVE
        self.mem = "DRAM" if device is None else "VRAM"
        self.device = 0 if device is None else int(device)
        where = "cpu" if device is None else f"cuda:{device}"
        self.tensor = torch.empty(self.stride * self.slots, dtype=torch.uint8, device=where)
        self.addr = int(self.tensor.data_ptr())
        rows = np.array([[self.addr, self.tensor.numel(), self.device]], dtype=np.uint64)
        self.registration = agent.register(rows, self.mem, what=f"bounce buffer ({self.slots} x {self.slot_bytes})")

    def slot(self, i: int, nbytes: int | None = None) -> Any:
        lo = i * self.stride
        return self.tensor[lo:lo + (self.slot_bytes if nbytes is None else nbytes)]

    def ranges(self, i: int, nbytes: int, nrows: int) -> Any:
        """Where a chunk of ``nbytes`` keeps its ``nrows`` destination ranges: right behind the data."""
        lo = i * self.stride + _align8(nbytes)
        return self.tensor[lo:lo + 16 * nrows]

    def info(self) -> BounceInfo:
        return BounceInfo(self.agent.name, self.addr, self.slot_bytes, self.stride, self.slots, self.mem,
                          self.device)

    def release(self) -> None:
        self.registration.release()


def split_chunks(local: np.ndarray, remote: np.ndarray, slot_bytes: int,
                 max_rows: int = MAX_ROWS_PER_CHUNK) -> list[tuple[np.ndarray, np.ndarray]]:
    """Cut row-aligned (addr, len) ranges into chunks of at most ``slot_bytes`` bytes and ``max_rows`` rows.

    Ranges keep their order; a range crossing a chunk boundary is cut in two.

    >>> l = np.array([[0, 6], [100, 6]], dtype=np.uint64); r = np.array([[50, 6], [200, 6]], dtype=np.uint64)
    >>> [(a.tolist(), b.tolist()) for a, b in split_chunks(l, r, 8)]
    [([[0, 6], [100, 2]], [[50, 6], [200, 2]]), ([[102, 4]], [[202, 4]])]
    """
    lens = local[:, 1].astype(np.int64)
    if (lens != remote[:, 1].astype(np.int64)).any():
        raise StagingError("source and destination rows differ in length")
    ends = np.cumsum(lens)
    starts = ends - lens
    total = int(ends[-1])
    cuts = np.union1d(starts, np.arange(slot_bytes, total, slot_bytes, dtype=np.int64))
    owner = np.searchsorted(starts, cuts, side="right") - 1
    new_len = np.diff(np.append(cuts, total))
    keep = new_len > 0
    cuts, owner, new_len = cuts[keep], owner[keep], new_len[keep]
    shift = (cuts - starts[owner]).astype(np.uint64)
    lrows = np.stack([local[owner, 0] + shift, new_len.astype(np.uint64)], axis=1)
    rrows = np.stack([remote[owner, 0] + shift, new_len.astype(np.uint64)], axis=1)
    chunk = cuts // slot_bytes
    out = []
    edges = np.flatnonzero(np.diff(chunk)) + 1
    for lo, hi in zip(np.concatenate(([0], edges)), np.concatenate((edges, [len(chunk)]))):
        for a in range(int(lo), int(hi), max_rows):
            b = min(int(hi), a + max_rows)
            out.append((lrows[a:b], rrows[a:b]))
    return out


@dataclass
class _Chunk:
    req: str
    peer: str
    seq: int
    total: int
    local: np.ndarray       # (n, 2) source ranges
    remote: np.ndarray      # (n, 2) destination ranges
    nbytes: int
    slot: int = -1
    remote_slot: int = -1
    event: Any = None
    xfer: Any = None


@dataclass
class _Sending:
    req: str
    peer: str
    total: int
    deadline: float | None
    freed: int = 0
    failed: str = ""
    queued: int = 0         # chunks not yet gathered


@dataclass(frozen=True)
class StageEvent:
    """What :meth:`StagingEndpoint.progress` reports: a request ``sent`` (every chunk scattered by the
    receiver), ``received`` (this side scattered every chunk), or ``failed`` with the reason."""

    kind: str
    req: str
    peer: str
    reason: str = ""
