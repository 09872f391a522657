"""Staging through bounce buffers: gather, one WRITE per chunk, scatter on the receiver before ``done``.

Two cases make NIXL slow where a bounce buffer makes it fast (measured on an H200, see
benchmarks/README.md): many small descriptors (UCX posts each one serially, ~5.7 us apiece) and
DRAM <-> VRAM between processes (UCX emulates it over TCP). Staging turns either into copies the
GPU's engines do well plus one large WRITE:

1. the sender gathers a request's source ranges, chunk by chunk, into a slot of its own bounce
   buffer (one indexed copy per run of equal ranges, side CUDA stream; :mod:`kvlc.runtime.staging.copy`);
   a chunk of few, large ranges skips the gather (:mod:`kvlc.runtime.staging.direct`);
2. once the gather's event completes, ONE WRITE moves the slot (or those ranges) into a slot of the
   receiver's bounce buffer, with a LANDED notification attached that NIXL delivers once the bytes are there
   (no round trip through the sender): it carries the chunk's size (its destination ranges travel
   in the same WRITE, behind the data; :mod:`kvlc.runtime.staging.wire`);
3. the receiver checks every range lies inside its registered regions, scatters the slot into
   them (side stream), and only when that copy completed answers FREE; the request is complete on
   the receiver after the scatter of its last chunk, and on the sender once every chunk is FREE.

Buffers are bounded and registered once: ``slots`` x ``slot_bytes`` per buffer (a sender's one
outbox, one inbox per sending peer on a receiver); a request larger than that streams through the
slots (a slot is written again only after FREE): consecutive chunks' copies and WRITEs overlap.

It takes descriptor rows ((N, 2) or (N, 3) uint64 addr, len[, dev], row i of the source paired
with row i of the destination, as the compiler's ``instantiate`` gives them) and does no layout
arithmetic beyond cutting ranges at chunk boundaries. :class:`StagingPolicy` says when to stage.
Without a GPU everything runs in DRAM (synchronous copies), which is how CI tests it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import numpy as np

from kvlc.errors import KvlcError
from kvlc.runtime.nixl.core import XferState
from kvlc.runtime.staging.copy import Copier, Regions, StagingError
from kvlc.runtime.staging.direct import DIRECT_MIN_BYTES, chunk_rows, goes_direct
from kvlc.runtime.staging.buffers import (
    DEFAULT_SLOT_BYTES,
    DEFAULT_SLOTS,
    BounceBuffer,
    StageMode,
    StageEvent,
    StagingPolicy,
    _Chunk,
    _Sending,
    split_chunks,
)
from kvlc.runtime.staging.receive import Receiver
from kvlc.runtime.staging.trace import from_env as _trace_from_env
from kvlc.runtime.staging.wire import BounceInfo, Kind, Message, encode

log = logging.getLogger("kvlc.runtime.staging.endpoint")

class StagingEndpoint(Receiver):
    """One agent's staging engine: sends through its outbox, receives into one inbox per peer.

    ``agent`` is a :class:`~kvlc.runtime.nixl.core.Agent`; ``regions`` the registered memory the
    transfers read from and scatter into. Call :meth:`handle` with every notification (it returns
    False for those that are not staging messages) and :meth:`progress` in the engine's loop.
    """

    def __init__(self, agent: Any, regions: Regions, outbox: BounceBuffer | None,
                 clock: Callable[[], float] = time.monotonic, prepped: bool = True, device: int | None = None,
                 direct_min_bytes: int = DIRECT_MIN_BYTES):
        self.agent, self.regions, self.outbox, self.clock = agent, regions, outbox, clock
        self.direct_min_bytes = direct_min_bytes  # chunks of ranges this long on average skip the gather
        if device is None and outbox is not None and outbox.mem == "VRAM":
            device = outbox.device
        self.stream = None
        if device is not None:  # copies on a side stream of that GPU
            import torch

            self.stream = torch.cuda.Stream(device=device)
        self.copier = Copier(regions, self.stream)
        if self.stream is not None:
            import torch

            self.copier.warm(torch.device("cuda", device))
        split_chunks(np.zeros((1, 2), np.uint64) + 8, np.zeros((1, 2), np.uint64) + 8, 64)  # numpy's lazy imports
        self.peers: dict[str, BounceInfo] = {}          # sending: the peer's inbox for us
        self.inboxes: dict[str, BounceBuffer] = {}      # receiving: our inbox for that peer
        self._queue: deque[_Chunk] = deque()
        self._free_local: deque[int] = deque(range(outbox.slots)) if outbox else deque()
        self._free_remote: dict[str, deque[int]] = {}
        self._lent: dict[tuple[str, int], tuple[str, int]] = {}  # (peer, its slot) → (req, seq) written there
        self._gathering: list[_Chunk] = []
        self._writing: list[_Chunk] = []
        self._sending: dict[tuple[str, str], _Sending] = {}   # (req, peer) -> what is still to send
        self._scattering: list[tuple[str, Message, Any, bytes]] = []
        self._receiving: dict[tuple[str, str], set[int]] = {}
        self._failed_in: OrderedDict[tuple[str, str], None] = OrderedDict()  # bounded (staging_recv)
        self.events: list[StageEvent] = []
        self.prepped = prepped
        self._lists: dict[str, tuple[Any, Any, int]] = {}  # peer -> (local slots, remote slots, bytes each)
        self.stats = {"chunks_sent": 0, "chunks_received": 0, "bytes_sent": 0, "chunks_direct": 0}
        self._last_in = 0.0  # clock() of the last LANDED taken
        self._scatter_started: dict[tuple[str, str, int], Any] = {}  # traced runs: timing event per scatter
        self.trace = _trace_from_env(str(getattr(agent, "name", "")))  # None unless KVLC_STAGING_TRACE names a folder

    # ------------------------------------------------------------------ setup
    def set_outbox(self, outbox: BounceBuffer) -> None:
        """Send through ``outbox`` (once, before the first :meth:`add_peer` that prepares lists)."""
        if self.outbox is not None:
            raise StagingError("this endpoint has an outbox already")
        self.outbox = outbox
        self._free_local = deque(range(outbox.slots))

    def drop_peer(self, peer: str, inbox: bool = True) -> None:
        """Forget ``peer`` (its session ended): its prepared lists go; its inbox here too (``inbox``)."""
        self.peers.pop(peer, None)
        self._free_remote.pop(peer, None)
        self._lent = {k: v for k, v in self._lent.items() if k[0] != peer}
        for h in self._lists.pop(peer, (None, None))[:2]:
            if h is not None:
                h.release()
        buf = self.inboxes.pop(peer, None) if inbox else None
        if buf is not None:
            buf.release()

    def add_peer(self, info: BounceInfo) -> None:
        """Send to ``info.agent`` through its inbox (its NIXL metadata must be loaded already).

        Prepares, once, a list of whole slots on each side: a chunk that fills at least half a slot
        is then one ``make_prepped`` WRITE of the whole slot (no per-chunk descriptor resolution).
        """
        self.peers[info.agent] = info
        self._free_remote[info.agent] = deque(range(info.slots))
        if self.outbox is not None and self.prepped:
            o = self.outbox
            whole = min(o.stride, info.stride)
            local = np.array([[o.addr + i * o.stride, whole, o.device] for i in range(o.slots)], dtype=np.uint64)
            remote = np.array([[info.slot_addr(i), whole, info.device] for i in range(info.slots)], dtype=np.uint64)
            self._lists[info.agent] = (self.agent.prep(None, local, o.mem),
                                       self.agent.prep(info.agent, remote, info.mem), whole)

    def accept_from(self, peer: str, inbox: BounceBuffer) -> BounceInfo:
        """Receive from ``peer`` into ``inbox``; returns what that peer needs (:meth:`add_peer`)."""
        self.inboxes[peer] = inbox
        return inbox.info()

    # ------------------------------------------------------------------ sending
    def send(self, req: str, local_rows: np.ndarray, remote_rows: np.ndarray, peer: str,
             timeout: float | None = None, key: bytes = b"") -> int:
        """Stage one request to ``peer``: source ranges ``local_rows`` to ``remote_rows``; its messages are
        sealed with ``key`` (the session's). Returns the number of chunks."""
        if self.outbox is None:
            raise StagingError("this endpoint has no outbox: create it with a BounceBuffer to send")
        if peer not in self.peers:
            raise StagingError(f"no inbox known on '{peer}': call add_peer with its BounceInfo first")
        if (req, peer) in self._sending:
            raise StagingError(f"staged request '{req}' to '{peer}' is already in flight")
        local = np.asarray(local_rows, dtype=np.uint64)[:, :2]
        remote = np.asarray(remote_rows, dtype=np.uint64)[:, :2]
        if local.shape != remote.shape or not len(local):
            raise StagingError(f"need equal, non-zero row counts; got {local.shape} and {remote.shape}")
        where = self.regions.locate(local, "source range")
        # Rows of one length (then one region) next to each other: one indexed copy each, not one copy per
        # row (a request lists its rows block by block, alternating regions). Destinations never overlap.
        order = np.lexsort((where, local[:, 1]))
        local, remote = local[order], remote[order]
        size = min(self.outbox.slot_bytes, self.peers[peer].slot_bytes)
        chunks = split_chunks(local, remote, size)
        now = self.clock()
        self._sending[(req, peer)] = _Sending(req, peer, len(chunks), None if timeout is None else now + timeout,
                                              queued=len(chunks), key=key)
        for seq, (lr, rr) in enumerate(chunks):
            self._queue.append(_Chunk(req, peer, seq, len(chunks), lr, rr, int(lr[:, 1].sum())))
            if self.trace:
                self.trace("queued", req, seq, nbytes=int(lr[:, 1].sum()), peer=peer)
        return len(chunks)

    def _start_gathers(self) -> None:
        while self._queue and self._free_local:
            c = self._queue[0]
            s = self._sending[(c.req, c.peer)]
            if not s.failed and not self._free_remote[c.peer]:
                return
            self._queue.popleft()
            s.queued -= 1
            if s.failed:
                self._maybe_finish(s)
                continue
            c.slot = self._free_local.popleft()
            c.remote_slot = self._free_remote[c.peer].popleft()
            self._lent[(c.peer, c.remote_slot)] = (c.req, c.seq)
            if self.trace:
                self.trace("gather", c.req, c.seq, c.slot, c.nbytes, c.peer)
                c.started = self._record(timing=True)
            c.direct = goes_direct(self.regions, c, self.outbox, self.direct_min_bytes)
            self.stats["chunks_direct"] += c.direct
            if not c.direct:
                self.copier.gather(c.local, self.outbox.slot(c.slot, c.nbytes))
            self._put_ranges(c)
            c.event = self._record(timing=c.started is not None)
            self._gathering.append(c)

    def _put_ranges(self, c: _Chunk) -> None:
        """Write the chunk's destination ranges behind its data: the one WRITE carries both."""
        import torch

        dst = self.outbox.ranges(c.slot, c.nbytes, len(c.remote))
        if self.stream is not None:  # through pinned memory: the host does not wait for the stream
            self.copier.upload_into(np.ascontiguousarray(c.remote, dtype="<u8").view(np.int64).reshape(-1), dst)
        else:
            dst.copy_(torch.from_numpy(np.ascontiguousarray(c.remote, dtype="<u8").view(np.uint8).reshape(-1)))

    def _record(self, timing: bool = False) -> Any:
        if self.stream is None:
            return None
        import torch

        ev = torch.cuda.Event(enable_timing=timing)
        ev.record(self.stream)
        return ev

    def _post_writes(self) -> None:
        still = []
        for c in self._gathering:
            if c.event is not None and not c.event.query():
                still.append(c)
                continue
            s = self._sending.get((c.req, c.peer))
            if s is None or s.failed:  # given up while gathering: nothing more is written for it
                self._chunk_failed(c)
                continue
            if self.trace:
                self.trace("gathered", c.req, c.seq, c.slot, c.nbytes, c.peer)
                self.trace.gpu_time("gather_gpu", c.req, c.seq, c.started, c.event, c.peer)
            try:
                c.xfer = self._create_write(c)
                # LANDED rides on the WRITE: NIXL delivers it once the bytes are in the peer's slot
                state = self.agent.post(c.xfer, self._landed_msg(c, s))
                if self.trace:
                    self.trace("posted", c.req, c.seq, c.remote_slot, c.nbytes, c.peer)
            except KvlcError as exc:
                state, c.xfer = XferState.ERR, None
                self._fail(s, f"chunk {c.seq}: {exc}")
            if state is XferState.ERR:
                self._chunk_failed(c)
            else:
                self._writing.append(c)
        self._gathering = still

    def _create_write(self, c: _Chunk) -> Any:
        """The NIXL WRITE of chunk ``c`` into the peer's slot (a gathered chunk filling at least half a slot:
        the prepared whole-slot lists, no per-chunk resolution)."""
        info, what = self.peers[c.peer], f"staged '{c.req}' chunk {c.seq}"
        lrow, rrow = chunk_rows(c, self.outbox, info)
        lists = None if c.direct else self._lists.get(c.peer)
        if lists is not None and 2 * int(lrow[0, 1]) >= lists[2]:
            return self.agent.make_prepped("WRITE", lists[0], np.array([c.slot]), lists[1], np.array([c.remote_slot]),
                                           what=what)
        return self.agent.initialize("WRITE", lrow, self.outbox.mem, rrow, info.mem, c.peer, what=what)

    @staticmethod
    def _landed_msg(c: _Chunk, s: _Sending) -> bytes:  # sealed; slot, size, rows of what lands
        return encode(Message(Kind.LANDED, c.req, c.seq, c.total, c.remote_slot, nbytes=c.nbytes,
                              nrows=len(c.remote)), s.key)

    def _check_writes(self) -> None:
        still = []
        for c in self._writing:
            state = self.agent.state(c.xfer)
            if state is XferState.PROC:
                still.append(c)
                continue
            if state is XferState.ERR:
                self._chunk_failed(c)
                continue
            c.xfer.release()
            self._free_local.append(c.slot)
            if self.trace:
                self.trace("written", c.req, c.seq, c.remote_slot, c.nbytes, c.peer)
            self.stats["chunks_sent"] += 1
            self.stats["bytes_sent"] += c.nbytes
        self._writing = still

    def release_writes(self) -> None:
        """Release the handles of staged WRITEs still in flight (closing: nothing is sent after this)."""
        for c in self._writing:
            c.xfer.release()
        self._writing = []

    def _chunk_failed(self, c: _Chunk) -> None:
        """A WRITE ended in ERR: nothing more lands in its slots, so both come back at once."""
        why = (c.xfer.error if c.xfer is not None else "") or "WRITE failed"
        if c.xfer is not None:
            c.xfer.release()
        self._free_local.append(c.slot)
        if self._lent.get((c.peer, c.remote_slot)) == (c.req, c.seq):  # (not FREEd already)
            del self._lent[(c.peer, c.remote_slot)]
            self._free_remote[c.peer].append(c.remote_slot)
        s = self._sending.get((c.req, c.peer))
        if s is not None:  # (None: every chunk was FREEd already, the request is over)
            s.freed += 1
            self._fail(s, f"chunk {c.seq}: {why}")

    def _fail(self, s: _Sending, why: str) -> None:
        if not s.failed:
            s.failed = why
            try:
                self.agent.send_notif(s.peer, encode(Message(Kind.FAIL, s.req, reason=why), s.key))
            except KvlcError:
                pass  # the receiver may be gone; the request fails either way
        self._maybe_finish(s)

    def _maybe_finish(self, s: _Sending) -> None:
        inflight = any(c.req == s.req and c.peer == s.peer for c in self._gathering + self._writing)
        if s.failed and not inflight and s.queued == 0:
            # chunks LANDED but not yet FREE still hold remote slots; their FREE arrives later
            if self._sending.pop((s.req, s.peer), None) is not None:
                self.events.append(StageEvent("failed", s.req, s.peer, s.failed))
        elif not s.failed and s.freed == s.total:
            if self._sending.pop((s.req, s.peer), None) is not None:
                self.events.append(StageEvent("sent", s.req, s.peer))

    def abort(self, req: str, peer: str, why: str) -> None:
        """Give a request to ``peer`` up: nothing more is gathered or posted; a ``failed`` event follows
        once none of its WRITEs is in flight (no byte can land after it)."""
        s = self._sending.get((req, peer))
        if s is not None and not s.failed:
            self._fail(s, why)

    def _refused(self, sender: str, m: Message) -> None:
        """The receiver refused a chunk of ours (FAIL naming its slot): the request fails, the slot is free."""
        s = self._sending[(m.req, sender)]
        if self._give_back(sender, m):
            s.freed += 1
        if not s.failed:
            s.failed = m.reason or "refused by the receiver"
        self._maybe_finish(s)

    def _give_back(self, sender: str, m: Message) -> bool:
        """The peer's slot ``m.slot`` is free again, if chunk ``m.seq`` of ``m.req`` is what it holds
        (a FREE answering a replayed or stale LANDED must not free a slot another chunk is using)."""
        if self._lent.get((sender, m.slot)) != (m.req, m.seq):
            log.warning("staging: %s of slot %d from %r for chunk %d of %r, which that slot does not hold; "
                        "ignored", m.kind.name, m.slot, sender[:64], m.seq, m.req[:40])
            return False
        del self._lent[(sender, m.slot)]
        self._free_remote[sender].append(m.slot)
        return True

    def _freed(self, sender: str, m: Message) -> None:
        if sender not in self._free_remote:
            raise StagingError(f"FREE of slot {m.slot} from '{sender}', which is not a peer")
        if not self._give_back(sender, m):
            return
        if self.trace:
            self.trace("freed", m.req, m.seq, m.slot, peer=sender)
        s = self._sending.get((m.req, sender))
        if s is not None:
            s.freed += 1
            self._maybe_finish(s)

    # ------------------------------------------------------------------ loop
    def progress(self) -> list[StageEvent]:
        """Advance every stage without blocking; return the events since the last call."""
        now = self.clock()
        for s in list(self._sending.values()):
            if s.deadline is not None and now >= s.deadline and not s.failed:
                self._fail(s, f"timed out with {s.total - s.freed} of {s.total} chunks not scattered")
        self._check_scatters()
        self._check_writes()
        self._post_writes()
        self._start_gathers()
        self._post_writes()
        for s in [s for s in self._sending.values() if s.failed]:
            self._maybe_finish(s)
        events, self.events = self.events, []
        return events

    def kick(self) -> None:
        """Start what can start now (gathers into free slots, WRITEs of gathered chunks)."""
        self._start_gathers()
        self._post_writes()

    @property
    def busy(self) -> bool:
        return bool(self._queue or self._gathering or self._writing or self._scattering or self._sending)

    HOT_S = 0.5  # a partly received request keeps the endpoint hot this long after its last chunk

    @property
    def hot(self) -> bool:
        """Busy, or a request's chunks arrived lately and more are due (worth polling often for)."""
        return self.busy or (bool(self._receiving) and self.clock() - self._last_in < self.HOT_S)


__all__ = ["StagingEndpoint", "StagingPolicy", "StageMode", "BounceBuffer", "BounceInfo", "StageEvent",
           "StagingError", "split_chunks", "Regions", "DEFAULT_SLOT_BYTES", "DEFAULT_SLOTS"]
