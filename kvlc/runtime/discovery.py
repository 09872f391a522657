"""Discovery: where an engine's ranks listen, kept in etcd under leases.

The registry holds one small record per rank: the engine id, the rank, the side-channel
``host:port`` it advertises and its epoch. It never holds NIXL metadata or memory keys: those still
come over the authenticated side channel when a peer connects, so an entry someone forged in etcd
leads to a handshake that fails, not to memory access.

Each record lives under an etcd lease that the announcing process keeps alive; when the process
dies (kill -9, a host lost) the lease runs out after ``ttl`` seconds and the record goes with it.
A restarted engine announces again under a new epoch and is found again.

etcd is spoken to through its v3 JSON gateway (``/v3/...`` over HTTP, part of every etcd since 3.4),
with the standard library's HTTP client: no gRPC stack in the engine process. When the registry
cannot be reached, :meth:`Registry.lookup` raises :class:`RegistryError` naming every endpoint it
tried and why; an :class:`Announcement` records the failure in :attr:`Announcement.error` and keeps
trying, and peers already connected are not touched: the registry is only asked when connecting.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import KvlcError

log = logging.getLogger(__name__)

__all__ = ["Announcement", "EngineAddress", "Registry", "RegistryError"]

NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class RegistryError(KvlcError):
    """The address registry could not be reached or answered with something unusable."""


class EngineAddress(BaseModel):
    """Where one rank of an engine listens: what the registry stores, nothing more."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine_id: str = Field(pattern=NAME)
    rank: int = Field(ge=0, lt=1 << 16)
    host: str = Field(min_length=1, max_length=253)
    port: int = Field(ge=1, le=65535)
    epoch: str = Field(pattern=NAME)

    @field_validator("host")
    @classmethod
    def _routable(cls, host: str) -> str:
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return host  # a DNS name
        if ip.is_unspecified:
            raise ValueError(
                f"'{host}' is a bind-all address, which no peer can connect to; "
                "advertise the address peers reach this host by"
            )
        return host

    @property
    def address(self) -> str:
        """``host:port``, as :meth:`kvlc.runtime.KvAgent.connect` takes it."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @classmethod
    def of(cls, agent) -> EngineAddress:
        """The address a serving :class:`~kvlc.runtime.KvAgent` advertises."""
        if agent.address is None:
            raise RegistryError(f"agent '{agent.name}' does not serve: call serve() before announcing it")
        host, _, port = agent.address.rpartition(":")
        return cls(engine_id=agent.engine_id, rank=agent.rank, host=host.strip("[]"), port=int(port),
                   epoch=agent.epoch)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _prefix_end(key: str) -> str:
    """The first key after every key that starts with ``key`` (etcd's range_end for a prefix)."""
    raw = key.encode()
    return base64.b64encode(raw[:-1] + bytes([raw[-1] + 1])).decode()


class Registry:
    """An etcd cluster, reached at ``endpoints`` (``http://host:port``; tried in order), holding
    engine addresses under ``prefix``. ``ttl``: seconds an announcement outlives its process."""

    def __init__(self, endpoints: Sequence[str] | str, *, prefix: str = "kvlc", ttl: float = 10.0,
                 timeout: float = 2.0):
        eps = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        eps = [e.strip().rstrip("/") for e in eps if e.strip()]
        if not eps:
            raise RegistryError("no registry endpoint given: pass etcd's client URLs, e.g. http://10.0.0.5:2379")
        bad = [e for e in eps if not e.startswith(("http://", "https://"))]
        if bad:
            raise RegistryError(f"registry endpoint {bad[0]!r}: expected an http:// or https:// URL")
        if not ttl >= 2:  # also refuses NaN
            raise RegistryError(f"ttl {ttl!r}: expected at least 2 seconds (etcd's shortest lease)")
        self.endpoints, self.prefix, self.ttl, self.timeout = eps, prefix.strip("/"), float(ttl), float(timeout)

    # ------------------------------------------------------------------ the wire
    def _call(self, path: str, body: dict) -> dict:
        """POST ``body`` to the first endpoint that answers; every failure named in the error."""
        failures = []
        data = json.dumps(body).encode()
        for ep in self.endpoints:
            req = urllib.request.Request(f"{ep}/v3/{path}", data=data, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    return json.loads(resp.read() or b"{}")
            except urllib.error.HTTPError as exc:
                failures.append(f"{ep}: HTTP {exc.code} {exc.read()[:200].decode(errors='replace')}")
            except (OSError, ValueError) as exc:
                failures.append(f"{ep}: {getattr(exc, 'reason', exc)}")
        raise RegistryError(f"address registry unreachable ({path}): " + "; ".join(failures))

    def _key(self, engine_id: str, rank: int | None = None) -> str:
        base = f"/{self.prefix}/engines/{engine_id}/"
        return base if rank is None else f"{base}{rank}"

    # ------------------------------------------------------------------ the API
    def announce(self, address: EngineAddress) -> Announcement:
        """Publish ``address`` under a new lease kept alive by a background thread until withdrawn."""
        return Announcement(self, address)

    def lookup(self, engine_id: str) -> list[EngineAddress]:
        """Every rank of ``engine_id`` now in the registry, by rank ([] when none). Entries that are
        not valid addresses (written by something else) are skipped with a warning."""
        if not isinstance(engine_id, str) or not engine_id:
            raise RegistryError(f"engine id {engine_id!r}: expected a non-empty string")
        key = self._key(engine_id)
        reply = self._call("kv/range", {"key": _b64(key), "range_end": _prefix_end(key)})
        found = []
        for kv in reply.get("kvs", []):
            try:
                rec = EngineAddress.model_validate_json(base64.b64decode(kv.get("value", "")))
            except (ValidationError, ValueError) as exc:
                log.warning("registry entry %s is not an engine address, skipped: %s",
                            base64.b64decode(kv.get("key", "")).decode(errors="replace"), exc)
                continue
            if rec.engine_id == engine_id:
                found.append(rec)
        return sorted(found, key=lambda r: r.rank)

    def addresses(self, engine_id: str) -> list[str]:
        """``host:port`` of each rank of ``engine_id``, in rank order (for ``KvAgent.connect``)."""
        found = self.lookup(engine_id)
        if not found:
            raise RegistryError(f"engine '{engine_id}' is not in the registry (not started, or its lease ran out)")
        ranks = [r.rank for r in found]
        if ranks != list(range(len(found))):
            raise RegistryError(f"engine '{engine_id}': ranks {ranks} announced; expected 0..n-1 (a rank is missing)")
        return [r.address for r in found]


class Announcement:
    """One address kept in the registry: granted a lease, put, then kept alive every ``ttl / 3``.
    A lease that ran out meanwhile (the registry was down longer than ``ttl``) is granted anew and
    the address put again. :attr:`error` is the last failure (None while all is well)."""

    def __init__(self, registry: Registry, address: EngineAddress):
        self.registry, self.address = registry, address
        self.error: str | None = None
        self.lease: str | None = None
        self._stop = threading.Event()
        self._publish()  # the first put must succeed: the caller hears the error now
        self._thread = threading.Thread(target=self._keep, name=f"kvlc-announce-{address.engine_id}", daemon=True)
        self._thread.start()

    def _publish(self) -> None:
        reg = self.registry
        lease = reg._call("lease/grant", {"TTL": int(reg.ttl)})
        if "ID" not in lease:
            raise RegistryError(f"lease/grant answered without a lease id: {lease}")
        self.lease = str(lease["ID"])
        reg._call("kv/put", {"key": _b64(reg._key(self.address.engine_id, self.address.rank)),
                             "value": _b64(self.address.model_dump_json()), "lease": self.lease})

    def _refresh(self) -> None:
        reply = self.registry._call("lease/keepalive", {"ID": self.lease})
        if int(reply.get("result", {}).get("TTL", 0)) <= 0:  # the lease ran out: announce again
            self._publish()

    def _keep(self) -> None:
        while not self._stop.wait(self.registry.ttl / 3):
            try:
                self._refresh()
                if self.error is not None:
                    log.info("registry reachable again; %s announced", self.address.address)
                self.error = None
            except RegistryError as exc:
                if self.error is None:
                    log.warning("cannot keep %s announced: %s", self.address.address, exc)
                self.error = str(exc)

    @property
    def alive(self) -> bool:
        return not self._stop.is_set()

    def withdraw(self) -> None:
        """Stop keeping the lease and revoke it (the record goes now); idempotent. A registry that
        cannot be reached is logged: the lease then runs out by itself."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=self.registry.timeout * len(self.registry.endpoints) + 1)
        try:
            self.registry._call("lease/revoke", {"ID": self.lease})
        except RegistryError as exc:
            log.warning("could not revoke the lease of %s (it runs out in %ss): %s",
                        self.address.address, self.registry.ttl, exc)

    def __enter__(self) -> Announcement:
        return self

    def __exit__(self, *exc) -> None:
        self.withdraw()
