"""Run :class:`~kvlc.runtime.agent.KvAgent` s in child processes, driven over a pipe (a test harness).

The demo, the runtime tests and the GPU benchmark start engine ranks this way
(``multiprocessing`` spawn: a fresh interpreter with its own NIXL agents). A
child process hosts one or more agents (one per :class:`EngineConfig`); the
pipe carries only this program's own commands and plain results. Peers talk to
each other only through the validated side channel and NIXL.

Each agent's tensors are allocated by the child and filled: ``"content"``
writes content codes (:func:`kvlc.compiler.content.fill`: every byte says what
it is), ``"random"`` seeded noise (so a test can prove untouched bytes stayed
put). The child polls its agents continuously and keeps every completion
until asked (``events``).

>>> from kvlc import compile_spec
>>> cfg = EngineConfig(compile_spec("tests/runtime/layouts/dense-tp1.yaml").to_json(), rank=0)
>>> cfg.fill
'random'
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Mapping, Sequence
import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np


# One random secret per parent process: every engine this harness starts trusts its siblings only.
HARNESS_SECRET = secrets.token_hex(32)


@dataclass
class EngineConfig:
    """One agent in a child process: a plan (JSON), a rank, how to fill its memory."""

    plan_json: str
    rank: int
    fill: str = "random"  # "content" | "random" | "zeros"
    seed: int = 0
    name: str | None = None
    pin: bool = False  # pin DRAM storages (page-locked host memory, for GPU machines)
    timeout: float = 30.0
    telemetry: bool = False
    progress: str = "thread"  # KvAgent progress: "thread" | "nixl" | "manual"
    host: str = "127.0.0.1"
    secret: str | None = field(default_factory=lambda: HARNESS_SECRET)  # None: $KVLC_SECRET...
    insecure: bool = False
    engine_id: str | None = None  # ranks of one engine share it
    lease: float = 30.0


class RemoteError(RuntimeError):
    """A command failed in the child; ``kind`` is the child's error type name."""

    def __init__(self, kind: str, message: str):
        self.kind = kind
        super().__init__(f"{kind}: {message}")


def _fill(plan, rank: int, tensors: Mapping[str, Any], how: str, seed: int) -> None:
    import torch

    if how == "zeros":
        return
    host = {
        n: (t if t.device.type == "cpu" else torch.empty(t.numel(), dtype=torch.uint8))
        for n, t in tensors.items()
    }
    if how == "content":
        from kvlc.compiler.content import fill

        fill(plan, rank, {n: t.numpy() for n, t in host.items()})
    else:
        rng = np.random.default_rng(seed)
        for t in host.values():
            t.numpy()[:] = rng.integers(0, 256, t.numel(), dtype=np.uint8)
    for n, t in tensors.items():
        if t.device.type != "cpu":
            t.copy_(host[n])


class _Hosted:
    """One agent in the child, with the completions it has seen."""

    def __init__(self, cfg: EngineConfig):
        from kvlc.compiler.plan import Plan
        from kvlc.runtime.agent import KvAgent
        from kvlc.runtime.binding import allocate

        self.plan = Plan.from_json(cfg.plan_json)
        self.tensors = allocate(self.plan, pin=cfg.pin)
        _fill(self.plan, cfg.rank, self.tensors, cfg.fill, cfg.seed)
        self.agent = KvAgent(
            self.plan,
            cfg.rank,
            self.tensors,
            name=cfg.name,
            timeout=cfg.timeout,
            telemetry=cfg.telemetry,
            progress=cfg.progress,
            secret=cfg.secret,
            insecure=cfg.insecure,
            engine_id=cfg.engine_id,
            lease=cfg.lease,
        )
        self.address = self.agent.serve(cfg.host)
        self.peers: dict[str, Any] = {}
        self.finished: dict[str, float] = {}
        self.failed: dict[str, str] = {}
        self.held: dict[str, str] = {}
        self.freeable: list[str] = []
        self.flips: list[str] = []  # contract breaks seen: a request finished after it had failed/held

    def pump(self) -> bool:
        c = self.agent.poll()
        now = time.perf_counter()
        for r in c.finished:
            if r in self.failed or r in self.held:
                self.flips.append(r)
            self.finished[r] = now
        self.held.update(c.held)
        self.failed.update(c.failed)
        self.freeable.extend(c.freeable)
        return bool(c)


def resources(h: _Hosted | None = None) -> dict:
    """This process's open fds, threads and RSS (KiB), plus the agent's live NIXL handles."""
    import threading

    out = {"fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count()}
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                out["rss_kib"] = int(line.split()[1])
    if h is not None:
        out.update(nixl_handles=h.agent.nixl.live_handles, remotes=len(h.agent.nixl.remotes),
                   sessions=len(h.agent.sessions.all()), incoming=len(h.agent.incoming),
                   tallies=len(h.agent.tallies), in_flight=h.agent.in_flight)
    return out


def _main(conn) -> None:  # pragma: no cover - runs in the child
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    hosted: dict[int, _Hosted] = {}

    def pump_all() -> bool:
        busy = False
        for h in hosted.values():
            busy |= h.pump()
        return busy

    def wait(h: _Hosted, ids, timeout):
        deadline = time.monotonic() + timeout
        want = set(ids)
        while not want <= (set(h.finished) | set(h.failed)) and time.monotonic() < deadline:
            if not pump_all():
                time.sleep(0.0002)

    def submit(h: _Hosted, peer_id, method, requests, timeout):
        errors = {}
        fn = getattr(h.peers[peer_id], method)
        for req, lids, rids, n in requests:
            try:
                fn(req, lids, rids, n, timeout=timeout)
            except Exception as exc:
                errors[req] = f"{type(exc).__name__}: {exc}"
        return errors

    def outcome(h: _Hosted, ids):
        return {
            "finished": sorted(set(ids) & set(h.finished)),
            "failed": {r: h.failed[r] for r in ids if r in h.failed},
            "held": {r: h.held[r] for r in ids if r in h.held and r not in h.failed},
            "ever_held": sorted(set(ids) & set(h.held)),
            "open": sorted(set(ids) - set(h.finished) - set(h.failed)),
        }

    while True:
        busy = pump_all()
        if not conn.poll(0 if busy else 0.0005):
            continue
        cmd, aid, *args = conn.recv()
        try:
            if cmd == "add":
                h = hosted[aid] = _Hosted(args[0])
                result = {"address": h.address, "name": h.agent.name}
            elif cmd == "batch":  # several agents' requests at once, waited together: timing
                jobs, timeout = args
                t0 = time.perf_counter()
                errors = {}
                for a_id, peer_id, method, requests in jobs:
                    errors[a_id] = submit(hosted[a_id], peer_id, method, requests, timeout)
                result = {}
                for a_id, peer_id, method, requests in jobs:
                    h = hosted[a_id]
                    ids = [r[0] for r in requests if r[0] not in errors[a_id]]
                    wait(h, ids, timeout + 5)
                    result[a_id] = dict(
                        outcome(h, ids),
                        errors=errors[a_id],
                        end=max([h.finished[r] for r in ids if r in h.finished], default=t0),
                    )
                result = {"agents": result, "seconds": max(r["end"] for r in result.values()) - t0}
            elif cmd == "exit":
                for h in hosted.values():
                    h.agent.close()
                conn.send(("ok", None))
                return
            else:
                h = hosted[aid]
                if cmd == "connect":
                    addrs, direction, mode, peer_id = args
                    peer = h.agent.connect(*addrs, direction=direction, mode=mode)
                    h.peers[peer_id] = peer
                    result = {"peer_ranks": list(peer.peer_ranks), "program": peer.program.text()}
                elif cmd == "submit":
                    result = submit(h, *args)
                elif cmd == "run":  # submit a batch, wait for all of it: timing
                    peer_id, method, requests, timeout = args
                    t0 = time.perf_counter()
                    errors = submit(h, peer_id, method, requests, timeout)
                    ids = [r[0] for r in requests if r[0] not in errors]
                    wait(h, ids, timeout + 5)
                    result = outcome(h, ids)
                    ends = [h.finished[r] for r in result["finished"]]
                    result.update(errors=errors, seconds=(max(ends) - t0) if ends else 0.0)
                elif cmd == "expect":
                    h.agent.expect(*args)
                    result = None
                elif cmd in ("cancel", "offer"):
                    getattr(h.agent, cmd)(*args)
                    result = None
                elif cmd == "peer_close":
                    h.peers.pop(args[0]).close()
                    result = None
                elif cmd == "resources":
                    result = resources(h)
                elif cmd == "wait":
                    ids, timeout = args
                    wait(h, ids, timeout)
                    result = outcome(h, ids)
                elif cmd == "events":
                    h.pump()
                    result = {
                        "finished": sorted(h.finished),
                        "failed": dict(h.failed),
                        "held": dict(h.held),
                        "freeable": list(h.freeable),
                        "flips": list(h.flips),
                    }
                    h.finished.clear(), h.failed.clear(), h.freeable.clear(), h.held.clear()
                elif cmd == "dump":
                    result = {n: t.cpu().numpy().copy() for n, t in h.tensors.items()}
                elif cmd == "stats":
                    from kvlc.runtime.nixl import Xfer

                    a = h.agent
                    result = dict(
                        a.stats,
                        live_handles=a.nixl.live_handles,
                        in_flight=a.in_flight,
                        remotes=len(a.nixl.remotes),
                        xfers=len(a.nixl.live(Xfer)),
                    )
                elif cmd == "close":
                    h.agent.close()
                    result = {"live_handles": h.agent.nixl.live_handles, "remotes": len(h.agent.nixl.remotes)}
                elif cmd == "drop":  # close and forget the agent and its tensors
                    h.agent.close()
                    del hosted[aid]
                    result = None
                else:
                    raise ValueError(f"unknown command {cmd!r}")
        except Exception as exc:
            conn.send(
                (
                    "error",
                    type(exc).__name__,
                    f"{exc}" if cmd != "add" else f"{exc}\n{traceback.format_exc()}",
                )
            )
        else:
            conn.send(("ok", result))


class EngineProcess:
    """A child process hosting agents. :meth:`add` creates one and returns its :class:`AgentHandle`."""

    def __init__(self):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_main, args=(child,), daemon=True)
        self.process.start()
        child.close()
        self._next = 0
        self.agents: list[AgentHandle] = []

    def _send(self, cmd: str, aid: int, *args) -> None:
        self._conn.send((cmd, aid, *args))

    def _recv(self, timeout: float):
        if not self._conn.poll(timeout):
            raise TimeoutError(f"engine process {self.process.pid} did not answer in {timeout}s")
        try:
            status, *rest = self._conn.recv()
        except EOFError:
            raise RemoteError("EOFError", f"engine process {self.process.pid} exited") from None
        if status == "error":
            raise RemoteError(*rest)
        return rest[0]

    def call(self, cmd: str, aid: int, *args, timeout: float = 120.0):
        self._send(cmd, aid, *args)
        return self._recv(timeout)

    def add(self, config: EngineConfig, timeout: float = 120.0) -> AgentHandle:
        h = self.add_async(config)
        return h.ready(timeout)

    def add_async(self, config: EngineConfig) -> AgentHandle:
        """Ask for an agent without waiting (start several processes in parallel), then ``ready()``."""
        h = AgentHandle(self, self._next, config)
        self._next += 1
        self._send("add", h.aid, config)
        self.agents.append(h)
        return h

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)

    def signal(self, sig: int) -> None:
        """Send ``sig`` (e.g. SIGSTOP / SIGCONT) to the child."""
        os.kill(self.process.pid, sig)

    def stop(self, timeout: float = 20.0) -> None:
        if self.process.is_alive():
            try:
                self.call("exit", -1, timeout=timeout)
            except Exception:
                pass
            self.process.join(timeout)
        self.kill()
        self._conn.close()


@dataclass
class AgentHandle:
    """One agent in an :class:`EngineProcess`."""

    proc: EngineProcess
    aid: int
    config: EngineConfig
    address: str = ""
    name: str = ""

    def ready(self, timeout: float = 120.0) -> AgentHandle:
        info = self.proc._recv(timeout)
        self.address, self.name = info["address"], info["name"]
        return self

    def call(self, cmd: str, *args, timeout: float = 120.0):
        return self.proc.call(cmd, self.aid, *args, timeout=timeout)

    def connect(
        self,
        addresses: Sequence[str],
        direction: str = "READ",
        mode: str = "direct",
        peer_id: str = "default",
    ) -> dict:
        return self.call("connect", list(addresses), direction, mode, peer_id)


def start_engines(configs: Sequence[EngineConfig], timeout: float = 120.0) -> list[AgentHandle]:
    """One process per config, started in parallel; returns once every agent serves."""
    procs = [EngineProcess() for _ in configs]
    try:
        handles = [p.add_async(c) for p, c in zip(procs, configs)]
        for h in handles:
            h.ready(timeout)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return handles


def stop_engines(handles: Sequence[AgentHandle], timeout: float = 20.0) -> None:
    """Stop the processes of ``handles`` together: ask every one to exit, then wait for all."""
    procs = list({id(h.proc): h.proc for h in handles}.values())
    for p in procs:
        if p.process.is_alive():
            try:
                p._send("exit", -1)
            except (OSError, BrokenPipeError):
                pass
    for p in procs:
        try:
            if p.process.is_alive():
                p._recv(timeout)
        except Exception:
            pass
        p.process.join(timeout)
        p.kill()
        p._conn.close()
