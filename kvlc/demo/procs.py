"""Run :class:`~kvlc.runtime.agent.KvAgent` s in child processes, driven over a pipe (a test harness).

The demo, the runtime tests and the GPU benchmark start engine ranks this way
(``multiprocessing`` spawn: a fresh interpreter with its own NIXL agents). A
child process hosts one or more agents (one per :class:`EngineConfig`); the
pipe carries only this program's own commands and plain results. Peers talk to
each other only through the validated side channel and NIXL.

Each agent's tensors are allocated by the child and filled: ``"content"``
writes content codes (:func:`kvlc.demo.content.fill`: every byte says what
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
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvlc.demo.procs_child import _main


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
    shared: bool = False  # DRAM storages in shared-memory files: a same-host peer maps them (kvlc.runtime.ipc)
    ipc: str | None = None  # AgentSettings.ipc ("auto" | "off"; None: $KVLC_IPC, else auto)
    notes_agent: bool | None = None  # AgentSettings.notes_agent (None: $KVLC_NOTES_AGENT, else on)
    timeout: float = 30.0
    telemetry: bool = False
    progress: str = "thread"  # KvAgent progress: "thread" | "nixl" | "manual"
    host: str = "127.0.0.1"
    port: int = 0  # the side channel's port (0: any free one); a restarted engine may take its old one
    secret: str | None = field(default_factory=lambda: HARNESS_SECRET)  # None: $KVLC_SECRET...
    insecure: bool = False
    engine_id: str | None = None  # ranks of one engine share it (default: one per plan and fill)
    lease: float = 30.0
    staging: dict | None = None  # StagingPolicy fields (None: the agent's default, $KVLC_STAGING)
    limits: dict | None = None  # side-channel Limits fields (None: the defaults)


class RemoteError(RuntimeError):
    """A command failed in the child; ``kind`` is the child's error type name."""

    def __init__(self, kind: str, message: str):
        self.kind = kind
        super().__init__(f"{kind}: {message}")


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
        timeout: float = 120.0,
    ) -> dict:
        return self.call("connect", list(addresses), direction, mode, peer_id, timeout=timeout)


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
