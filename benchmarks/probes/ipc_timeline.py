"""Where one push request's time goes, stage by stage, on the same-host copy path and on NIXL.

The producer KvAgent runs in this process, the consumer in a spawned engine process
(:mod:`kvlc.demo.procs`); Llama-3.1-8B scaled to ``--pool-mib`` per side, requests of ``--tokens``
with contiguous or random block ids, one at a time. The producer's own methods are wrapped with
time stamps (nothing else changes), so every request gives, from ``Peer.write``:

* ``checked``: until the request's check returned (types, counts, bounds, repeats of the ids);
* ``rows``: until its descriptor rows were written (``emit``);
* ``created``: until the first part was created (the copy path: the peer's rows translated into its
  mapped window; NIXL: its descriptor lists and ``initialize_xfer``);
* ``posting``: until the first part's ``post`` began (checks, rows, NIXL create: kvlc's host work);
* ``launching`` / ``launched``: on the GPU copy path, until ``GpuCopy`` began / ended starting the part's copy
  (``start_blocks`` or ``start_rows``: the event record and wait, the ids or table into the ring, the launch);
* ``post``: until that ``post`` returned (for the copy path: row table, upload, launch);
* ``write``: until ``write()`` returned;
* ``seen``: until a progress step first saw every part done (copy event or NIXL state);
* ``told``: until the ``done`` notification went out (``tell_done`` returned), and how long that call took;
* ``finished``: until ``poll()`` handed the request back as finished (what an engine sees).

Modes (``--modes``): ``ipc`` (``KVLC_IPC=auto``), ``nixl`` (``KVLC_IPC=off``), alternated per round so
both see the same machine. DRAM shared-memory pools on a CPU host, VRAM on ``cuda:0`` with ``--gpu``.
Prints p50 / p90 of each stage and writes the JSON (``--out``).

``--busy`` runs a Python thread that never blocks (an engine's own loop: its scheduler, its model
runner's Python) beside the requests: every call that releases the GIL then waits until that thread is
made to give it back (the switch interval, 5 ms).

``--batches K`` cycles K sets of ids (many rounds without as many workloads: for a profiler run
around this script, e.g. ``py-spy record -f raw -- python3 ...``).

Run:  python3 benchmarks/probes/ipc_timeline.py [--gpu] [--tokens 1024] [--rounds 50] [--ids random]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import sys
import threading
import time
from pathlib import Path

import numpy as np

for _p in (Path(__file__).resolve().parents[2], Path(__file__).resolve().parents[1], Path(__file__).resolve().parent):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from kvlc.demo.run import DEFAULT_LAYOUT, make_workload, scaled_plan  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PAIRS = {  # --pair: (producer, consumer) layouts
    "llama": (DEFAULT_LAYOUT, DEFAULT_LAYOUT),
    # the GPU suite's mixed case: DeepSeek-V3.2 with its latent in host memory pushing into one all on the GPU
    "mixed": (ROOT / "layouts" / "deepseek-v3.2-hisparse-tp8.yaml", ROOT / "layouts" / "deepseek-v3.2-tp8.yaml"),
}
STAGES = ("checked", "rows", "created", "posting", "launching", "launched", "post", "write", "seen", "told",
          "finished")


class Stamps:
    """Per request id: stage -> seconds since its ``write()`` began (first occurrence kept)."""

    def __init__(self):
        self.t0: dict[str, float] = {}
        self.at: dict[str, dict[str, float]] = {}
        self.current: str | None = None  # the request whose write() is running (post happens inside it)
        self.notif_s: list[float] = []

    def mark(self, req: str | None, stage: str) -> None:
        if req is None or req not in self.t0:
            return
        self.at[req].setdefault(stage, time.perf_counter() - self.t0[req])

    def begin(self, req: str) -> None:
        self.t0[req], self.at[req], self.current = time.perf_counter(), {}, req


def instrument(stamps: Stamps) -> None:
    """Wrap the producer-side methods that mark each stage (class level: this process only)."""
    from kvlc.compiler.request import instantiate as inst
    from kvlc.runtime import transfer
    from kvlc.runtime.ipc.route import IpcRoute
    from kvlc.runtime.nixl.core import Agent

    def after(owner, name: str, stage: str) -> None:
        orig = getattr(owner, name)

        def wrapped(*a, **k):
            out = orig(*a, **k)
            stamps.mark(stamps.current, stage)
            return out
        setattr(owner, name, wrapped)

    after(inst, "check_request", "checked")  # the names instantiate() calls, in its module
    after(inst, "emit", "rows")
    after(IpcRoute, "initialize", "created")
    after(Agent, "initialize", "created")

    def wrap_post(cls):
        orig = cls.post

        def post(self, xfer, notif=b""):
            stamps.mark(stamps.current, "posting")
            out = orig(self, xfer, notif)
            stamps.mark(stamps.current, "post")
            return out
        cls.post = post

    wrap_post(IpcRoute)
    wrap_post(Agent)

    from kvlc.runtime.ipc.copy import GpuCopy

    def wrap_start(name: str) -> None:
        orig = getattr(GpuCopy, name)

        def start(self, *a, **k):
            stamps.mark(stamps.current, "launching")
            out = orig(self, *a, **k)
            stamps.mark(stamps.current, "launched")
            return out
        setattr(GpuCopy, name, start)

    wrap_start("start_blocks")
    wrap_start("start_rows")

    orig_progress = transfer.Executor.progress

    def progress(self):
        ended = orig_progress(self)
        for out in ended:
            stamps.mark(out.req, "seen")
        return ended
    transfer.Executor.progress = progress

    orig_done = transfer.Executor._notify_done

    def notify_done(self):
        pending = [o.req for o in self._done]
        for req in pending:
            stamps.mark(req, "seen")
        t = time.perf_counter()
        orig_done(self)
        if pending:
            stamps.notif_s.append(time.perf_counter() - t)
        for req in pending:
            stamps.mark(req, "told")
    transfer.Executor._notify_done = notify_done


def run_mode(mode: str, args, plans, batches, stamps: Stamps) -> dict:
    from kvlc.demo.procs import EngineConfig, EngineProcess
    from kvlc.runtime.agent import KvAgent
    from kvlc.runtime.binding import allocate
    from kvlc.runtime.settings import AgentSettings

    os.environ["KVLC_IPC"] = "auto" if mode == "ipc" else "off"
    secret = secrets.token_hex(32)
    proc = EngineProcess()
    shared = {} if args.gpu else {"shared": True}
    try:
        producer, consumer = plans
        cons = proc.add(EngineConfig(consumer.to_json(), 0, fill="zeros", secret=secret, engine_id=f"tl-cons-{mode}",
                                     pin=args.gpu, **shared))
        tensors = allocate(producer, pin=args.gpu, shared=not args.gpu)
        prod = KvAgent(producer, 0, tensors, AgentSettings(secret=secret, engine_id=f"tl-prod-{mode}"))
        try:
            peer = prod.connect(cons.address, direction="WRITE")
            rows = []
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for i, (_, cids, pids, n) in enumerate(batches):
                req = f"{mode}-{i}"
                stamps.begin(req)
                peer.write(req, pids, cids, n, timeout=60.0)
                stamps.mark(req, "write")
                stamps.current = None
                _wait(prod, req)
                stamps.mark(req, "finished")
                rows.append(stamps.at[req])
            faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / max(1, len(batches))
            prod.poll()
            ipc = prod.stats.get("ipc_requests")
            blocks = prod.stats.get("ipc_block_copies")
        finally:
            prod.close()
    finally:
        proc.stop()
    skip = min(args.warmup, len(rows) - 1)
    return {"rows": rows[skip:], "first": rows[:args.each], "ipc_requests": ipc, "ipc_block_copies": blocks,
            "faults": faults}


def _wait(agent, req: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        c = agent.poll()
        if c.failed:
            raise RuntimeError(f"failed: {c.failed}")
        if req in c.finished:
            return
        time.sleep(0)
    raise RuntimeError(f"{req} still open after {timeout}s")


def summary(rows: list[dict]) -> dict:
    out = {}
    for s in STAGES:
        v = np.array([r[s] for r in rows if s in r]) * 1e6
        if len(v):
            out[s] = {"p50_us": float(np.percentile(v, 50)), "p90_us": float(np.percentile(v, 90)),
                      "p99_us": float(np.percentile(v, 99)), "n": len(v)}
    return out


def _busy() -> None:
    """Pure Python work without a pause (it gives the GIL up only when made to)."""
    n = 0
    while True:
        n = (n + 1) % 1_000_003


def workload_args(ap: argparse.ArgumentParser) -> None:
    """The options of a one-request-at-a-time probe over a scaled Llama-3.1-8B pool (this one, pvp_timeline.py)."""
    ap.add_argument("--gpu", action="store_true", help="VRAM on cuda:0 on both sides")
    ap.add_argument("--pool-mib", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--ids", choices=("contiguous", "random"), default="contiguous")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_args(ap)
    ap.add_argument("--modes", default="ipc,nixl")
    ap.add_argument("--batches", type=int, default=0, help="sets of ids to cycle (default: one per round)")
    ap.add_argument("--busy", action="store_true", help="a Python thread that never blocks runs beside the requests")
    ap.add_argument("--pair", choices=tuple(PAIRS), default="llama",
                    help="llama: Llama-3.1-8B both sides; mixed: the GPU suite's DRAM + VRAM -> VRAM pair")
    ap.add_argument("--each", type=int, default=0, help="also print (and record) the stages of the first N requests "
                    "one by one, warm-up included (a first request's own costs)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.busy:
        threading.Thread(target=_busy, daemon=True).start()

    specs = PAIRS[args.pair]
    plans = tuple(scaled_plan(s, args.pool_mib << 20, to_dram=not args.gpu) for s in specs)  # producer, consumer
    sets = [make_workload(plans[1], plans[0], 1, args.tokens, ids=args.ids, seed=i)[0][0]
            for i in range(min(args.batches or args.rounds, args.rounds))]
    batches = [sets[i % len(sets)] for i in range(args.rounds)]
    stamps = Stamps()
    instrument(stamps)
    doc = {"command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]), "gpu": args.gpu, "pair": args.pair,
           "tokens": args.tokens, "ids": args.ids, "busy": args.busy, "modes": {}}
    for mode in args.modes.split(","):
        got = run_mode(mode, args, plans, batches, stamps)
        for k, r in enumerate(got["first"]):
            print(f"{mode:5s} request {k}: " + ", ".join(f"{s} {r[s] * 1e6:,.0f}" for s in STAGES if s in r), flush=True)
        doc["modes"][mode] = {"stages": summary(got["rows"]), "first_us": [{s: r[s] * 1e6 for s in r} for r in got["first"]],
                              "ipc_requests": got["ipc_requests"],
                              "ipc_block_copies": got["ipc_block_copies"],
                              "page_faults_per_request": got["faults"]}
        st = doc["modes"][mode]["stages"]
        line = ", ".join(f"{s} {st[s]['p50_us']:,.0f}/{st[s]['p90_us']:,.0f}" for s in STAGES if s in st)
        print(f"{mode:5s} ({args.tokens} tokens, {args.ids}; ipc requests {got['ipc_requests']}, by block ids "
              f"{got['ipc_block_copies']}; "
              f"{got['faults']:.1f} page faults per request in this process): us since write(), p50/p90: {line}",
              flush=True)
    if stamps.notif_s:
        print(f"tell_done calls: p50 {np.percentile(stamps.notif_s, 50) * 1e6:,.0f} us, "
              f"p90 {np.percentile(stamps.notif_s, 90) * 1e6:,.0f} us")
        doc["tell_done_us"] = {"p50": float(np.percentile(stamps.notif_s, 50) * 1e6),
                               "p90": float(np.percentile(stamps.notif_s, 90) * 1e6)}
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
