"""The threads an agent runs, holding it only weakly, and what they need to clean up after it.

* :class:`Pump`: the progress loop (``progress="thread"``): every ``interval`` seconds it takes
  the agent from a weak reference, advances it once, and lets go again, so a dropped agent is
  collected and its finalizer runs.
* :class:`Sender`: side-channel requests that must not block the engine (pull requests,
  cancels) run here; their replies wait in a queue until the agent's next pump applies them.
* :class:`Resources`: what a :class:`~kvlc.runtime.agent.KvAgent` owns outside Python (NIXL
  agent, side-channel server, client connections, the threads); ``weakref.finalize`` calls
  :meth:`Resources.close` if the agent is dropped without ``close()``; closing twice is harmless.
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvlc.errors import KvlcError

log = logging.getLogger("kvlc.runtime.pump")


class Pump:
    """Call ``ref().<method>()`` every ``interval`` seconds until the agent is gone or ``stop`` is set;
    every ``busy_interval`` seconds instead while the method returns True (work that waits on this
    side's turns is in flight, e.g. staged chunks to scatter or to send); a float it returns is the
    wait before the next call (at most ``interval``). :meth:`wake` ends the current wait at once: work
    that no engine call follows (a transfer started for a peer's request) gets its turn now, not up to
    ``interval`` later."""

    def __init__(self, agent: Any, method: str, interval: float, stop: threading.Event, name: str,
                 busy_interval: float | None = None):
        ref = weakref.ref(agent)
        busy = interval if busy_interval is None else min(interval, busy_interval)
        self._wake = threading.Event()
        self.thread = threading.Thread(
            target=self._loop, args=(ref, method, interval, busy, stop, self._wake), name=name, daemon=True
        )
        self.thread.start()

    def wake(self) -> None:
        """Take the next turn now (or right after the one running: a wake during a turn is kept)."""
        self._wake.set()

    @staticmethod
    def _loop(ref, method: str, interval: float, busy_interval: float, stop: threading.Event,
              wake: threading.Event) -> None:
        while not stop.is_set():
            agent = ref()
            if agent is None:
                return
            busy = False
            wake.clear()  # before the turn: a wake() during it makes the wait below return at once
            try:
                busy = getattr(agent, method)()
            except Exception:  # keep progressing; poll() surfaces real failures
                log.exception("progress thread")
                stop.wait(0.1)
            del agent
            if isinstance(busy, float):  # how soon to come back
                wake.wait(min(busy, interval))
            else:
                wake.wait(busy_interval if busy else interval)


@dataclass(frozen=True)
class Combine:
    """How queued jobs of one kind travel together (:meth:`Sender.send`): their payloads are message
    objects; ``one`` frames a job sent alone, ``many`` frames up to ``most`` of them at once, ``split``
    turns the decoded answer to ``many`` into one result per job, in order."""

    most: int
    one: Callable[[Any], bytes]
    many: Callable[[list], bytes]
    split: Callable[[Any, int], list]


_NOTHING = object()


@dataclass(frozen=True)
class _Posted:
    """A frame already written (:meth:`Sender.send_now`): the lane finishes its write, reads its reply."""

    ticket: Any
    context: Any


class _Lane:
    """One connection's queue and thread; ``unsent`` counts the jobs queued whose frames are not written
    yet (under the sender's lock): a frame written at once must not pass them."""

    def __init__(self, jobs: queue.Queue, thread: threading.Thread):
        self.jobs = jobs
        self.thread = thread
        self.unsent = 0


class Sender:
    """Side-channel frames that must not block the engine, sent in order per connection, one thread per
    connection (a stopped peer delays only its own frames); replies go to :attr:`replies`.

    A job is ``(client, make_payload, context)``: ``make_payload()`` runs at send time (so a
    deadline's remaining budget is computed then), the reply (decoded by ``decode``) or the
    exception lands in ``replies`` as ``(context, reply_or_exception)``. Jobs sent with the same
    :class:`Combine` that wait in a connection's queue together go in one frame (one round trip),
    in order; a job of another kind ends the group and is sent after it. :meth:`send_now` writes the
    frame on the caller's thread where that never waits (the lane only reads the reply): the engine's
    thread then does not wait for the lane's turn at the interpreter.
    """

    def __init__(self, decode: Callable[[bytes], Any], stop: threading.Event, name: str):
        self.replies: deque = deque()
        self._decode = decode
        self._stop = stop
        self._name = name
        self._lanes: dict[int, _Lane] = {}
        self._lock = threading.Lock()

    def _lane(self, client) -> _Lane:
        """``client``'s lane, started on first use (the caller holds the lock)."""
        lane = self._lanes.get(id(client))
        if lane is None:
            q: queue.Queue = queue.Queue()
            lane = _Lane(q, threading.Thread(target=self._loop, args=(client, q), daemon=True,
                                             name=f"{self._name}-{len(self._lanes)}"))
            self._lanes[id(client)] = lane
            lane.thread.start()
        return lane

    def send(self, client, make_payload: Callable[[], Any], context: Any, combine: Combine | None = None) -> None:
        with self._lock:
            lane = self._lane(client)
            lane.unsent += 1
            lane.jobs.put((make_payload, context, combine))

    def send_now(self, client, make_payload: Callable[[], Any], context: Any, combine: Combine | None = None) -> None:
        """As :meth:`send`, but the frame is written here and now where that cannot wait (nothing of this
        connection queued unwritten before it, no other writer, the connection open), else it is queued; what
        of it the socket does not take at once, the lane writes. The lane reads the reply either way."""
        with self._lock:
            lane = self._lane(client)
            ticket = None
            if lane.unsent == 0:
                payload = make_payload()
                try:
                    ticket = client.post(payload if combine is None else combine.one(payload), block=False)
                except Exception as exc:  # ChannelError: the connection broke; reported as the lane reports it
                    self.replies.append((context, exc))
                    return
            if ticket is None:
                lane.unsent += 1
                lane.jobs.put((make_payload, context, combine))
                return
            lane.unsent += bool(ticket.rest)
            lane.jobs.put(_Posted(ticket, context))

    def retire(self, client) -> None:
        """``client``'s connection is done: its lane sends what it has queued, then its thread ends."""
        with self._lock:
            lane = self._lanes.pop(id(client), None)
        if lane is not None:
            lane.jobs.put(None)

    @property
    def pending(self) -> int:
        return sum(lane.jobs.qsize() for lane in self._lanes.values())

    def _loop(self, client, jobs: queue.Queue) -> None:
        held: Any = _NOTHING  # a job taken while gathering a group it does not belong to: next
        while not self._stop.is_set():
            if held is not _NOTHING:
                job, held = held, _NOTHING
            else:
                try:
                    job = jobs.get(timeout=0.1)
                except queue.Empty:
                    continue
            if job is None:
                return
            if isinstance(job, _Posted):
                self.replies.append((job.context, self._answer(client, job.ticket)))
                continue
            group = [job]
            combine = job[2]
            while combine is not None and len(group) < combine.most:
                try:
                    nxt = jobs.get_nowait()
                except queue.Empty:
                    break
                if nxt is None or isinstance(nxt, _Posted) or nxt[2] is not combine:
                    held = nxt
                    break
                group.append(nxt)
            for context, result in zip((j[1] for j in group), self._run(client, group)):
                self.replies.append((context, result))

    def _written(self, client, n: int) -> None:
        """``n`` queued frames of ``client`` are written (or failed): frames may go at once again."""
        with self._lock:
            lane = self._lanes.get(id(client))
            if lane is not None:
                lane.unsent -= n

    def _answer(self, client, ticket) -> Any:
        """The decoded reply to a frame written by :meth:`send_now` (its rest written first), or the error."""
        try:
            if ticket.rest:
                try:
                    client.finish(ticket)
                finally:
                    self._written(client, 1)
            return self._decode(client.wait(ticket))
        except Exception as exc:
            return exc

    def _run(self, client, group: list) -> list:
        combine = group[0][2]
        try:
            try:
                if combine is None:
                    frame = group[0][0]()
                elif len(group) == 1:
                    frame = combine.one(group[0][0]())
                else:
                    frame = combine.many([j[0]() for j in group])
                ticket = client.post(frame)
            finally:
                self._written(client, len(group))
            reply = self._decode(client.wait(ticket))
            return [reply] if combine is None or len(group) == 1 else combine.split(reply, len(group))
        except Exception as exc:  # ChannelError, HandshakeError, a refused connection: every job of the frame
            return [exc] * len(group)

    def close(self) -> None:
        with self._lock:
            lanes = list(self._lanes.values())
        for lane in lanes:
            lane.jobs.put(None)
        for lane in lanes:
            if lane.thread is not threading.current_thread():
                lane.thread.join(timeout=5)


class Resources:
    """Everything to release when an agent ends (see the module docstring)."""

    def __init__(self, nixl: Any, name: str):
        self.nixl = nixl
        self.name = name
        self.stop = threading.Event()
        self.server = None
        self.clients: list = []
        self.sender: Sender | None = None
        self.pump: Pump | None = None
        self.executor = None
        self.stager = None
        self.route = None  # same-host copies (kvlc.runtime.ipc.route): unmapped after the transfers end
        self.bells: dict[str, list] = {}  # peer NIXL agent → the doorbells this agent offered it (ipc.bell)
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.stop.set()
        if self.pump is not None:
            self.pump.wake()  # its wait ends now; it sees stop
        if self.server is not None:
            self.server.close()
        if self.sender is not None:
            self.sender.close()
        if self.pump is not None and self.pump.thread is not threading.current_thread():
            self.pump.thread.join(timeout=5)
        if self.executor is not None:
            self.executor.cancel_all(f"agent '{self.name}' closed")
        if self.route is not None:
            self.route.close()
        for bells in self.bells.values():
            for bell in bells:
                bell.close()
        self.bells.clear()
        for c in self.clients:
            c.close()
        if self.stager is not None:
            try:
                self.stager.close()
            except KvlcError as exc:  # the agent's close below releases what is left
                log.warning("close: staging: %s", exc)
        for problem in self.nixl.close():
            log.warning("close: %s", problem)
