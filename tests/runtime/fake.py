"""A fake NIXL agent, only to unit-test the split / barrier / failure logic of the Executor.

It records every request created (operation, both memory types, rows, remote agent) and plays
scripted states; real NIXL runs are in the multi-process tests.
"""

from __future__ import annotations

from collections import deque

from kvlc.runtime.errors import NixlError
from kvlc.runtime.nixl.core import XferState


class FakeXfer:
    def __init__(self, agent, op, local, local_mem, remote, remote_mem, remote_agent, what):
        self.agent, self.op, self.what = agent, op, what
        self.local, self.remote = local, remote
        self.local_mem, self.remote_mem, self.remote_agent = local_mem, remote_mem, remote_agent
        self.released = False
        self.error = None
        self.state = XferState.PROC
        self.script = deque()
        self.refuse_release = 0  # how many release() calls NIXL refuses (cannot cancel yet)
        self.posted = False

    def release(self):
        if self.released:
            return
        if self.refuse_release:
            self.refuse_release -= 1
            raise NixlError(f"release {self.what}", "NIXL_ERR_BACKEND", "cannot cancel yet")
        self.released = True
        self.agent.live.discard(self)
        self.agent.log.append(("release", self.what, self.state.name))


class FakeAgent:
    """Scripts: ``states[(peer agent, local mem, remote mem)]`` is a list of states returned by
    post() then by each state() call (the last one repeats)."""

    def __init__(self, name="fake"):
        self.name = name
        self.created: list[FakeXfer] = []
        self.live: set[FakeXfer] = set()
        self.sent: list[tuple[str, bytes]] = []
        self.log: list[tuple] = []
        self.states: dict[tuple, list[XferState]] = {}
        self.fail_create: set[tuple] = set()
        self.fail_notif: set[str] = set()
        self.remotes = frozenset()

    def initialize(self, op, local_rows, local_mem, remote_rows, remote_mem, remote_agent, what="transfer"):
        key = (remote_agent, local_mem, remote_mem)
        if key in self.fail_create:
            raise NixlError(f"create {op} {what}", "NIXL_ERR_NOT_FOUND")
        x = FakeXfer(self, op, local_rows, local_mem, remote_rows, remote_mem, remote_agent, what)
        x.script.extend(self.states.get(key, [XferState.DONE]))
        self.created.append(x)
        self.live.add(x)
        self.log.append(("create", what))
        return x

    def _next(self, x):
        s = x.script.popleft() if len(x.script) > 1 else x.script[0]
        x.state = s
        if s is XferState.ERR:
            x.error = "NIXL check failed: NIXL_ERR_REMOTE_DISCONNECT"
        return s

    def post(self, x):
        x.posted = True
        self.log.append(("post", x.what))
        return self._next(x)

    def state(self, x):
        if x.state.terminal:
            return x.state
        return self._next(x)

    def send_notif(self, name, msg):
        if name in self.fail_notif:
            raise NixlError(f"send notification to {name!r}", "NIXL_ERR_REMOTE_DISCONNECT")
        self.sent.append((name, msg))
        self.log.append(("notif", name, msg))

    def send_done(self, name, msg):  # (one path for every notification here)
        self.send_notif(name, msg)

    @property
    def live_handles(self):
        return len(self.live)


class Clock:
    """A clock the test sets by hand (``clock.t = 2.0``), for an Executor's deadlines."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t
