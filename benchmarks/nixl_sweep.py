"""NIXL alone (no kvlc): what one descriptor costs UCX on this machine, for ``bench_transfer.py``.

:func:`nixl_descriptor_sweep` moves a buffer between this process and a spawned one as
descriptors of one size (remote order permuted, like fragmented block ids), READ and WRITE.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
from common import spread


def _sweep_target(conn, nbytes: int) -> None:  # pragma: no cover - runs in the child
    import os

    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("sweep-target", nixl_agent_config(backends=["UCX"]))
    buf = np.empty(nbytes, dtype=np.uint8)
    buf[:] = 7
    agent.register_memory(np.array([[buf.ctypes.data, nbytes, 0]], dtype=np.uint64), "DRAM")
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    while not (conn.poll(0.01) and conn.recv() == "exit"):
        pass


def _rows(base: int, order: np.ndarray, size: int) -> np.ndarray:
    out = np.zeros((len(order), 3), dtype=np.uint64)
    out[:, 0] = np.uint64(base) + order.astype(np.uint64) * np.uint64(size)
    out[:, 1] = size
    return out


class _Initiator:
    """This process's agent, its buffer of ``nbytes`` and the spawned peer's buffer at ``raddr``."""

    def __init__(self, md: bytes, raddr: int, nbytes: int):
        from nixl._api import nixl_agent, nixl_agent_config

        self.agent = nixl_agent("sweep-initiator", nixl_agent_config(backends=["UCX"]))
        self.buf = np.zeros(nbytes, dtype=np.uint8)
        self.buf[:] = 1
        self.agent.register_memory(np.array([[self.buf.ctypes.data, nbytes, 0]], dtype=np.uint64), "DRAM")
        self.peer = self.agent.add_remote_agent(md)
        self.raddr, self.nbytes = raddr, nbytes
        self.rng = np.random.default_rng(0)

    def once(self, op: str, size: int) -> float:
        """Seconds one ``op`` of the whole buffer takes as descriptors of ``size`` bytes (busy polling)."""
        agent, n = self.agent, self.nbytes // size
        local = _rows(self.buf.ctypes.data, np.arange(n), size)
        remote = _rows(self.raddr, self.rng.permutation(n), size)
        t0 = time.perf_counter()
        h = agent.initialize_xfer(
            op, agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "DRAM"), self.peer, b""
        )
        state = agent.transfer(h)
        while state == "PROC":
            state = agent.check_xfer_state(h)
        dt = time.perf_counter() - t0
        agent.release_xfer_handle(h)
        if state != "DONE":
            raise RuntimeError(f"NIXL {op} of {n} descriptors ended {state}")
        return dt


def nixl_descriptor_sweep(nbytes: int = 256 << 20, sizes=None, repeat: int = 7) -> dict:
    """Plain NIXL (no kvlc) between this process and a spawned one: ``nbytes`` moved as descriptors
    of one size (remote order permuted, like fragmented block ids), READ and WRITE, sizes
    interleaved, busy polling. Shows what one descriptor costs UCX on this machine."""
    import multiprocessing as mp

    sizes = sizes or [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 8 << 20, 64 << 20, nbytes]
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_sweep_target, args=(there, nbytes), daemon=True)
    child.start()
    try:
        md, raddr = here.recv()
        initiator = _Initiator(md, raddr, nbytes)
        times = {(op, s): [] for op in ("READ", "WRITE") for s in sizes}
        for op, s in times:
            initiator.once(op, s)  # warm-up
        for _ in range(repeat):
            for key, ts in times.items():
                ts.append(initiator.once(*key))
        return {"bytes": nbytes, "repeat": repeat, "polling": "busy (check_xfer_state loop)",
                "rows": _sweep_rows(times, nbytes, min(sizes))}
    finally:
        try:
            here.send("exit")
        except OSError:
            pass
        child.join(10)
        if child.is_alive():
            child.kill()


def _sweep_rows(times: dict, nbytes: int, smallest: int) -> list[dict]:
    """One row per (op, descriptor size); the smallest size's rows also get the cost of one more descriptor."""
    out = []
    for (op, s), ts in times.items():
        med = statistics.median(ts)
        out.append(
            {
                "op": op,
                "descriptor_bytes": s,
                "descriptors": nbytes // s,
                "seconds": spread(ts),
                "gbps": nbytes / med / 1e9,
            }
        )
    for op in ("READ", "WRITE"):  # cost of one more descriptor, from the smallest size
        one = next(r for r in out if r["op"] == op and r["descriptors"] == 1)["seconds"]["median"]
        many = next(r for r in out if r["op"] == op and r["descriptor_bytes"] == smallest)
        many["extra_us_per_descriptor"] = (
            (many["seconds"]["median"] - one) / (many["descriptors"] - 1) * 1e6
        )
    return out
