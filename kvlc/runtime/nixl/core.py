"""The one choke point for NIXL.

Every call into ``nixl._api`` goes through :func:`call` (or :func:`check` for a
returned value): exceptions, ``"ERR"`` statuses and ``None`` become a
:class:`~kvlc.runtime.errors.NixlError` that names the operation. Transfer
states come back as :class:`XferState`; no NIXL status string travels above
this module.

:class:`Agent` is a thin, thread-safe (one lock) wrapper over ``nixl_agent``.
Handles it returns (:class:`Xfer`, :class:`Prepped`, :class:`Registration`) own
their lifetime: ``release()`` is idempotent, and the agent counts live handles
so that tests can prove nothing leaked.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvlc.runtime.errors import NixlError
from kvlc.runtime.nixl.notes import SUFFIX, Notes, by_sender
from kvlc.runtime.nixl.status import MEM_TYPES, OPS, XferState, _rows, _state, _status_of, call, check, run
from kvlc.runtime.nixl.ucx import UcxOptions, create_backends


log = logging.getLogger("kvlc.runtime.nixl.core")
_FAST = {"DONE": XferState.DONE, "PROC": XferState.PROC}  # the states a healthy transfer reports


def _quiet_nixl() -> None:
    """NIXL logs every agent creation at INFO on stdout: keep it to warnings, at the first agent's
    creation (not at import), and only when the user set no level of their own."""
    if "NIXL_LOG_LEVEL" not in os.environ:
        os.environ["NIXL_LOG_LEVEL"] = "WARN"
        logging.getLogger("nixl").setLevel(logging.WARNING)


class _Handle:
    """Common idempotent-release bookkeeping for NIXL handles."""

    __slots__ = ("_agent", "_raw", "what", "released")

    def __init__(self, agent: Agent, raw: Any, what: str):
        self._agent = agent
        self._raw = raw
        self.what = what
        self.released = False
        agent._live.add(self)

    def _release_raw(self) -> None:
        self._raw.release()

    def release(self) -> None:
        """Free the handle; a second call does nothing. Raises :class:`NixlError` if NIXL refuses."""
        with self._agent._lock:
            if self.released:
                return
            run(f"release {self.what}", self._release_raw)
            self.released = True
            self._agent._live.discard(self)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.what}{' released' if self.released else ''}>"


class Xfer(_Handle):
    """A transfer request. ``error`` holds why it failed once its state is ERR."""

    __slots__ = ("error", "state")

    def __init__(self, agent: Agent, raw: Any, what: str):
        super().__init__(agent, raw, what)
        self.error: str | None = None
        self.state = XferState.PROC


class Prepped(_Handle):
    """A prepared descriptor list (``prep_xfer_dlist``)."""

    __slots__ = ("count",)

    def __init__(self, agent: Agent, raw: Any, what: str, count: int):
        super().__init__(agent, raw, what)
        self.count = count


class Registration(_Handle):
    """Registered memory; release deregisters it."""

    __slots__ = ()

    def _release_raw(self) -> None:
        self._agent._nixl.deregister_memory(self._raw)


PROCESS_LOCK = threading.RLock()  # every Agent's calls into NIXL, in this process (see Agent)


class Agent:
    """One NIXL agent: registration, metadata, descriptor lists, transfers, notifications.

    Every method takes one lock that every agent of this process shares (:data:`PROCESS_LOCK`), so
    the side-channel thread and the engine's thread may both use it, and two agents of one process
    (the ranks of an engine hosted together) never call NIXL at once: NIXL 1.5.1 crashed (a
    segmentation fault in ``initialize_xfer`` or ``send_notif``, about one run in six of
    ``test_sessions_e2e``) when two agents of one process were used from two threads. ``ucx``: the UCX backend's parameters
    (:class:`~kvlc.runtime.nixl.ucx.UcxOptions`; default: from ``KVLC_UCX_*`` variables, else
    NIXL's defaults); the backend is created here, after :func:`~kvlc.runtime.nixl.ucx.apply_env`
    set ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`` on a CUDA machine where the user had not set it.
    ``notes=True`` also creates the agent that carries ``done`` notifications (:mod:`kvlc.runtime.nixl.notes`):
    :meth:`send_done` goes through it to a peer whose notes agent was loaded (:meth:`add_remote_notes`), and
    :meth:`notifs` returns what came through both.
    """

    def __init__(
        self,
        name: str,
        backends: Sequence[str] = ("UCX",),
        *,
        telemetry: bool = False,
        progress_thread: bool = False,
        ucx: UcxOptions | None = None,
        notes: bool = False,
    ):
        _quiet_nixl()
        from nixl._api import nixl_agent, nixl_agent_config  # the only import of nixl in kvlc

        self.name = name
        self._lock = PROCESS_LOCK
        self._live: set[_Handle] = set()
        self._remotes: set[str] = set()
        # NIXL's progress thread busy-polls a core per agent; without it, transfers and notifications
        # progress whenever the agent is used (every KvAgent.poll()), which engines do in their loop.
        config = nixl_agent_config(enable_prog_thread=progress_thread, backends=[], capture_telemetry=telemetry)
        self._nixl = call(f"create agent {name!r}", nixl_agent, name, config)
        self.ucx = ucx or UcxOptions.from_env()
        self.backend_params = create_backends(self._nixl, name, backends, self.ucx, run)
        self.backends = tuple(backends)
        self.notes: Notes | None = None
        if notes:  # (no progress thread: its sends complete in the call, and every poll fetches what came)
            raw = call(f"create agent {name + SUFFIX!r}", nixl_agent, name + SUFFIX,
                       nixl_agent_config(enable_prog_thread=False, backends=[]))
            create_backends(raw, name + SUFFIX, ("UCX",), UcxOptions(), run)
            self.notes = Notes(raw, name + SUFFIX)
        self.closed = False

    @property
    def _n(self):
        if self._nixl is None:
            raise NixlError(f"use agent {self.name!r}", "closed", "the agent was closed")
        return self._nixl

    # ------------------------------------------------------------------ memory
    def register(self, rows: np.ndarray, mem: str, what: str = "memory") -> Registration:
        """Register (N, 3) rows (addr, len, dev) of memory type ``mem``; one handle for all rows."""
        rows = _rows(rows, f"register {what}")
        with self._lock:
            reg = call(f"register {what} ({mem})", self._n.register_memory, rows, mem)
            return Registration(self, reg, f"registration of {what}")

    # ------------------------------------------------------------------ metadata
    def metadata(self) -> bytes:
        with self._lock:
            return bytes(call("get agent metadata", self._n.get_agent_metadata))

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns the peer agent's name."""
        with self._lock:
            name = call("add remote agent", self._n.add_remote_agent, metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._remotes.add(name)
            return name

    def notes_metadata(self) -> bytes | None:
        """The metadata of this agent's notes agent (None: it has none)."""
        with self._lock:
            return None if self.notes is None else self.notes.metadata()

    def add_remote_notes(self, name: str, metadata: bytes) -> None:
        """Load the notes agent of peer ``name`` (loaded with :meth:`add_remote`): its ``done`` goes there from now
        on. Raises :class:`NixlError` (nothing loaded) when NIXL refuses it or it names another agent."""
        with self._lock:
            if self.notes is None or name not in self._remotes:
                why = "this agent has no notes agent" if self.notes is None else "its data agent is not loaded"
                raise NixlError(f"add the notes agent of {name!r}", "not loaded", why)
            self.notes.add(name, metadata)

    def remove_remote(self, name: str) -> None:
        """Forget a peer (idempotent), its notes agent too."""
        with self._lock:
            if self.notes is not None:
                self.notes.remove(name)
            if name in self._remotes:
                self._remotes.discard(name)
                run(f"remove remote agent {name!r}", self._n.remove_remote_agent, name)

    @property
    def remotes(self) -> frozenset[str]:
        return frozenset(self._remotes)

    # ------------------------------------------------------------------ descriptor lists
    def prep(self, agent_name: str | None, rows: np.ndarray, mem: str) -> Prepped:
        """Prepare a descriptor list once: local (``agent_name=None``) or of a remote agent.

        ``rows`` is (N, 3) (addr, len, dev) or strided (N, 5) (addr, len, dev, stride, count).
        """
        rows = _rows(rows, "prepare descriptor list", (3, 5))
        count = int(rows[:, 4].sum()) if rows.shape[1] == 5 else len(rows)
        target = "NIXL_INIT_AGENT" if agent_name is None else agent_name
        with self._lock:
            raw = call(f"prepare descriptor list for {target}", self._n.prep_xfer_dlist, target, rows, mem)
            return Prepped(self, raw, f"dlist {target}/{mem} ({count} descs)", count)

    def make_prepped(
        self,
        op: str,
        local: Prepped,
        local_idx: np.ndarray,
        remote: Prepped,
        remote_idx: np.ndarray,
        what: str = "transfer",
    ) -> Xfer:
        """A transfer from indices into two prepared lists (no notification attached)."""
        with self._lock:
            raw = call(
                f"make {op} {what}",
                self._n.make_prepped_xfer,
                op,
                local._raw,
                np.ascontiguousarray(local_idx, dtype=np.int32),
                remote._raw,
                np.ascontiguousarray(remote_idx, dtype=np.int32),
                b"",
            )
            return Xfer(self, raw, f"{op} {what}")

    def initialize(
        self,
        op: str,
        local_rows: np.ndarray,
        local_mem: str,
        remote_rows: np.ndarray,
        remote_mem: str,
        remote_agent: str,
        what: str = "transfer",
    ) -> Xfer:
        """A transfer from two row-aligned (N, 3) arrays (no notification attached)."""
        if op not in OPS:
            raise NixlError(f"create {what}", "bad operation", f"expected READ or WRITE, got {op!r}")
        lrows = _rows(local_rows, f"create {op} {what}")
        rrows = _rows(remote_rows, f"create {op} {what}")
        if len(lrows) != len(rrows) or not len(lrows):
            raise NixlError(
                f"create {op} {what}",
                "bad descriptors",
                f"{len(lrows)} local vs {len(rrows)} remote rows; need equal, non-zero counts",
            )
        with self._lock:
            ld = call(f"build local descriptors for {what}", self._n.get_xfer_descs, lrows, local_mem)
            rd = call(f"build remote descriptors for {what}", self._n.get_xfer_descs, rrows, remote_mem)
            raw = call(
                f"create {op} {what} to {remote_agent!r}",
                self._n.initialize_xfer,
                op,
                ld,
                rd,
                remote_agent,
                b"",
            )
            return Xfer(self, raw, f"{op} {what} to {remote_agent!r}")

    # ------------------------------------------------------------------ transfers
    def _advance(self, xfer: Xfer, verb: str, fn, *args) -> XferState:
        """Call ``fn`` (post or check), store the state on ``xfer``; ERR keeps its reason.

        The hot path: messages are only built when something failed."""
        try:
            value = fn(*args)
        except Exception as exc:  # NIXL raises its own exception types, plus ValueError/KeyError
            err = exc if isinstance(exc, NixlError) else NixlError(f"{verb} {xfer.what}", _status_of(exc))
            xfer.state, xfer.error = XferState.ERR, str(err)
            return xfer.state
        state = _FAST.get(value) if isinstance(value, str) else None
        if state is None:  # anything else takes the checked path (None, "ERR", unknown strings)
            try:
                state = _state(check(value, f"{verb} {xfer.what}"))
            except NixlError as exc:
                xfer.state, xfer.error = XferState.ERR, str(exc)
                return xfer.state
        xfer.state = state
        if state is XferState.ERR:
            xfer.error = (f"NIXL post {xfer.what} failed" if verb == "post"
                          else f"NIXL {xfer.what} reported an error")
        return state

    def post(self, xfer: Xfer, notif: bytes = b"") -> XferState:
        """Start a transfer; a failure is returned as ``ERR`` with ``xfer.error`` set.

        ``notif``: a notification NIXL delivers to the remote agent once this transfer's bytes
        have landed there (none is sent for a transfer that fails)."""
        with self._lock:
            return self._advance(xfer, "post", self._n.transfer, xfer._raw, notif)

    def state(self, xfer: Xfer) -> XferState:
        """Current state; terminal states stick. A failure sets ``xfer.error``."""
        with self._lock:
            if xfer.state.terminal or xfer.released:
                return xfer.state
            return self._advance(xfer, "check", self._n.check_xfer_state, xfer._raw)

    def telemetry(self, xfer: Xfer) -> dict[str, int] | None:
        """Descriptor count and bytes after NIXL's merging, when the agent captures telemetry."""
        with self._lock:
            try:
                t = self._n.get_xfer_telemetry(xfer._raw)
            except Exception:
                return None
            return {
                "descs": int(t.descCount),
                "bytes": int(t.totalBytes),
                "post_us": int(t.postDuration),
                "xfer_us": int(t.xferDuration),
            }

    # ------------------------------------------------------------------ notifications
    def send_notif(self, agent_name: str, message: bytes) -> None:
        with self._lock:
            run(f"send notification to {agent_name!r}", self._n.send_notif, agent_name, message)

    def send_done(self, agent_name: str, message: bytes) -> None:
        """A ``done`` (every byte it speaks of landed already): through the notes agents where both sides have
        one, so that the next WRITE's flush does not wait for the peer to take it; else as :meth:`send_notif`."""
        with self._lock:
            if self.notes is not None and self.notes.reaches(agent_name):
                self.notes.send(agent_name, message)
            else:
                self.send_notif(agent_name, message)

    def notifs(self) -> dict[str, list[bytes]]:
        """New notifications since the last call: sender agent name → messages (what a peer's notes agent sent
        comes under the peer's agent name, after what its agent sent)."""
        with self._lock:
            got = call("get notifications", self._n.get_new_notifs)
            noted = self.notes.fetch() if self.notes is not None else {}
        out = by_sender(got)
        for k, v in noted.items():
            out.setdefault(k, []).extend(v)
        return out

    # ------------------------------------------------------------------ lifetime
    @property
    def live_handles(self) -> int:
        """Handles (transfers, lists, registrations) not yet released."""
        return len(self._live)

    def live(self, kind: type = _Handle) -> list[_Handle]:
        return [h for h in self._live if isinstance(h, kind)]

    def close(self) -> list[str]:
        """Release every live handle (transfers first, registrations last) and forget remotes.

        Returns the problems met (a handle NIXL would not release), so a caller can log them.
        """
        problems = []
        with self._lock:
            if self.closed:
                return problems
            for kind in (Xfer, Prepped, Registration):
                for h in list(self._live):
                    if isinstance(h, kind):
                        try:
                            h.release()
                        except NixlError as exc:
                            problems.append(str(exc))
            for name in list(self._remotes):
                try:
                    self.remove_remote(name)
                except NixlError as exc:
                    problems.append(str(exc))
            if self.notes is not None:
                self.notes.close()
            self.closed = True
            if not self._live:
                self._nixl = None  # drop NIXL's agent (its UCX worker) now, not at interpreter exit
        return problems


def agent_factory(
    backends: Sequence[str], telemetry: bool = False, progress_thread: bool = False,
    ucx: UcxOptions | None = None,
) -> Callable[[str], Agent]:
    """A function that creates a real :class:`Agent` by name (tests substitute a fake one)."""
    return lambda name: Agent(name, backends, telemetry=telemetry, progress_thread=progress_thread, ucx=ucx)


__all__ = [
    "Agent",
    "Xfer",
    "Prepped",
    "Registration",
    "UcxOptions",
    "XferState",
    "check",
    "call",
    "run",
    "agent_factory",
    "NixlError",
    "MEM_TYPES",
    "OPS",
]
