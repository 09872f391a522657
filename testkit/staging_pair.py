"""Two processes, real NIXL agents: staged transfers with content-coded bytes, and raw NIXL beside them.

:func:`start_pair` spawns a sender and a receiver process. Each allocates its regions
(DRAM or VRAM, as :class:`Side` says), registers them and its bounce buffer(s) with
its own NIXL agent, and the two exchange metadata through the parent. Then
:meth:`Pair.staged` moves requests through :class:`~kvlc.runtime.staging.endpoint.StagingEndpoint`
(every destination byte checked when asked, and every byte outside the destinations
checked unchanged), and :meth:`Pair.raw` times plain NIXL requests (one descriptor,
or the request's own rows) between the same two processes: the baseline staging must
beat or match. Requests are given as :class:`Ranges` (region index, offset, length per
row) and turned into addresses inside each process.

This is a test and benchmark harness (CI runs it on DRAM; benchmarks/probes/gpu_transfer.py
on a GPU); engines use :class:`~kvlc.runtime.staging.endpoint.StagingEndpoint` directly.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

SEED_NOISE = 0x5A


@dataclass(frozen=True)
class Side:
    """One process: region sizes and memory (``device`` None = DRAM, else VRAM on that cuda index)."""

    regions: tuple[int, ...]
    mem: tuple[str, ...] = ()              # per region "DRAM" | "VRAM"; default: all VRAM if device else DRAM
    device: int | None = None
    slot_bytes: int = 8 << 20
    slots: int = 4
    pin: bool = True
    fill: bool = True                      # content codes (sender) and noise (receiver); False: zeros
    ucx: dict = field(default_factory=dict)  # UcxOptions fields
    diag: str = ""                         # benchmarks only: "no-gather" / "no-scatter" skip those copies
    prepped: bool = True                   # staged WRITEs of whole prepared slots (StagingEndpoint)
    direct_min_bytes: int = 1 << 20        # chunks of ranges this long on average skip the gather (0: never)

    def mem_of(self, i: int) -> str:
        if self.mem:
            return self.mem[i]
        return "DRAM" if self.device is None else "VRAM"


@dataclass(frozen=True)
class Ranges:
    """Row-aligned source and destination ranges: (region, offset, length) per row, int64."""

    src: np.ndarray
    dst: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.src[:, 2].sum())


def code(region: int, n: int, offset: int = 0) -> np.ndarray:
    """Content code: byte ``o`` of region ``r`` is a function of (r, o) that differs between neighbours."""
    o = np.arange(offset, offset + n, dtype=np.uint64)
    return ((o * np.uint64(2654435761) >> np.uint64(13)) + o + np.uint64(region * 97 + 1)).astype(np.uint8)


def _alloc(side: Side, fill: str):
    return [_region_tensor(side, i, n, fill) for i, n in enumerate(side.regions)]


def _region_tensor(side: Side, i: int, n: int, fill: str):
    """Region ``i`` of ``n`` bytes: content codes (``fill="code"``) or noise, zeros without ``side.fill``."""
    import torch

    pin = side.pin and torch.cuda.is_available()
    if not side.fill:  # throughput runs: no codes (too slow to make for GiBs), nothing checked
        where = f"cuda:{side.device or 0}" if side.mem_of(i) == "VRAM" else "cpu"
        t = torch.zeros(n, dtype=torch.uint8, device=where)
        return t.pin_memory() if where == "cpu" and pin else t
    data = torch.from_numpy(code(i, n) if fill == "code" else np.full(n, SEED_NOISE, dtype=np.uint8))
    if side.mem_of(i) == "VRAM":
        return data.to(f"cuda:{side.device or 0}")
    return data.pin_memory() if pin else data


def _rows(ranges: np.ndarray, bases: list[int]) -> np.ndarray:
    b = np.asarray(bases, dtype=np.uint64)[ranges[:, 0]]
    return np.stack([b + ranges[:, 1].astype(np.uint64), ranges[:, 2].astype(np.uint64)], axis=1)


def _child(conn, role: str, side: Side) -> None:  # pragma: no cover - runs in the child process
    from kvlc.runtime.nixl.core import Agent
    from kvlc.runtime.staging.endpoint import BounceBuffer, Regions, StagingEndpoint
    from kvlc.runtime.staging.wire import BounceInfo
    from kvlc.runtime.nixl.ucx import UcxOptions

    agent = Agent(f"stage-{role}-{uuid.uuid4().hex[:6]}", ucx=UcxOptions(**side.ucx))
    tensors = _alloc(side, "code" if role == "sender" else "noise")
    _register(agent, side, tensors)
    bounce = BounceBuffer(agent, side.slot_bytes, side.slots, side.device)
    ep = StagingEndpoint(agent, Regions.of_tensors(tensors), bounce, prepped=side.prepped,
                         direct_min_bytes=side.direct_min_bytes)
    if side.diag:  # where does the time go: the same protocol without one of the copies
        setattr(ep.copier, side.diag.split("-")[1], lambda *args: None)
    bases = [int(t.data_ptr()) for t in tensors]
    conn.send({"md": agent.metadata(), "bases": bases, "bounce": bounce.info().to_dict(), "name": agent.name,
               "mems": [side.mem_of(i) for i in range(len(tensors))], "dev": side.device or 0})
    peer = conn.recv()
    agent.add_remote(peer["md"])
    if role == "sender":
        ep.add_peer(BounceInfo.from_dict(peer["bounce"]))
    else:
        ep.accept_from(peer["name"], bounce)
    conn.send("ready")
    _answer(conn, agent, ep, tensors, bases, peer)
    agent.close()


def _register(agent, side: Side, tensors: list) -> None:
    for i, t in enumerate(tensors):
        agent.register(np.array([[t.data_ptr(), t.numel(), (side.device or 0) if side.mem_of(i) == "VRAM" else 0]],
                                dtype=np.uint64), side.mem_of(i), what=f"region {i}")


def _answer(conn, agent, ep, tensors: list, bases: list[int], peer: dict) -> None:
    """Answer the parent's commands until ``stop``; a failed send tells the receiver to stop serving."""
    ops = {"staged": _staged, "raw": _raw, "serve": _serve, "check": _check, "ping": _ping}
    while True:
        cmd, args = conn.recv()
        if cmd == "stop":
            break
        try:
            conn.send(("ok", ops[cmd](agent, ep, tensors, bases, peer, *args)))
        except Exception as exc:
            if cmd in ("staged", "raw"):  # release the receiver's serve loop
                try:
                    agent.send_notif(peer["name"], b"stop")
                except Exception:
                    pass
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _staged(agent, ep, tensors, bases, peer, requests: list, timeout: float) -> dict:
    """Sender: stage every request, wait until each is scattered on the receiver; then tell it to stop."""
    t0 = time.perf_counter()
    batch = ep.stats.setdefault("batches", 0)
    ep.stats["batches"] += 1
    for i, r in enumerate(requests):
        ep.send(f"b{batch}-r{i}", _rows(r.src, bases), _rows(r.dst, peer["bases"]), peer["name"], timeout=timeout)
    want, events = len(requests), []
    while len(events) < want:
        for sender, msgs in agent.notifs().items():
            for m in msgs:
                ep.handle(sender, m)
        events += ep.progress()
    seconds = time.perf_counter() - t0
    agent.send_notif(peer["name"], b"stop")
    failed = {e.req: e.reason for e in events if e.kind != "sent"}
    return {"seconds": seconds, "failed": failed, "copy_calls": ep.copier.calls, "stats": dict(ep.stats)}


def _serve(agent, ep, tensors, bases, peer) -> dict:
    """Receiver: handle staging messages and progress until the sender says stop."""
    received, failed = 0, {}
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        stop = False
        for sender, msgs in agent.notifs().items():
            for m in msgs:
                if m == b"stop":
                    stop = True
                elif m == b"ping":
                    agent.send_notif(sender, b"pong")
                elif not ep.handle(sender, m):
                    pass
        for e in ep.progress():
            if e.kind == "received":
                received += 1
            else:
                failed[e.req] = e.reason
        if stop and not ep.busy:
            return {"received": received, "failed": failed, "copy_calls": ep.copier.calls}
    raise TimeoutError("receiver: no stop from the sender in 600 s")


def _ping(agent, ep, tensors, bases, peer, n: int) -> dict:
    """Sender: ``n`` notification round trips (ping, the receiver's pong), one at a time."""
    t0 = time.perf_counter()
    for _ in range(n):
        agent.send_notif(peer["name"], b"ping")
        while not any(b"pong" in v for v in agent.notifs().values()):
            pass
    seconds = time.perf_counter() - t0
    agent.send_notif(peer["name"], b"stop")
    return {"seconds": seconds, "round_trip_us": seconds / n * 1e6}


def _serial(agent, tensors, bases, peer, op: str, requests: list, reps: int, single: bool) -> dict:
    """Create, post, wait for and release one request at a time (creation inside the timing); ``each``:
    every request's seconds, in order (a failed request raises)."""
    from kvlc.runtime.nixl.core import XferState

    each = []
    t0 = time.perf_counter()
    for _ in range(reps):
        for r in requests:
            t_req = time.perf_counter()
            x = _raw_xfer(agent, tensors, bases, peer, peer["mems"], op, r, single)
            state = agent.post(x)
            while state is XferState.PROC:
                state = agent.state(x)
            x.release()
            if state is not XferState.DONE:
                raise RuntimeError(f"raw {op} failed: {state}")
            each.append(time.perf_counter() - t_req)
    seconds = time.perf_counter() - t0
    agent.send_notif(peer["name"], b"stop")
    return {"seconds": seconds, "bytes": reps * sum(r.nbytes for r in requests), "each": each}


def _raw(agent, ep, tensors, bases, peer, op: str, requests: list, reps: int, single: bool,
         serial: bool = False, inflight: bool = False) -> dict:
    """Sender: plain NIXL requests (one descriptor of the same bytes, or the rows as given), all of a
    round in flight at once, timed. Created before the clock starts, or with ``inflight`` inside it,
    each posted right after it is created (what a runtime pays per request, no runtime code);
    ``serial``: see :func:`_serial`."""
    if serial:
        return _serial(agent, tensors, bases, peer, op, requests, reps, single)

    def make():
        return [_raw_xfer(agent, tensors, bases, peer, peer["mems"], op, r, single) for r in requests]

    xfers = [None if inflight else make() for _ in range(reps)]
    done = []
    t0 = time.perf_counter()
    for round_ in xfers:
        if round_ is None:  # create and post one by one, inside the clock
            round_, states = [], []
            for r in requests:
                round_.append(_raw_xfer(agent, tensors, bases, peer, peer["mems"], op, r, single))
                states.append(agent.post(round_[-1]))
        else:
            states = [agent.post(x) for x in round_]
        _wait_all(agent, round_, states, op)
        done.append(round_)
    seconds = time.perf_counter() - t0
    for round_ in done:
        for x in round_:
            x.release()
    agent.send_notif(peer["name"], b"stop")
    return {"seconds": seconds, "bytes": reps * sum(r.nbytes for r in requests)}


def _wait_all(agent, xfers: list, states: list, op: str) -> None:
    from kvlc.runtime.nixl.core import XferState

    for x, state in zip(xfers, states):
        while state is XferState.PROC:
            state = agent.state(x)
        if state is not XferState.DONE:
            raise RuntimeError(f"raw {op} failed: {x.error}")


def _raw_xfer(agent, tensors, bases, peer, mems, op, r, single):
    if single:
        n = r.nbytes
        lr = np.array([[bases[0], n]], dtype=np.uint64)
        rr = np.array([[peer["bases"][0], n]], dtype=np.uint64)
        lm, rm = _mem(tensors[0]), mems[0]
    else:
        lr, rr = _rows(r.src, bases), _rows(r.dst, peer["bases"])
        lm, rm = _mem(tensors[int(r.src[0, 0])]), mems[int(r.dst[0, 0])]
    dev_l = (tensors[0].device.index or 0) if lm == "VRAM" else 0
    lr = np.concatenate([lr, np.full((len(lr), 1), dev_l, dtype=np.uint64)], axis=1)
    rr = np.concatenate([rr, np.full((len(rr), 1), peer["dev"] if rm == "VRAM" else 0, dtype=np.uint64)], axis=1)
    return agent.initialize(op, lr, lm, rr, rm, peer["name"])


def _mem(t) -> str:
    return "VRAM" if t.device.type == "cuda" else "DRAM"


def _check(agent, ep, tensors, bases, peer, requests: list) -> dict:
    """Receiver: every destination byte equals its source's code, every other byte is still noise."""
    expect = [np.full(t.numel(), SEED_NOISE, dtype=np.uint8) for t in tensors]
    for r in requests:
        for (sr, so, n), (dr, do, _) in zip(r.src.tolist(), r.dst.tolist()):
            expect[dr][do:do + n] = code(sr, n, so)
    bad = []
    for i, t in enumerate(tensors):
        got = t.cpu().numpy()
        diff = np.flatnonzero(got != expect[i])
        if len(diff):
            bad.append(f"region {i}: {len(diff)} bytes differ, first at offset {int(diff[0])}")
    return {"mismatches": bad, "checked_bytes": int(sum(t.numel() for t in tensors))}


class Pair:
    """A running sender/receiver pair (see the module doc). Close it with :meth:`stop`."""

    def __init__(self, sender: Side, receiver: Side, timeout: float = 120.0):
        ctx = mp.get_context("spawn")
        self.timeout = timeout
        self._conns, self._procs = [], []
        for role, side in (("sender", sender), ("receiver", receiver)):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_child, args=(b, role, side), daemon=True)
            p.start()
            self._conns.append(a)
            self._procs.append(p)
        try:
            s_hello, r_hello = (self._recv(c) for c in self._conns)
            self._conns[0].send(r_hello)
            self._conns[1].send(s_hello)
            for c in self._conns:
                if self._recv(c) != "ready":
                    raise RuntimeError("staging pair: a child did not get ready")
        except BaseException:
            self.stop(grace=1.0)
            raise

    def _recv(self, conn):
        deadline = time.monotonic() + self.timeout
        while not conn.poll(0.2):
            dead = [p.exitcode for p in self._procs if not p.is_alive()]
            if dead:
                raise RuntimeError(f"staging pair: a child process exited (code {dead[0]})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"staging pair: no answer in {self.timeout}s")
        return conn.recv()

    def _both(self, send_cmd, recv_cmd) -> tuple[dict, dict]:
        self._conns[0].send(send_cmd)
        self._conns[1].send(recv_cmd)
        out = []
        for c in self._conns:
            status, value = self._recv(c)
            if status != "ok":
                raise RuntimeError(f"staging pair: {value}")
            out.append(value)
        return out[0], out[1]

    def staged(self, requests: list[Ranges], timeout: float = 60.0) -> tuple[dict, dict]:
        """Stage ``requests`` (sender, receiver results: seconds, failures, copy calls)."""
        return self._both(("staged", (requests, timeout)), ("serve", ()))

    def raw(self, op: str, requests: list[Ranges], reps: int = 1, single: bool = True, serial: bool = False,
            inflight: bool = False) -> dict:
        """Plain NIXL ``op`` (WRITE | READ) of the same bytes; timed on the sender (see :func:`_raw`)."""
        return self._both(("raw", (op, requests, reps, single, serial, inflight)), ("serve", ()))[0]

    def ping(self, n: int = 200) -> dict:
        """Notification round trip between the two agents (microseconds)."""
        return self._both(("ping", (n,)), ("serve", ()))[0]

    def check(self, requests: list[Ranges]) -> dict:
        """Compare the receiver's memory with what ``requests`` must have written (and nothing else)."""
        self._conns[1].send(("check", (requests,)))
        status, value = self._recv(self._conns[1])
        if status != "ok":
            raise RuntimeError(f"staging pair: {value}")
        return value

    def stop(self, grace: float = 20.0) -> None:
        for c in self._conns:
            try:
                c.send(("stop", ()))
            except (OSError, BrokenPipeError):
                pass
        for p in self._procs:
            p.join(timeout=grace)
            if p.is_alive():
                p.kill()


def fragmented(src_regions: int, dst_regions: int, n: int, size: int, pool_blocks: int, seed: int = 0,
               src_region0: int = 0, dst_region0: int = 0) -> Ranges:
    """``n`` blocks of ``size`` bytes at random distinct block slots of ``pool_blocks`` per region, both sides."""
    rng = np.random.default_rng(seed)
    per = -(-n // src_regions)
    src, dst = [], []
    for i in range(n):
        src.append((src_region0 + i // per % src_regions, 0, size))
        dst.append((dst_region0 + i // per % dst_regions, 0, size))
    src, dst = np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)
    for arr in (src, dst):
        for r in np.unique(arr[:, 0]):
            m = arr[:, 0] == r
            arr[m, 1] = rng.choice(pool_blocks, int(m.sum()), replace=False) * size
    return Ranges(src, dst)
