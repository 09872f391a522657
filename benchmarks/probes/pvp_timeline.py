"""Where one pull-via-push request's time goes, on both sides, against a push of the same blocks.

The consumer KvAgent runs in this process, on one thread that asks and polls as the GPU suite's does
(``--nap`` seconds after an empty poll; 0: it spins); the producer runs in a spawned engine process
(:mod:`kvlc.demo.procs`) whose own methods are wrapped with time stamps (nothing else changes). Both
sides stamp ``time.perf_counter()``, the host's monotonic clock, so the stages line up across the two
processes. Per request, microseconds since ``Peer.read`` began:

* ``asked``: ``read()`` returned (the ask is written, or queued for the sender);
* ``arrived``: the producer's server thread began handling the ask;
* ``instantiated``: its rows were made (the check again, rows);
* ``submitted``: its WRITE was started (``KvAgent.submit`` returned);
* ``seen``: a progress step of the producer saw every part done;
* ``told``: the ``done`` notification went out;
* ``finished``: this engine's ``poll()`` handed the request back as finished.

``push``: the same blocks pushed from this process into the engine process (``Peer.write``, polled the
same way), write() to finished. Llama-3.1-8B scaled to ``--pool-mib`` per side, ``--tokens`` per request,
one request at a time; VRAM on ``cuda:0`` with ``--gpu``, shared DRAM otherwise.

Run:  python3 benchmarks/probes/pvp_timeline.py [--gpu] [--tokens 2048] [--rounds 60] [--nap 0]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import secrets
import sys
import time
from pathlib import Path

import numpy as np

for _p in (Path(__file__).resolve().parents[2], Path(__file__).resolve().parent):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from kvlc.demo.run import DEFAULT_LAYOUT, make_workload, scaled_plan  # noqa: E402
from ipc_timeline import workload_args  # noqa: E402

REMOTE = ("arrived", "instantiated", "submitted", "seen", "told")
STAGES = ("asked", *REMOTE, "finished")


def _instrumented_main(conn) -> None:  # pragma: no cover - runs in the engine process
    """The engine process's loop, its producer's stages stamped; a ``stamps`` command hands them over."""
    from kvlc.demo import procs_child
    from kvlc.runtime import agent, server, transfer

    at: dict[str, dict[str, float]] = {}

    def stamp(req: str, stage: str) -> None:
        at.setdefault(req, {}).setdefault(stage, time.perf_counter())

    pull, inst, submit = server.pull_request, server.instantiate, agent.KvAgent.submit
    current = [""]

    def pull_request(a, c, msg):
        current[0] = msg.req
        stamp(msg.req, "arrived")
        return pull(a, c, msg)

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
    transfer.Executor.progress, transfer.Executor._notify_done = progressed, notified
    procs_child._AGENT_COMMANDS["stamps"] = lambda child, h, aid, args: {k: dict(v) for k, v in at.items()}
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


def _wait(agent, req: str, nap: float) -> float:
    """Poll as an engine's thread does (nap only after an empty poll) until ``req`` finished; when it did."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        c = agent.poll()
        if c.failed:
            raise RuntimeError(f"failed: {dict(c.failed)}")
        if req in c.finished:
            return time.perf_counter()
        if not c:
            time.sleep(nap)
    raise RuntimeError(f"{req} not finished in 60 s")


def run(args) -> dict:
    from kvlc.demo.procs import EngineConfig
    from kvlc.runtime.agent import KvAgent
    from kvlc.runtime.binding import allocate
    from kvlc.runtime.settings import AgentSettings

    plan = scaled_plan(DEFAULT_LAYOUT, args.pool_mib << 20, to_dram=not args.gpu)
    work = [make_workload(plan, plan, 1, args.tokens, ids=args.ids, seed=i)[0][0] for i in range(args.rounds)]
    secret = secrets.token_hex(32)
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
                for i, (_, cids, pids, n) in enumerate(work):
                    req = f"{mode}-{i}"
                    t0 = time.perf_counter()
                    if mode == "pvp":
                        pull.read(req, cids, pids, n)
                    else:
                        push.write(req, pids, cids, n)
                    asked = time.perf_counter()
                    out[mode].append({"t0": t0, "asked": asked, "finished": _wait(me, req, args.nap)})
            stamps = prod.call("stamps")
        finally:
            me.close()
    finally:
        proc.stop()
    return _stages(out, stamps, args.warmup)


def _stages(out: dict, stamps: dict, warmup: int) -> dict:
    """p50 / p90 of each stage, microseconds since read() (or write()) began."""
    doc = {}
    for mode, rows in out.items():
        if not rows:
            continue
        per = {s: [] for s in STAGES}
        for i, row in enumerate(rows[warmup:], start=warmup):
            remote = stamps.get(f"{mode}-{i}", {}) if mode == "pvp" else {}
            for s in STAGES:
                t = row.get(s, remote.get(s))
                if t is not None:
                    per[s].append((t - row["t0"]) * 1e6)
        doc[mode] = {s: {"p50_us": float(np.percentile(v, 50)), "p90_us": float(np.percentile(v, 90)), "n": len(v)}
                     for s, v in per.items() if v}
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_args(ap)
    ap.add_argument("--nap", type=float, default=0.0, help="seconds the engine thread sleeps after an empty poll")
    ap.add_argument("--order", default="push,pvp", help="modes, in the order they run")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    doc = {"command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]), "gpu": args.gpu,
           "tokens": args.tokens, "ids": args.ids, "nap": args.nap, "modes": run(args)}
    for mode, st in doc["modes"].items():
        line = ", ".join(f"{s} {st[s]['p50_us']:,.0f}/{st[s]['p90_us']:,.0f}" for s in STAGES if s in st)
        print(f"{mode:5s} ({args.tokens} tokens, {args.ids}): us since the call, p50/p90: {line}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
