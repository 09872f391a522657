"""The OpenAI servers behind the proxy: one :class:`Backend` per URL, one :class:`Pool` per role.

A pool picks the healthy backend with the fewest outstanding requests (ties go round-robin),
takes a backend out when a connection to it fails or its ``/health`` fails, and puts it back
when ``/health`` answers 200 again. When every backend of a role is out, requests still try
them (one after another), so a stale health verdict costs a failed connection, never a refusal.

>>> pool = Pool("prefill", ["http://a:1", "http://b:2/"])
>>> [b.url for b in pool.backends]
['http://a:1', 'http://b:2']
>>> first = pool.pick(); first.started(); pool.pick().url   # a is busy: b has fewer outstanding
'http://b:2'
>>> pool.mark_down(pool.backends[1], "connection refused"); pool.pick().url
'http://a:1'
>>> pool.mark_down(pool.backends[0], "connection refused"); pool.pick(exclude=pool.backends) is None
True
>>> pool.why_none()
'no prefill server could take the request: http://a:1 (connection refused), http://b:2 (connection refused)'
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence


class Backend:
    """One OpenAI-compatible server: its URL, its outstanding requests and its health."""

    def __init__(self, role: str, url: str):
        self.role = role
        self.url = url.rstrip("/")
        self.outstanding = 0
        self.healthy = True
        self.why_down = ""
        self.requests = 0

    def started(self) -> None:
        """A request to this backend began."""
        self.outstanding += 1

    def ended(self) -> None:
        """A request to this backend ended (answered, failed or cancelled)."""
        self.outstanding -= 1
        self.requests += 1

    def state(self) -> dict:
        """What ``/health`` reports about this backend."""
        return {"url": self.url, "healthy": self.healthy, "outstanding": self.outstanding,
                "requests": self.requests, **({"why_down": self.why_down} if not self.healthy else {})}

    def __repr__(self) -> str:
        return f"Backend({self.role} {self.url})"


class Pool:
    """The backends of one role (``prefill`` or ``decode``)."""

    def __init__(self, role: str, urls: Sequence[str]):
        if not urls:
            raise ValueError(f"no {role} server given: pass --{role} URL at least once")
        self.role = role
        self.backends = tuple(Backend(role, u) for u in urls)
        self._turn = itertools.count()

    def pick(self, exclude: Iterable[Backend] = ()) -> Backend | None:
        """The backend with the fewest outstanding requests (round-robin among ties) among the healthy
        ones not in ``exclude``; when every one is out, among all not in ``exclude`` (a health check that
        timed out on a busy server must not refuse every request); None when all are excluded."""
        skip = set(map(id, exclude))
        left = [b for b in self.backends if id(b) not in skip]
        ready = [b for b in left if b.healthy] or left
        if not ready:
            return None
        least = min(b.outstanding for b in ready)
        ties = [b for b in ready if b.outstanding == least]
        return ties[next(self._turn) % len(ties)]

    def mark_down(self, backend: Backend, why: str) -> None:
        backend.healthy, backend.why_down = False, why

    def mark_up(self, backend: Backend) -> None:
        backend.healthy, backend.why_down = True, ""

    def any_healthy(self) -> bool:
        return any(b.healthy for b in self.backends)

    def why_none(self) -> str:
        """Why no backend of this role can take a request, naming each one."""
        parts = [f"{b.url} ({b.why_down or 'failed'})" for b in self.backends]
        return f"no {self.role} server could take the request: " + ", ".join(parts)
