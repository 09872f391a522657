"""The child side of :mod:`kvlc.demo.procs`: hosts agents, fills their memory, answers the pipe.

Runs in a spawned interpreter; imports torch and nixl (through the runtime) only there.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Mapping
from typing import Any

import numpy as np


def _fill(plan, rank: int, tensors: Mapping[str, Any], how: str, seed: int) -> None:
    import torch

    if how == "zeros":
        return
    host = {
        n: (t if t.device.type == "cpu" else torch.empty(t.numel(), dtype=torch.uint8))
        for n, t in tensors.items()
    }
    if how == "content":
        from kvlc.demo.content import fill

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

    def __init__(self, cfg: Any):  # a kvlc.demo.procs.EngineConfig, sent over the pipe
        from kvlc.compiler.plan.model import Plan
        from kvlc.runtime.binding import allocate

        self.cfg = cfg
        self.plan = Plan.from_json(cfg.plan_json)
        self.tensors = allocate(self.plan, pin=cfg.pin, shared=cfg.shared)
        _fill(self.plan, cfg.rank, self.tensors, cfg.fill, cfg.seed)
        self.agent = self._agent()
        self.address = self.agent.serve(cfg.host, cfg.port)
        self.peers: dict[str, Any] = {}
        self.finished: dict[str, float] = {}
        self.failed: dict[str, str] = {}
        self.held: dict[str, str] = {}
        self.freeable: list[str] = []
        self.flips: list[str] = []  # contract breaks seen: a request finished after it had failed/held
        self.reserved: list[Any] = []  # asleep: the memory its tensors let go, held until the wake-up allocated

    def _agent(self):
        """A new agent (a new epoch) over the tensors as they are now."""
        from kvlc.runtime.agent import KvAgent
        from kvlc.runtime.channel.tcp import Limits
        from kvlc.runtime.settings import AgentSettings
        from kvlc.runtime.staging.endpoint import StagingPolicy

        cfg = self.cfg
        return KvAgent(
            self.plan,
            cfg.rank,
            self.tensors,
            AgentSettings(
                name=cfg.name,
                timeout=cfg.timeout,
                telemetry=cfg.telemetry,
                progress=cfg.progress,
                secret=cfg.secret,
                insecure=cfg.insecure,
                engine_id=cfg.engine_id or f"harness-{self.plan.digest[:12]}-{cfg.fill}",
                lease=cfg.lease,
                staging=None if cfg.staging is None else StagingPolicy(**cfg.staging),
                limits=Limits(**(cfg.limits or {})),
                **({"ipc": cfg.ipc} if cfg.ipc else {}),
                **({"notes_agent": cfg.notes_agent} if cfg.notes_agent is not None else {}),
            ),
        )

    def sleep(self) -> dict:
        """What an engine's sleep does to kvlc (the vLLM connector's unregister_kv_caches): the agent
        closes (NIXL deregisters the memory; sessions, connections and transfers end, reported by the
        next poll), then the tensors let their memory go; it stays allocated, unused, until the wake-up has
        allocated the new memory, so that the wake-up lands elsewhere (freed and reserved again at once, malloc
        may hand a reservation other addresses and the wake-up the old ones)."""
        import torch

        ptrs = {n: t.data_ptr() for n, t in self.tensors.items()}
        self.agent.close()
        self.pump()
        self.peers.clear()
        sizes = {n: t.numel() for n, t in self.tensors.items()}
        self.reserved = [t.untyped_storage() for t in self.tensors.values()]  # the old memory, held
        for t in self.tensors.values():
            t.set_(torch.empty(0, dtype=t.dtype, device=t.device))
        self.sizes = sizes
        return {"ptrs": ptrs}

    def wake(self, fill: str, seed: int) -> dict:
        """The wake-up (restore_kv_caches): the same tensors get new memory, filled as ``fill`` says,
        and a new agent (a new epoch) serves them on the same address."""
        import torch

        port = int(self.address.rpartition(":")[2])
        for n, t in self.tensors.items():  # the same tensor objects, new memory
            t.set_(torch.empty(self.sizes[n], dtype=t.dtype, device=t.device))
        self.reserved = []
        _fill(self.plan, self.cfg.rank, self.tensors, fill, seed)
        self.agent = self._agent()
        self.address = self.agent.serve(self.cfg.host, port)
        return {"ptrs": {n: t.data_ptr() for n, t in self.tensors.items()}, "address": self.address,
                "name": self.agent.name, "epoch": self.agent.epoch}

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
    """This process's open fds, threads (Python's, and every OS thread: /proc/self/task) and RSS (KiB),
    plus the agent's live NIXL handles, remote NIXL agents, sessions and remote engine records."""
    import threading

    out = {"fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count(),
           "tasks": len(os.listdir("/proc/self/task"))}
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                out["rss_kib"] = int(line.split()[1])
    if h is not None:
        out.update(nixl_handles=h.agent.nixl.live_handles, remotes=len(h.agent.nixl.remotes),
                   sessions=len(h.agent.sessions.all()), records=len(h.agent.sessions.engines),
                   incoming=len(h.agent.incoming),
                   tallies=len(h.agent.tallies), in_flight=h.agent.in_flight)
    return out


def _submit(h: _Hosted, peer_id, method, requests, timeout, size: int = 0, options: dict | None = None
            ) -> dict[str, str]:
    """Post every request through peer ``peer_id``; the errors of those that could not be posted.

    ``method`` ``write_many`` / ``read_many`` posts them in batches of ``size`` (0: one batch);
    a refused batch's error is each of its requests' error. ``options``: more keyword arguments of
    ``read`` / ``write`` (e.g. ``produced_at``)."""
    options = options or {}
    errors = {}
    fn = getattr(h.peers[peer_id], method)
    if method.endswith("_many"):
        from kvlc.runtime.batch import BlockRequest

        size = size or len(requests) or 1
        for at in range(0, len(requests), size):
            chunk = requests[at:at + size]
            try:
                fn([BlockRequest(req, lids, rids, *((None, tuple(n)) if isinstance(n, (tuple, list)) else (n,)))
                    for req, lids, rids, n in chunk], timeout=timeout)
            except Exception as exc:
                errors.update({r[0]: f"{type(exc).__name__}: {exc}" for r in chunk})
        return errors
    for req, lids, rids, n in requests:   # n: num_tokens, or (start, stop) for a token range
        try:
            if isinstance(n, (tuple, list)):
                fn(req, lids, rids, timeout=timeout, tokens=tuple(n), **options)
            else:
                fn(req, lids, rids, n, timeout=timeout, **options)
        except Exception as exc:
            errors[req] = f"{type(exc).__name__}: {exc}"
    return errors


def _outcome(h: _Hosted, ids) -> dict:
    return {
        "finished": sorted(set(ids) & set(h.finished)),
        "failed": {r: h.failed[r] for r in ids if r in h.failed},
        "held": {r: h.held[r] for r in ids if r in h.held and r not in h.failed},
        "ever_held": sorted(set(ids) & set(h.held)),
        "open": sorted(set(ids) - set(h.finished) - set(h.failed)),
    }


class _Child:
    """The agents this process hosts, and the answer to each command of the pipe."""

    def __init__(self):
        self.hosted: dict[int, _Hosted] = {}

    def pump_all(self) -> bool:
        busy = False
        for h in self.hosted.values():
            busy |= h.pump()
        return busy

    def wait(self, h: _Hosted, ids, timeout) -> None:
        deadline = time.monotonic() + timeout
        want = set(ids)
        while not want <= (set(h.finished) | set(h.failed)) and time.monotonic() < deadline:
            if not self.pump_all():
                time.sleep(0.0002)

    def answer(self, cmd: str, aid: int, args: list):
        """The result of one command (``exit`` is the serving loop's own)."""
        if cmd == "add":
            h = self.hosted[aid] = _Hosted(args[0])
            return {"address": h.address, "name": h.agent.name}
        if cmd == "batch":
            jobs, timeout = args
            return self.batch(jobs, timeout)
        h = self.hosted[aid]
        command = _AGENT_COMMANDS.get(cmd)
        if command is None:
            raise ValueError(f"unknown command {cmd!r}")
        return command(self, h, aid, args)

    def batch(self, jobs, timeout) -> dict:
        """Several agents' requests at once, waited together: timing."""
        t0 = time.perf_counter()
        errors = {}
        for a_id, peer_id, method, requests, *size in jobs:  # size: requests per batch of write_many / read_many
            errors[a_id] = _submit(self.hosted[a_id], peer_id, method, requests, timeout, *size)
        result = {}
        for a_id, peer_id, method, requests, *_ in jobs:
            h = self.hosted[a_id]
            ids = [r[0] for r in requests if r[0] not in errors[a_id]]
            self.wait(h, ids, timeout + 5)
            result[a_id] = dict(
                _outcome(h, ids),
                errors=errors[a_id],
                end=max([h.finished[r] for r in ids if r in h.finished], default=t0),
            )
        return {"agents": result, "seconds": max(r["end"] for r in result.values()) - t0}

    def run(self, h: _Hosted, aid: int, args: list) -> dict:
        """Submit a batch, wait for all of it: timing."""
        peer_id, method, requests, timeout, *size = args  # size: requests per batch of write_many / read_many
        t0 = time.perf_counter()
        errors = _submit(h, peer_id, method, requests, timeout, *size)
        ids = [r[0] for r in requests if r[0] not in errors]
        self.wait(h, ids, timeout + 5)
        result = _outcome(h, ids)
        ends = [h.finished[r] for r in result["finished"]]
        result.update(errors=errors, seconds=(max(ends) - t0) if ends else 0.0)
        return result

    def wait_for(self, h: _Hosted, aid: int, args: list) -> dict:
        ids, timeout = args
        self.wait(h, ids, timeout)
        return _outcome(h, ids)

    def drop(self, h: _Hosted, aid: int, args: list) -> None:
        """Close and forget the agent and its tensors."""
        h.agent.close()
        del self.hosted[aid]

    def close_all(self) -> None:
        for h in self.hosted.values():
            h.agent.close()


def _connect(child, h: _Hosted, aid, args) -> dict:
    addrs, direction, mode, peer_id = args
    peer = h.agent.connect(*addrs, direction=direction, mode=mode)
    h.peers[peer_id] = peer
    return {"peer_ranks": list(peer.peer_ranks), "program": peer.program.text()}


def _events(child, h: _Hosted, aid, args) -> dict:
    """What the agent reported since the last ``events``; the record is cleared."""
    h.pump()
    result = {
        "finished": sorted(h.finished),
        "failed": dict(h.failed),
        "held": dict(h.held),
        "freeable": list(h.freeable),
        "flips": list(h.flips),
    }
    h.finished.clear(), h.failed.clear(), h.freeable.clear(), h.held.clear()
    return result


def _stats(child, h: _Hosted, aid, args) -> dict:
    from kvlc.runtime.nixl.core import Xfer

    a = h.agent
    return dict(
        a.stats,
        staging=dict(a.stager.endpoint.stats) if a.stager is not None else None,
        live_handles=a.nixl.live_handles,
        in_flight=a.in_flight,
        remotes=len(a.nixl.remotes),
        xfers=len(a.nixl.live(Xfer)),
    )


def _close(child, h: _Hosted, aid, args) -> dict:
    h.agent.close()
    return {"live_handles": h.agent.nixl.live_handles, "remotes": len(h.agent.nixl.remotes)}


def _announce(child, h: _Hosted, aid, args) -> dict:
    """Keep this agent's address in the registry at ``endpoints`` (one announcement per agent)."""
    from kvlc.runtime.discovery import EngineAddress, Registry

    endpoints, ttl = args
    old = getattr(h, "announcement", None)
    if old is not None:
        old.withdraw()
    h.announcement = Registry(endpoints, ttl=ttl).announce(EngineAddress.of(h.agent))
    return {"epoch": h.agent.epoch, "address": h.announcement.address.address}


def _announced(child, h: _Hosted, aid, args) -> dict:
    """How this agent's announcement fares: its last error (None while the registry is reachable)."""
    ann = getattr(h, "announcement", None)
    return {"alive": ann is not None and ann.alive, "error": None if ann is None else ann.error}


def _no_result(call):
    """A command that only acts: ``call(hosted agent, arguments)``, answered with None."""
    def command(child, h: _Hosted, aid, args) -> None:
        call(h, args)
    return command


# The commands addressed to one hosted agent: (child, hosted agent, its id, arguments) -> result.
_AGENT_COMMANDS = {
    "connect": _connect,
    "announce": _announce,
    "announced": _announced,
    "submit": lambda child, h, aid, args: _submit(h, *args),
    "run": _Child.run,
    "expect": _no_result(lambda h, args: h.agent.expect(*args)),
    "cancel": _no_result(lambda h, args: h.agent.cancel(*args)),
    "offer": _no_result(lambda h, args: h.agent.offer(*args)),
    "peer_close": _no_result(lambda h, args: h.peers.pop(args[0]).close()),
    "resources": lambda child, h, aid, args: resources(h),
    "wait": _Child.wait_for,
    "events": _events,
    "dump": lambda child, h, aid, args: {n: t.cpu().numpy().copy() for n, t in h.tensors.items()},
    "stats": _stats,
    "close": _close,
    "drop": _Child.drop,
    "sleep": lambda child, h, aid, args: h.sleep(),
    "wake": lambda child, h, aid, args: h.wake(*args),
}


def _main(conn) -> None:  # pragma: no cover - runs in the child
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    child = _Child()
    while True:
        busy = child.pump_all()
        if not conn.poll(0 if busy else 0.0005):
            continue
        cmd, aid, *args = conn.recv()
        try:
            if cmd == "exit":
                child.close_all()
                conn.send(("ok", None))
                return
            result = child.answer(cmd, aid, args)
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
