"""Where a pull-via-push request's time goes, on both sides, against a push of the same blocks.

The consumer KvAgent runs in this process, on one thread that asks and polls as the GPU suite's does
(``--nap`` seconds after an empty poll; 0: it spins); the producer runs in a spawned engine process
(:mod:`kvlc.demo.procs`) whose own methods are wrapped with time stamps (nothing else changes). Both
sides stamp ``time.perf_counter()``, the host's monotonic clock, so the stages line up across the two
processes. Per request, microseconds since its round's first call began (``--inflight K``: K requests a round,
each issued as soon as the call before returned, then all waited for; stage ``x#j`` is the round's j-th
request's; default one request a round):

* ``asked``: ``read()`` returned (the ask is written, or queued for the sender);
* ``framed``: the producer's server thread had the ask's frame read off its socket (before it is decoded);
* ``arrived``: the producer's server thread began handling the ask (decoded);
* ``instantiated``: its rows were made (the check again, rows);
* ``submitted``: its WRITE was started (``KvAgent.submit`` returned);
* ``replied``: the server thread's reply to the ask was written (asks that came in together are answered
  one after another, then their replies written at once; it reads the next asks after this);
* ``seen``: a progress step of the producer saw every part done;
* ``told``: the ``done`` notification went out;
* ``finished``: this engine's ``poll()`` handed the request back as finished.

``push``: the same blocks pushed from this process into the engine process (``Peer.write``, polled the
same way), write() to finished. Per mode a host line: the initiating call's wall against its thread's CPU time
(push: ``write()``; pull via push: the producer's server thread from the ask's frame read to its reply
written, asks read together sharing their batch's wall and CPU evenly; a wall well over the CPU time is a
wait, for the GIL or a lock), and the share of a round the producer's engine thread spent in ``poll()``
(``--engine-step-ms``: it polls at most once so often).
Llama-3.1-8B scaled to ``--pool-mib`` per side, ``--tokens`` per request, ``--inflight`` requests a round;
VRAM on ``cuda:0`` with ``--gpu``, shared DRAM otherwise.

Run:  python3 benchmarks/probes/pvp_timeline.py [--gpu] [--tokens 2048] [--rounds 60] [--nap 0] [--inflight 8]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import secrets
import sys
import threading
import time
from pathlib import Path

import numpy as np

for _p in (Path(__file__).resolve().parents[2], Path(__file__).resolve().parent):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from kvlc.demo.run import DEFAULT_LAYOUT, make_workload, scaled_plan  # noqa: E402
from ipc_timeline import workload_args  # noqa: E402

REMOTE = ("framed", "arrived", "instantiated", "submitted", "replied", "seen", "told")
STAGES = ("asked", *REMOTE, "finished")


def _instrumented_main(conn) -> None:  # pragma: no cover - runs in the engine process
    """The engine process's loop, its producer's stages stamped; a ``stamps`` command hands them over."""
    from kvlc.demo import procs_child
    from kvlc.runtime import agent, server, transfer

    at: dict[str, dict[str, float]] = {}

    def stamp(req: str, stage: str) -> None:
        at.setdefault(req, {}).setdefault(stage, time.perf_counter())

    from kvlc.runtime.channel import tcp

    pull, inst, submit = server.pull_request, server.instantiate, agent.KvAgent.submit
    read, answer, write_frames = tcp.FrameReader.read, tcp.ChannelServer._answer, tcp.write_frames
    current = [""]

    class Batch(threading.local):
        """A server thread reads the frames that came in together, answers each, then writes their replies at
        once: per thread, the read times not yet answered, the asks answered since the last write, the CPU time
        at the first read after that write (an ask's CPU: its batch's, shared evenly), and when the frame being
        answered was read."""

        def __init__(self):
            self.reads: list[float] = []
            self.asks: list[str] = []
            self.cpu = self.at = 0.0

    framed = Batch()
    cpu: dict[str, float] = {}  # req -> the server thread's CPU seconds from its frame read to its reply written
    polls: list[tuple[float, float]] = []  # the engine thread's poll() calls: (began, ended)

    def read_frame(self, *args, **kw):
        out = read(self, *args, **kw)
        if self._chunk:  # an authenticated connection's frames (the handshake's are read exactly)
            if not framed.reads and not framed.asks:
                framed.cpu = time.thread_time()
            framed.reads.append(time.perf_counter())
        return out

    def answered(self, conn, frame):
        framed.at = framed.reads.pop(0) if framed.reads else time.perf_counter()
        return answer(self, conn, frame)

    def replied(*args, **kw):
        out = write_frames(*args, **kw)
        asks, framed.asks = framed.asks, []
        spent, t = time.thread_time() - framed.cpu, time.perf_counter()
        for req in asks:  # one time for the batch: its asks are told apart by it
            at.setdefault(req, {}).setdefault("replied", t)
            cpu[req] = spent / len(asks)
        return out

    def pull_request(a, c, msg):
        current[0] = msg.req
        framed.asks.append(msg.req)
        at.setdefault(msg.req, {}).setdefault("framed", framed.at)
        stamp(msg.req, "arrived")
        return pull(a, c, msg)

    step = float(os.environ.get("PVP_TIMELINE_ENGINE_STEP_MS", "0")) / 1e3
    pump_all = procs_child._Child.pump_all

    def stepped(child):  # the engine thread's polls, timed; with a step, at most one per step
        t = time.perf_counter()
        if step and polls and t - polls[-1][0] < step:
            return False
        busy = pump_all(child)
        polls.append((t, time.perf_counter()))
        return busy

    procs_child._Child.pump_all = stepped

    def instantiate(*args, **kw):
        out = inst(*args, **kw)
        stamp(current[0], "instantiated")
        return out

    def submitted(self, key, req, *args, **kw):
        out = submit(self, key, req, *args, **kw)
        stamp(req, "submitted")
        return out

    progress, notify = transfer.Executor.progress, transfer.Executor._notify_done

    def progressed(self):
        ended = progress(self)
        for o in ended:
            stamp(o.req, "seen")
        return ended

    def notified(self):
        pending = [o.req for o in self._done]
        notify(self)
        for req in pending:
            stamp(req, "told")

    server.pull_request, server.instantiate, agent.KvAgent.submit = pull_request, instantiate, submitted
    tcp.FrameReader.read, tcp.ChannelServer._answer, tcp.write_frames = read_frame, answered, replied
    transfer.Executor.progress, transfer.Executor._notify_done = progressed, notified
    procs_child._AGENT_COMMANDS["stamps"] = lambda child, h, aid, args: {
        "at": {k: dict(v) for k, v in at.items()}, "cpu": dict(cpu), "polls": list(polls)}
    procs_child._main(conn)


def _engine():
    """The producer's engine process, started with :func:`_instrumented_main` as its loop."""
    from kvlc.demo.procs import EngineProcess

    proc = EngineProcess.__new__(EngineProcess)
    ctx = mp.get_context("spawn")
    proc._conn, child = ctx.Pipe()
    proc.process = ctx.Process(target=_instrumented_main, args=(child,), daemon=True)
    proc.process.start()
    child.close()
    proc._next, proc.agents = 0, []
    return proc


def run(args) -> tuple[dict, dict]:
    from kvlc.demo.procs import EngineConfig
    from kvlc.runtime.agent import KvAgent
    from kvlc.runtime.binding import allocate
    from kvlc.runtime.settings import AgentSettings

    plan = scaled_plan(DEFAULT_LAYOUT, args.pool_mib << 20, to_dram=not args.gpu)
    k = args.inflight  # rounds of k requests in flight, destinations disjoint within a round
    rounds = [make_workload(plan, plan, k, args.tokens, ids=args.ids, seed=i)[0] for i in range(args.rounds)]
    if any(len(r) != k for r in rounds):
        raise SystemExit(f"--pool-mib {args.pool_mib} holds fewer than {k} requests of {args.tokens} tokens")
    secret = secrets.token_hex(32)
    os.environ["PVP_TIMELINE_ENGINE_STEP_MS"] = str(args.engine_step_ms)  # (the spawned engine reads it)
    proc = _engine()
    shared = {} if args.gpu else {"shared": True}
    out: dict = {"pvp": [], "push": []}
    try:
        prod = proc.add(EngineConfig(plan.to_json(), 0, fill="random", secret=secret, engine_id="pvp-prod",
                                     pin=args.gpu, **shared))
        me = KvAgent(plan, 0, allocate(plan, pin=args.gpu, shared=not args.gpu),
                     AgentSettings(secret=secret, engine_id="pvp-cons"))
        try:
            pull = me.connect(prod.address, direction="READ", mode="pull_via_push")
            push = me.connect(prod.address, direction="WRITE")
            for mode in args.order.split(","):
                for r, batch in enumerate(rounds):
                    out[mode].extend(_round(me, pull if mode == "pvp" else push, mode, r, batch, args.nap))
            got = prod.call("stamps")
        finally:
            me.close()
    finally:
        proc.stop()
    timed = {mode: [r for r in rows if r["round"] >= args.warmup] for mode, rows in out.items() if rows}
    return _stages(timed, got["at"]), _host_time(timed, got)


def _round(me, peer, mode: str, r: int, batch: list, nap: float) -> list[dict]:
    """One round: its requests issued back to back (each as soon as the call before returned), then
    waited for; a row per request (its round, its place in it, and when its round began: ``t0``)."""
    rows, t0 = [], time.perf_counter()
    for j, (_, cids, pids, n) in enumerate(batch):
        req = f"{mode}-{r}-{j}"
        called, cpu = time.perf_counter(), time.thread_time()
        if mode == "pvp":
            peer.read(req, cids, pids, n)
        else:
            peer.write(req, pids, cids, n)
        rows.append({"req": req, "round": r, "pos": j, "t0": t0, "called": called, "asked": time.perf_counter(),
                     "cpu": time.thread_time() - cpu})
    left = {row["req"]: row for row in rows}
    deadline = time.monotonic() + 60
    while left and time.monotonic() < deadline:
        c = me.poll()
        if c.failed:
            raise RuntimeError(f"failed: {dict(c.failed)}")
        now = time.perf_counter()
        for req in c.finished:
            if req in left:
                left.pop(req)["finished"] = now
        if not c:
            time.sleep(nap)
    if left:
        raise RuntimeError(f"{sorted(left)} not finished in 60 s")
    return rows


def _spans(rows: list[dict]) -> list[tuple[float, float]]:
    """Each round's (began, its last request finished), perf_counter seconds."""
    spans: dict[int, tuple[float, float]] = {}
    for r in rows:
        began, ended = spans.get(r["round"], (r["t0"], r["finished"]))
        spans[r["round"]] = (began, max(ended, r["finished"]))
    return list(spans.values())


def _p50(values) -> float:
    return float(np.percentile(values, 50))


def _stages(timed: dict, stamps: dict) -> dict:
    """p50 / p90 of each stage (``x#j``: of a round's j-th request), microseconds since the round's first call
    began, and of the whole round."""
    doc = {}
    for mode, rows in timed.items():
        per: dict[str, list[float]] = {}
        for row in rows:
            remote = stamps.get(row["req"], {}) if mode == "pvp" else {}
            for s in ("called", *STAGES):
                t = row.get(s, remote.get(s))
                if t is not None:
                    per.setdefault(s if row["pos"] == 0 else f"{s}#{row['pos']}", []).append((t - row["t0"]) * 1e6)
        per["round"] = [(b - a) * 1e6 for a, b in _spans(rows)]
        doc[mode] = {s: {"p50_us": _p50(v), "p90_us": float(np.percentile(v, 90)), "n": len(v)}
                     for s, v in per.items()}
    return doc


def _host_time(timed: dict, got: dict) -> dict:
    """Per request, p50 microseconds: the wall and the thread's own CPU time of the initiating call (push:
    ``write()`` on this thread; pull via push: the producer's server thread from the ask's frame read to its
    reply written, asks read together sharing their batch's evenly; a wall well over the CPU time is a wait:
    the GIL, the agent's lock); and the share of each round's wall that the producer's engine thread spent
    inside ``poll()``."""
    doc: dict = {}
    polls = got["polls"]
    for mode, rows in timed.items():
        if mode == "push":
            wall = [(r["asked"] - r["called"]) * 1e6 for r in rows]
            own = [r["cpu"] * 1e6 for r in rows]
        else:
            batches: dict[float, list[str]] = {}  # asks whose replies went out in one write: one batch
            for q in (r["req"] for r in rows if r["req"] in got["cpu"]):
                batches.setdefault(got["at"][q]["replied"], []).append(q)
            wall = [(end - min(got["at"][q]["framed"] for q in qs)) * 1e6 / len(qs)
                    for end, qs in batches.items() for _ in qs]
            own = [got["cpu"][q] * 1e6 for qs in batches.values() for q in qs]
        spans = _spans(rows)
        doc[mode] = {"call_wall_p50_us": _p50(wall), "call_cpu_p50_us": _p50(own),
                     "engine_poll_share_p50": _p50([sum(max(0.0, min(e, b) - max(s, a)) for s, e in polls) / (b - a)
                                                    for a, b in spans]),
                     "engine_polls_per_round_p50": _p50([sum(a <= s <= b for s, _ in polls) for a, b in spans])}
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_args(ap)
    ap.add_argument("--nap", type=float, default=0.0, help="seconds the engine thread sleeps after an empty poll")
    ap.add_argument("--order", default="push,pvp", help="modes, in the order they run")
    ap.add_argument("--engine-step-ms", type=float, default=0.0,
                    help="the producer's engine thread polls at most once this often (0: as the demo engine does)")
    ap.add_argument("--inflight", type=int, default=1,
                    help="requests issued back to back a round, then waited for (stages #j: the round's j-th)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    doc = {"command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]), "gpu": args.gpu,
           "tokens": args.tokens, "ids": args.ids, "nap": args.nap, "inflight": args.inflight,
           "engine_step_ms": args.engine_step_ms}
    doc["modes"], doc["host"] = run(args)
    host = doc["host"]
    for mode, st in doc["modes"].items():
        for j in range(args.inflight):
            names = [s if j == 0 else f"{s}#{j}" for s in ("called", *STAGES)]
            line = ", ".join(f"{n.split('#')[0]} {st[n]['p50_us']:,.0f}/{st[n]['p90_us']:,.0f}"
                             for n in names if n in st)
            print(f"{mode:5s} #{j} ({args.tokens} tokens, {args.ids}): us since the round began, p50/p90: {line}",
                  flush=True)
        print(f"{mode:5s} round of {args.inflight}: {st['round']['p50_us']:,.0f}/{st['round']['p90_us']:,.0f} us",
              flush=True)
        h = host.get(mode)
        if h:
            print(f"{mode:5s} host, p50: the call {h['call_wall_p50_us']:,.0f} us wall, {h['call_cpu_p50_us']:,.0f} us "
                  f"its thread's CPU; the engine thread in poll() {h['engine_poll_share_p50']:.0%} of a round "
                  f"({h['engine_polls_per_round_p50']:.0f} polls)", flush=True)
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
