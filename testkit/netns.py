"""Hosts on one machine: network namespaces joined by veth pairs to a bridge, for cross-host tests.

Each :class:`Host` is a network namespace with its own address on a private /24 that exists only
inside the namespaces this module creates (a "switch" namespace holds the bridge; the machine's own
network is never touched). An engine process started with :func:`engine_on` enters its host's
namespace before it opens any socket, then runs in a PID namespace of its own (as a container on
another machine does: it sees no other engine's process, and kvlc's same-host check, boot id plus PID
namespace, says "another host"), and runs UCX over TCP only (``UCX_TLS=tcp``), so that NIXL moves bytes
over the veth link as it would between machines, not by cross-memory attach.

Faults are link faults of one host: :meth:`Network.link_down` / :meth:`Network.link_up` (the switch
side of its veth) and :meth:`Network.rate_limit` (a tbf queue on both ends; netem is absent from
this kernel). Needs root and ``ip`` / ``tc`` (iproute2); :func:`unavailable` says why not otherwise.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field

from kvlc.demo.procs import EngineProcess

CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
PR_SET_PDEATHSIG = 1


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (a reason to skip), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"kvp{secrets.token_hex(3)}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    """One namespace: its name, its address, the switch-side end of its link."""

    ns: str
    ip: str
    link: str  # the veth end in the switch namespace
    inner: str  # the veth end inside the host


@dataclass
class Network:
    """``size`` hosts on one bridge; a context manager that removes every namespace it made."""

    size: int
    subnet: int = 77  # hosts are 10.<subnet>.0.<1..size>
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    hosts: list[Host] = field(default_factory=list)

    @property
    def switch(self) -> str:
        return f"kvsw{self.tag}"

    def __enter__(self) -> Network:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(1, self.size + 1):
            host = Host(ns=f"kvh{self.tag}-{i}", ip=f"10.{self.subnet}.0.{i}", link=f"s{i}", inner="eth0")
            _ip("netns", "add", host.ns)
            _ip("link", "add", f"kv{self.tag}a{i}", "type", "veth", "peer", "name", f"kv{self.tag}b{i}")
            _ip("link", "set", f"kv{self.tag}a{i}", "netns", self.switch)
            _ip("link", "set", f"kv{self.tag}b{i}", "netns", host.ns)
            _ip("-n", self.switch, "link", "set", f"kv{self.tag}a{i}", "name", host.link)
            _ip("-n", host.ns, "link", "set", f"kv{self.tag}b{i}", "name", host.inner)
            _ip("-n", self.switch, "link", "set", host.link, "master", "br0")
            _ip("-n", self.switch, "link", "set", host.link, "up")
            _ip("-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", host.inner)
            _ip("-n", host.ns, "link", "set", host.inner, "up")
            _ip("-n", host.ns, "link", "set", "lo", "up")
            self.hosts.append(host)

    def link_down(self, host: Host) -> None:
        """Cut ``host`` off: its link's switch end goes down (packets are dropped, nothing is reset)."""
        _ip("-n", self.switch, "link", "set", host.link, "down")

    def link_up(self, host: Host) -> None:
        _ip("-n", self.switch, "link", "set", host.link, "up")

    def rate_limit(self, host: Host, rate: str = "8mbit") -> None:
        """Limit ``host``'s link to ``rate`` both ways (tbf; queued packets wait up to 400 ms)."""
        for ns, dev in ((self.switch, host.link), (host.ns, host.inner)):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                            "rate", rate, "burst", "32kbit", "latency", "400ms"], check=True, timeout=30,
                           capture_output=True)

    def unlimit(self, host: Host) -> None:
        for ns, dev in ((self.switch, host.link), (host.ns, host.inner)):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                           timeout=30, capture_output=True)

    def close(self) -> None:
        for host in self.hosts:
            _ip("netns", "del", host.ns, check=False)
        _ip("netns", "del", self.switch, check=False)
        self.hosts = []


def _enter(ns: str, conn, inner_pid) -> None:  # pragma: no cover - runs in the child
    """The child's first acts: join ``ns``'s network, make a PID namespace and fork the engine into it
    (its PID 1; it dies with this process), UCX over TCP only; the engine then serves the harness's pipe.
    ``inner_pid`` gets the engine's PID as this machine sees it (for signals)."""
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), f"setns into {ns} failed")
    os.close(fd)
    if libc.unshare(CLONE_NEWPID) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWPID) failed")
    pid = os.fork()
    if pid == 0:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # kill -9 of the harness's process ends the host
        os.environ["UCX_TLS"] = "tcp"
        from kvlc.demo.procs_child import _main

        _main(conn)
        os._exit(0)
    inner_pid.value = pid
    conn.close()
    _, status = os.waitpid(pid, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


class NsEngineProcess(EngineProcess):
    """An :class:`~kvlc.demo.procs.EngineProcess` whose engine lives in ``host``'s network namespace and a
    PID namespace of its own; kill -9 of it ends the engine, signals (SIGSTOP ...) go to the engine."""

    def __init__(self, host: Host):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.inner_pid = ctx.Value("i", 0)
        self.process = ctx.Process(target=_enter, args=(host.ns, child, self.inner_pid), daemon=True)
        self.process.start()
        child.close()
        self._next = 0
        self.agents = []
        self.host = host

    def engine_pid(self, timeout: float = 30.0) -> int:
        """The engine's PID on this machine (it is PID 1 in its own namespace)."""
        import time

        end = time.monotonic() + timeout
        while not self.inner_pid.value and time.monotonic() < end:
            time.sleep(0.01)
        return int(self.inner_pid.value)

    def signal(self, sig: int) -> None:
        os.kill(self.engine_pid(), sig)


def engine_on(host: Host) -> NsEngineProcess:
    """A new engine process on ``host`` (add agents with ``host=host.ip`` in their config)."""
    return NsEngineProcess(host)
