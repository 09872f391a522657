"""What is staged, and through what: the policy, chunking, bounce buffers (see :mod:`kvlc.runtime.staging.endpoint`).

>>> l = np.array([[0, 6], [100, 6]], dtype=np.uint64); r = np.array([[50, 6], [200, 6]], dtype=np.uint64)
>>> [len(a) for a, _ in split_chunks(l, r, 8)]
[2, 1]
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlc.errors import KvlcError
from kvlc.runtime.staging.copy import StagingError
from kvlc.runtime.staging.wire import MAX_ROWS_PER_CHUNK, ROWS_RESERVE, BounceInfo

DEFAULT_SLOT_BYTES = 32 << 20
DEFAULT_SLOTS = 4
DRAM_SLOT_BYTES = 4 << 20


class StageMode(str, enum.Enum):
    """When to stage a part: by the policy's thresholds, always, or never."""

    AUTO = "auto"
    ALWAYS = "always"
    NEVER = "never"


# StagingPolicy's integer fields with the least value each may take.
_INTEGER_FIELDS = (("min_descriptors", 1), ("max_mean_bytes", 1), ("slot_bytes", 4096), ("slots", 1),
                   ("peers", 0), ("direct_min_bytes", 0))
DIRECT_MIN_BYTES = 1 << 20  # a chunk's mean source range from which it skips the gather (staging_direct)


@dataclass(frozen=True)
class StagingPolicy:
    """Which transfers go through bounce buffers.

    ``auto`` stages a part whose memory types differ on the two sides (``mixed``), or a
    VRAM-to-VRAM part that has at least ``min_descriptors`` rows of at most
    ``max_mean_bytes`` on average. The thresholds come from the H200 measurements: posting
    costs ~5.7 us per descriptor while gather + WRITE + scatter cost ~1.2 ns per byte, so
    staging wins well below ~1 MiB per descriptor once there are hundreds of them.
    Fragmented DRAM-to-DRAM parts are staged only with ``fragmented_dram`` (or ``always``):
    on CPU the gather and scatter are CPU copies, and a staged push measured 0.1-0.2x of
    the direct WRITE (benchmarks/README.md, "Staging through KvAgent").

    >>> p = StagingPolicy()
    >>> p.decide(4086, 4086 * 65536, "VRAM", "VRAM"), p.decide(32, 256 << 20, "VRAM", "VRAM")
    (True, False)
    >>> p.decide(4086, 4086 * 65536, "DRAM", "DRAM"), p.decide(32, 256 << 20, "DRAM", "VRAM")
    (False, True)
    >>> StagingPolicy.never().decide(4086, 1 << 20, "VRAM", "DRAM")
    False
    >>> StagingPolicy.from_env({"KVLC_STAGING": "always", "KVLC_STAGING_SLOTS": "8"}).slots
    8

    ``slot_bytes`` x ``slots``: each bounce buffer (one outbox per agent, one inbox per sending
    peer; ``slot_bytes`` None: 32 MiB in VRAM, 4 MiB in DRAM). ``peers``: how many sending peers
    get an inbox (the inboxes are registered together when the agent is created, so that its
    NIXL metadata covers them; a peer beyond that is not staged to). ``bounce``: where buffers live: ``auto`` (VRAM on the device of the agent's first VRAM
    storage, else on the current GPU if there is one, else DRAM), ``DRAM`` or ``VRAM``.
    ``direct_min_bytes``: a chunk whose source ranges are this long on average, on the outbox's
    memory, is written from them without a gather (0: always gather; :mod:`kvlc.runtime.staging.direct`).
    :meth:`from_env` reads ``KVLC_STAGING`` (auto|always|never), ``KVLC_STAGING_SLOT_BYTES``,
    ``KVLC_STAGING_SLOTS``, ``KVLC_STAGING_PEERS`` and ``KVLC_STAGING_DIRECT_BYTES`` (what
    :class:`~kvlc.runtime.agent.KvAgent` uses when given no policy).
    """

    mode: StageMode = StageMode.AUTO
    min_descriptors: int = 256
    max_mean_bytes: int = 512 << 10
    mixed: bool = True
    slot_bytes: int | None = None
    slots: int = DEFAULT_SLOTS
    bounce: str = "auto"
    peers: int = 4
    fragmented_dram: bool = False
    direct_min_bytes: int = DIRECT_MIN_BYTES

    @classmethod
    def never(cls) -> StagingPolicy:
        return cls(mode=StageMode.NEVER)

    @classmethod
    def always(cls, **kw) -> StagingPolicy:
        return cls(mode=StageMode.ALWAYS, **kw)

    @classmethod
    def from_env(cls, environ=None) -> StagingPolicy:
        """The policy ``KVLC_STAGING*`` variables describe (the defaults where unset)."""
        env = os.environ if environ is None else environ
        kw: dict = {}
        if env.get("KVLC_STAGING"):
            kw["mode"] = env["KVLC_STAGING"].strip().lower()
        for var, name in (("KVLC_STAGING_SLOT_BYTES", "slot_bytes"), ("KVLC_STAGING_SLOTS", "slots"),
                          ("KVLC_STAGING_PEERS", "peers"), ("KVLC_STAGING_DIRECT_BYTES", "direct_min_bytes")):
            if env.get(var):
                try:
                    kw[name] = int(env[var])
                except ValueError:
                    raise KvlcError(f"${var}: expected an integer, got {env[var]!r}") from None
        return cls(**kw)

    def __post_init__(self) -> None:
        self._check_mode()
        self._check_integers()
        self._check_bounds()

    def _check_mode(self) -> None:
        """Coerce ``mode`` to a StageMode, or say which values there are."""
        try:
            object.__setattr__(self, "mode", StageMode(self.mode))
        except ValueError:
            raise KvlcError(f"StagingPolicy.mode: got {self.mode!r}; use one of "
                            f"{[m.value for m in StageMode]}") from None

    def _check_integers(self) -> None:
        """Every integer field is an int (not a bool) of at least its lower bound; slot_bytes may be None."""
        for name, low in _INTEGER_FIELDS:
            v = getattr(self, name)
            if v is None and name == "slot_bytes":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise KvlcError(f"StagingPolicy.{name}: expected a positive integer (at least {low}), got {v!r}")

    def _check_bounds(self) -> None:
        """The upper bounds of slots, slot bytes and peers, and the bounce buffers' memory."""
        if self.slots > 1024 or (self.slot_bytes or 0) > 1 << 31 or self.peers > 256:
            raise KvlcError(f"StagingPolicy: at most 1024 slots of at most 2 GiB, at most 256 peers; got "
                            f"{self.slots} of {self.slot_bytes} bytes, {self.peers} peers")
        if self.bounce not in ("auto", "DRAM", "VRAM"):
            raise KvlcError(f"StagingPolicy.bounce: got {self.bounce!r}; use 'auto', 'DRAM' or 'VRAM'")

    def decide(self, rows: int, nbytes: int, local_mem: str, remote_mem: str) -> bool:
        """Whether a part of ``rows`` descriptors and ``nbytes`` bytes should be staged."""
        if self.mode is not StageMode.AUTO or not rows:
            return self.mode is StageMode.ALWAYS and rows > 0
        if self.mixed and local_mem != remote_mem:
            return True
        if local_mem == remote_mem == "DRAM" and not self.fragmented_dram:
            return False
        return rows >= self.min_descriptors and nbytes / rows <= self.max_mean_bytes

    def needs_buffers(self, has_vram: bool) -> bool:
        """Whether an agent registers bounce buffers: ``always``, or ``auto`` where a part could be
        staged (VRAM here or on a peer, i.e. a GPU machine, or ``fragmented_dram``)."""
        if self.mode is not StageMode.AUTO:
            return self.mode is StageMode.ALWAYS
        return has_vram or self.fragmented_dram


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

    def view(self, first: int, n: int) -> BounceBuffer:
        """Slots ``first .. first + n - 1`` as a buffer of their own (shares the registration)."""
        if not (0 <= first and n >= 1 and first + n <= self.slots):
            raise KvlcError(f"bounce buffer: slots {first}..{first + n - 1} outside its {self.slots}")
        v = object.__new__(BounceBuffer)
        v.agent, v.slot_bytes, v.slots, v.stride = self.agent, self.slot_bytes, n, self.stride
        v.mem, v.device, v.registration = self.mem, self.device, None
        v.tensor = self.tensor[first * self.stride:(first + n) * self.stride]
        v.addr = self.addr + first * self.stride
        return v

    def info(self) -> BounceInfo:
        return BounceInfo(self.agent.name, self.addr, self.slot_bytes, self.stride, self.slots, self.mem,
                          self.device)

    def release(self) -> None:
        if self.registration is not None:  # a view: its buffer's owner releases the registration
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
    started: Any = None     # a timing CUDA event before the gather (traced runs only)
    direct: bool = False    # written from its source ranges, not gathered (kvlc.runtime.staging.direct)


@dataclass
class _Sending:
    req: str
    peer: str
    total: int
    deadline: float | None
    freed: int = 0
    failed: str = ""
    queued: int = 0         # chunks not yet gathered
    key: bytes = b""        # seals this request's messages (the session's key)


@dataclass(frozen=True)
class StageEvent:
    """What :meth:`StagingEndpoint.progress` reports: a request ``sent`` (every chunk scattered by the
    receiver), ``received`` (this side scattered every chunk), or ``failed`` with the reason."""

    kind: str
    req: str
    peer: str
    reason: str = ""
