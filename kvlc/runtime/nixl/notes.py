"""A second NIXL agent that carries ``done`` notifications, so the data endpoint's flush never waits on them.

NIXL's UCX WRITE ends with a flush of its endpoint, and that flush does not complete until the peer's worker took
the notification sent on the same endpoint before it (UCX sends notifications as active messages; on tcp their
completion needs the receiver's progress). A runtime that tells every request's end therefore made each next
WRITE to that peer wait for the peer's next poll. Bare NIXL on this project's CPU VM
(``benchmarks/probes/notif_agent.py``, one request of 32 rows at a time, the consumer fetching every 0.2 ms):
WRITE alone 107 µs p50, a notification on the same endpoint after each 323 µs, the same notification through a
second agent pair 113 µs.

:class:`Notes` is that second agent, one per :class:`~kvlc.runtime.nixl.core.Agent` that asks for it: its
metadata travels in the handshake record (``Record.notes_md``), a peer's is loaded next to the peer's data agent
(:meth:`Notes.add`: the side that moves bytes; a receiver need not load the sender's), and its notifications
come back under the peer's DATA agent name (:meth:`Notes.fetch`: a notes agent is named after its data agent),
so everything above the :class:`~kvlc.runtime.nixl.core.Agent` sees one peer. (A sender's name is what it says
it is, on either agent: notifications are trusted for their session's tag, never for where they came from.) Only
``done`` goes this way (sent once every part of a request ended DONE, so every byte is there already);
``failed`` and staging's messages stay on the data endpoint, behind whatever bytes it still carries (UCX over
tcp keeps one stream per endpoint: a ``failed`` never overtakes bytes of the transfer that failed).
Every call here happens under the owning agent's lock.
"""

from __future__ import annotations

import logging
from typing import Any

from kvlc.runtime.errors import NixlError
from kvlc.runtime.nixl.status import call, run

log = logging.getLogger("kvlc.runtime.nixl.notes")
SUFFIX = ".notes"  # the notes agent's NIXL name: the data agent's, then this


def by_sender(got: dict, name=lambda sender: sender) -> dict[str, list[bytes]]:
    """NIXL's ``get_new_notifs`` answer as sender name (``name`` of the decoded one) → messages as bytes."""
    out: dict[str, list[bytes]] = {}
    for k, v in got.items():
        out.setdefault(name(k.decode() if isinstance(k, bytes) else str(k)), []).extend(bytes(m) for m in v)
    return out


class Notes:
    """The notification agent of one data agent (see the module docstring)."""

    def __init__(self, raw: Any, name: str):
        self._n = raw  # a nixl_agent with the UCX backend
        self.name = name
        self._notes_of: dict[str, str] = {}  # a peer's data agent name -> its notes agent name
        self.sent = 0  # notifications sent through this agent, and taken from it
        self.taken = 0

    def metadata(self) -> bytes:
        return bytes(call("get notes agent metadata", self._n.get_agent_metadata))

    def add(self, data_name: str, metadata: bytes) -> str:
        """Load the notes agent of peer ``data_name`` (its record's ``notes_md``) and connect to it now, so that the
        first ``done`` does not pay UCX's set-up; returns its name. Raises NixlError when NIXL refuses it or it
        is not ``data_name`` + :data:`SUFFIX`."""
        self.remove(data_name)  # (a peer restarted under the same name: its new agent replaces the old)
        name = call(f"add the notes agent of {data_name!r}", self._n.add_remote_agent, metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != data_name + SUFFIX:
            if name not in self._notes_of.values():  # (never another peer's, loaded for it)
                run(f"remove remote agent {name!r}", self._n.remove_remote_agent, name)
            raise NixlError(f"add the notes agent of {data_name!r}", "wrong agent",
                            f"its metadata is agent {name!r}, expected {data_name + SUFFIX!r}")
        try:
            run(f"connect to {name!r}", self._n.make_connection, name)
        except Exception as exc:  # the first `done` sets the connection up instead
            log.debug("connect to %s: %s", name, exc)
        self._notes_of[data_name] = name
        return name

    def remove(self, data_name: str) -> None:
        """Forget the notes agent of peer ``data_name`` (idempotent)."""
        name = self._notes_of.pop(data_name, None)
        if name is not None:
            run(f"remove remote agent {name!r}", self._n.remove_remote_agent, name)

    def reaches(self, data_name: str) -> bool:
        return data_name in self._notes_of

    def send(self, data_name: str, message: bytes) -> None:
        """Send ``message`` to the notes agent of peer ``data_name`` (which :meth:`reaches` it)."""
        name = self._notes_of[data_name]
        run(f"send notification to {name!r}", self._n.send_notif, name, message)
        self.sent += 1

    def fetch(self) -> dict[str, list[bytes]]:
        """New notifications, keyed by the sender's DATA agent name (a name without :data:`SUFFIX` stays as it is)."""
        got = call("get notifications", self._n.get_new_notifs)
        self.taken += sum(len(v) for v in got.values())
        return by_sender(got, lambda k: k[:-len(SUFFIX)] if k.endswith(SUFFIX) else k)

    def close(self) -> None:
        for data_name in list(self._notes_of):
            try:
                self.remove(data_name)
            except Exception as exc:
                log.warning("close notes agent %s: %s", self.name, exc)
        self._n = None
