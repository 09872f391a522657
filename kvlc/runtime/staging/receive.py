"""The receiving half of a :class:`~kvlc.runtime.staging.endpoint.StagingEndpoint`: check, scatter, answer.

A LANDED chunk is scattered only when its slot, size and every destination range check out
against this agent's own inbox and registered regions, and only once (a chunk that arrives
twice is dropped); its slot is given back (FREE) only after the scatter completed. Requests
the sender gave up, or this side refused, are remembered (bounded) so their late chunks are
answered without a byte scattered.
"""

from __future__ import annotations

import logging

from kvlc.errors import KvlcError

from kvlc.runtime.staging.buffers import StageEvent
from kvlc.runtime.staging.copy import StagingError
from kvlc.runtime.staging.wire import Kind, Message, decode, encode, is_staging, verify

log = logging.getLogger("kvlc.runtime.staging.endpoint")

_FORGET = 1 << 14


class Receiver:
    """Mixin: the attributes it uses are set by :class:`~kvlc.runtime.staging.endpoint.StagingEndpoint`."""

    def handle(self, sender: str, raw: bytes, key: bytes = b"") -> bool:
        """Take one notification; False if it is not a staging message. Bad ones (malformed, or not sealed
        with ``key``) are logged and dropped."""
        if not is_staging(raw):
            return False
        try:
            m = decode(raw)
        except StagingError as exc:
            log.warning("staging message from %r dropped: %s", sender[:64], exc)
            return True
        if not verify(m, key):
            log.warning("staging message from %r dropped: its tag does not verify", sender[:64])
            return True
        self.take(sender, m, key)
        return True

    def take(self, sender: str, m: Message, key: bytes = b"") -> None:
        """Apply one decoded message whose tag verified under ``key`` (answers are sealed with it)."""
        try:
            if m.kind is Kind.LANDED:
                self._landed(sender, m, key)
            elif m.kind is Kind.FREE:
                self._freed(sender, m)
            elif (m.req, sender) in self._sending:
                self._refused(sender, m)
            else:
                self._forget((sender, m.req))
                self._receiving.pop((sender, m.req), None)
                self.events.append(StageEvent("failed", m.req, sender, f"sender gave up: {m.reason}"))
        except StagingError as exc:
            log.warning("staging message from %r refused: %s", sender[:64], exc)
            if m.kind is Kind.LANDED:  # tell the sender, and give its slot back: nothing was scattered
                self._forget((sender, m.req))
                self._receiving.pop((sender, m.req), None)
                self.events.append(StageEvent("failed", m.req, sender, str(exc)))
                self.agent.send_notif(sender, encode(Message(Kind.FAIL, m.req, m.seq, m.total, m.slot,
                                                             reason=f"refused by the receiver: {exc}"), key))

    def _forget(self, key: tuple[str, str]) -> None:
        """Remember a failed incoming request (its late chunks are answered, not scattered); bounded."""
        self._failed_in[key] = None
        while len(self._failed_in) > _FORGET:
            self._failed_in.popitem(last=False)

    def _landed(self, sender: str, m: Message, key: bytes) -> None:
        inbox = self.inboxes.get(sender)
        if inbox is None:
            raise StagingError(f"'{sender}' sent a chunk but has no inbox here")
        if m.slot >= inbox.slots:
            raise StagingError(f"chunk in slot {m.slot}; the inbox has {inbox.slots}")
        if m.nbytes > inbox.slot_bytes:
            raise StagingError(f"chunk of {m.nbytes} bytes; a slot holds {inbox.slot_bytes}")
        if (sender, m.req) in self._failed_in:
            self._answer(sender, m, key)
            return
        self._last_in = self.clock()
        if self.trace:
            self.trace("landed", m.req, m.seq, m.slot, m.nbytes, sender)
        got = self._receiving.get((sender, m.req), ())
        if m.seq in got or any((s, x.req, x.seq) == (sender, m.req, m.seq) for s, x, _, _ in self._scattering):
            log.warning("staging: chunk %d of %r from %r arrived twice; the copy is dropped", m.seq,
                        m.req[:40], sender[:64])
            return
        rows = inbox.ranges(m.slot, m.nbytes, m.nrows).cpu().numpy().copy().view("<u8").reshape(-1, 2)
        total = sum(int(n) for n in rows[:, 1])  # Python ints: a sum that wraps in uint64 does not pass
        if total != m.nbytes:
            raise StagingError(f"chunk {m.seq}: its ranges add up to {total} bytes, the message says {m.nbytes}")
        if self.trace:
            self.trace("ranges", m.req, m.seq, m.slot, m.nbytes, sender)
            self._scatter_started[(sender, m.req, m.seq)] = self._record(timing=True)
        try:
            self.copier.scatter(inbox.slot(m.slot, m.nbytes), rows)
        except StagingError:
            raise
        except Exception as exc:  # whatever a peer's ranges make the copy raise is a refusal, not a crash
            raise StagingError(f"chunk {m.seq}: the scatter failed: {type(exc).__name__}: {exc}") from exc
        if self.trace:
            self.trace("scatter", m.req, m.seq, m.slot, m.nbytes, sender)
        self._scattering.append((sender, m, self._record(timing=bool(self.trace)), key))

    def discard(self, sender: str, m: Message, key: bytes = b"") -> None:
        """A chunk the receiver will not scatter (its request ended here): only give its slot back."""
        if m.kind is Kind.LANDED and sender in self.inboxes and m.slot < self.inboxes[sender].slots:
            self._answer(sender, m, key)

    def scattering(self, req: str) -> bool:
        """Whether a scatter of ``req`` may still be writing (queued on the GPU, not yet complete)."""
        return any(m.req == req for _, m, _, _ in self._scattering)

    def _answer(self, sender: str, m: Message, key: bytes) -> None:
        try:
            self.agent.send_notif(sender, encode(Message(Kind.FREE, m.req, m.seq, m.total, m.slot), key))
        except KvlcError as exc:  # the sender is gone: its slots do not matter any more
            log.warning("staging: FREE of chunk %d of %r to %r not sent: %s", m.seq, m.req[:40], sender[:64], exc)

    def _check_scatters(self) -> None:
        still = []
        for sender, m, ev, key in self._scattering:
            if ev is not None and not ev.query():
                still.append((sender, m, ev, key))
                continue
            if self.trace:
                self.trace("scattered", m.req, m.seq, m.slot, m.nbytes, sender)
                self.trace.gpu_time("scatter_gpu", m.req, m.seq,
                                    self._scatter_started.pop((sender, m.req, m.seq), None), ev, sender)
            self._answer(sender, m, key)  # the slot is free again only once its bytes are in place
            self.stats["chunks_received"] += 1
            key = (sender, m.req)
            if key in self._failed_in:
                continue
            got = self._receiving.setdefault(key, set())
            got.add(m.seq)
            if len(got) == m.total:
                del self._receiving[key]
                self.events.append(StageEvent("received", m.req, sender))
        self._scattering = still

