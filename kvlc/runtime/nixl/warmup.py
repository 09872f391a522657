"""Warm a connection before its first request: touch every peer storage once at connect.

UCX does per-peer work on the first transfer that reaches a peer's registered memory (not traced
which; cuda_ipc opening the peer's memory, once per UCX pool thread, is the likely part).
Measured on an H200 (two processes, one GPU, benchmarks/README.md "UCX's thread pool, the
warm-up and timing by rounds"): with UCX's thread pool the first round of 32 push requests of
256 MiB took 52-62 ms against 10-15 ms for later rounds, and 35-53 ms against 1.5-2 ms at 4 in
flight; with this warm-up, 17-23 ms and 6-9 ms. :class:`Warmer` pays that at :meth:`KvAgent.connect
<kvlc.runtime.agent.KvAgent.connect>` instead: one NIXL READ per (peer rank, memory type pair)
of the first :data:`TOUCH` bytes of every storage the peer declared, into a scratch buffer of
this agent that no plan covers. A READ changes no byte of either side's KV cache (a WRITE
would change the peer's), whichever direction the connection moves bytes in.

Only VRAM storages are touched by default (:attr:`Warmer.MEMS`): that is where the first use
was measured to cost, and a cuda_ipc READ needs nothing from the peer's process. Over TCP
(DRAM on a host without RDMA) a READ waits for the peer to progress its worker, which a peer
blocked in ``connect`` does not.

Best effort: a warm-up that fails or is not done within its time only logs (the connection
works without it; a handle NIXL cannot release yet goes to the executor's retry list).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from kvlc.runtime.errors import NixlError
from kvlc.runtime.nixl.core import XferState

log = logging.getLogger("kvlc.runtime.nixl.warmup")

TOUCH = 4096  # bytes read from the start of each peer storage
MAX_STORAGES = 1024  # per peer rank: storages past these are not touched


class Warmer:
    """Scratch buffers (one per memory type this agent has, registered on first use) and the warm-up READs."""

    MEMS = frozenset({"VRAM"})  # the peer memory types warmed
    TIMEOUT_S = 0.5

    def __init__(self, nixl: Any, bindings: Mapping[str, Any]):
        self.nixl = nixl
        self._devices = {}  # memory type → the device of this agent's first storage of that type
        for b in bindings.values():
            self._devices.setdefault(b.mem, b.device)
        self._scratch: dict[str, tuple[Any, int, int]] = {}  # mem → (tensor, addr, device)

    def _local(self, mem: str) -> tuple[str, int, int]:
        """The scratch to read a ``mem`` storage into: same memory type if this agent has one."""
        local = mem if mem in self._devices else next(iter(self._devices))
        if local not in self._scratch:
            import torch

            dev = self._devices[local]
            t = (torch.empty(TOUCH, dtype=torch.uint8) if local == "DRAM"
                 else torch.empty(TOUCH, dtype=torch.uint8, device=f"cuda:{dev}"))
            self.nixl.register(np.array([[t.data_ptr(), TOUCH, dev]], dtype=np.uint64), local,
                               what=f"warm-up scratch ({local})")
            self._scratch[local] = (t, t.data_ptr(), dev)
        _, addr, dev = self._scratch[local]
        return local, addr, dev

    def warm(self, records: Iterable[Any], stuck: list, mems: frozenset[str] | None = None,
             timeout: float | None = None) -> dict[str, str]:
        """READ the first bytes of every ``mems`` storage of each record (peer rank), waiting up to
        ``timeout`` s in all; handles NIXL will not release yet are appended to ``stuck``.

        Returns what did not work, per peer agent (empty: every peer warmed)."""
        mems = self.MEMS if mems is None else mems
        problems: dict[str, str] = {}
        xfers = self._post(records, mems, problems)
        self._wait(xfers, self.TIMEOUT_S if timeout is None else timeout, stuck, problems)
        for agent, why in problems.items():
            log.info("warm-up of %s skipped: %s", agent, why)
        return problems


    def _groups(self, rec, mems) -> dict[tuple[str, str], list]:
        """(local mem, remote mem) → ((local row), (remote row)) pairs for one peer rank."""
        groups: dict[tuple[str, str], list] = {}
        for s in [s for s in rec.storages if s.mem in mems][:MAX_STORAGES]:
            local, addr, dev = self._local(s.mem)
            n = min(TOUCH, s.size)
            groups.setdefault((local, s.mem), []).append(((addr, n, dev), (s.addr, n, s.device)))
        return groups

    def _post(self, records, mems, problems: dict[str, str]) -> list:
        """Create and post one READ per (peer rank, memory type pair); a refusal goes to ``problems``."""
        xfers = []
        for rec in records:
            for (local, remote), pairs in self._groups(rec, mems).items():
                lrows = np.array([p[0] for p in pairs], dtype=np.uint64)
                rrows = np.array([p[1] for p in pairs], dtype=np.uint64)
                try:
                    x = self.nixl.initialize("READ", lrows, local, rrows, remote, rec.agent,
                                             what=f"warm-up of {rec.agent} ({remote})")
                except NixlError as exc:
                    problems[rec.agent] = str(exc)
                    continue
                xfers.append((rec.agent, x, self.nixl.post(x)))
        return xfers

    def _wait(self, xfers: list, timeout: float, stuck: list, problems: dict[str, str]) -> None:
        """Wait for the READs until ``timeout`` s from now, then release every handle."""
        deadline = time.monotonic() + timeout
        for agent, x, state in xfers:
            while state is XferState.PROC and time.monotonic() < deadline:
                time.sleep(0.0002)
                state = self.nixl.state(x)
            if state is not XferState.DONE:
                problems[agent] = x.error or f"not done within {timeout:g}s"
            try:
                x.release()
            except NixlError:
                stuck.append(x)


def warm_peers(agent: Any, records: list, mems: frozenset[str] | None = None) -> dict[str, str]:
    """Warm ``agent``'s connection to these peer ranks' records (see the module doc); not under the
    agent's lock (NIXL calls take their own), except to hand over handles not released yet."""
    stuck: list = []
    try:
        problems = agent.warmer.warm(records, stuck, mems)
    except Exception as exc:  # a scratch buffer that cannot be had: the connection works without
        log.warning("warm-up skipped: %s: %s", type(exc).__name__, exc)
        problems = {rec.agent: f"{type(exc).__name__}: {exc}" for rec in records}
    if stuck:
        agent.keep_stuck(stuck)
    return problems
