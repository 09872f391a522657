"""Where a push request's time goes on the producer: kvlc between ``Peer.write`` and ``done``, per request.

The producer KvAgent runs in this process (so cProfile sees it), the consumer in a spawned engine
process (``kvlc.demo.procs``), both on DRAM over UCX on loopback, Llama-3.1-8B scaled to a pool of
``--pool-mib`` per rank and requests of ``--tokens`` with contiguous block ids (one descriptor per
layer: 32 per request). A round submits ``--inflight`` requests back to back, then waits until every
one is done on the producer (``Completions.finished``), exactly like the demo's timed batches.

Prints the time per request split as: instantiate (compiler rows), submit (NIXL create + post),
wait (from the last post to the last ``done``), plus a cProfile of the whole loop (``--profile``).

``--compare 16,256,2048`` instead measures kvlc push against raw NIXL single-descriptor WRITEs of the
same bytes between two more processes, rounds alternated (results/push_vs_raw.json); ``--gpu`` puts
both sides' caches in VRAM on cuda:0 (a GPU machine).

Run:  python3 benchmarks/probes/profile_push.py [--tokens 256] [--inflight 8] [--rounds 20] [--profile]
      python3 benchmarks/probes/profile_push.py --compare 16,256,2048 --rounds 5 --inflight 4 --pool-mib 1024
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import secrets
import sys
import time
from pathlib import Path

import numpy as np

for _p in (Path(__file__).resolve().parents[2], Path(__file__).resolve().parents[1], Path(__file__).resolve().parent):
    if str(_p) not in sys.path:  # (a caller may have put another checkout's kvlc first: bench_overhead --kvlc-root)
        sys.path.insert(0, str(_p))  # the repository, benchmarks/ (common, the suite), probes/

from kvlc.demo.run import DEFAULT_LAYOUT, make_workload  # noqa: E402



def _parts(peer, local_ids, remote_ids, num_tokens):
    """The NIXL parts one request posts (the peer's own decision on staging left out)."""
    return peer.parts(local_ids, remote_ids, num_tokens)[0]

def setup(pool_mib: int, progress: str, interval: float, gpu: bool = False):
    from kvlc.runtime.agent import KvAgent
    from kvlc.runtime.settings import AgentSettings
    from kvlc.runtime.binding import allocate
    from kvlc.demo.run import scaled_plan
    from kvlc.demo.procs import EngineConfig, EngineProcess

    plan = scaled_plan(DEFAULT_LAYOUT, pool_mib << 20, to_dram=not gpu)  # gpu: VRAM on cuda:0 both sides
    secret = secrets.token_hex(32)
    proc = EngineProcess()
    cons = proc.add(EngineConfig(plan.to_json(), 0, fill="zeros", secret=secret, engine_id="profile-consumer",
                                 pin=gpu))
    tensors = allocate(plan, pin=gpu)
    prod = KvAgent(plan, 0, tensors, AgentSettings(secret=secret, engine_id="profile-producer", progress=progress,
                                                   progress_interval=interval))
    peer = prod.connect(cons.address, direction="WRITE")
    return plan, proc, prod, peer


def one_round(prod, peer, batch, timeout: float = 60.0, nap: float = 0.0002) -> dict:
    t0 = time.perf_counter()
    for req, cids, pids, n in batch:
        peer.write(req, pids, cids, n, timeout=timeout)
    t_posted = time.perf_counter()
    wait_finished(prod, {b[0] for b in batch}, timeout, nap)
    return {"submit_s": t_posted - t0, "total_s": time.perf_counter() - t0}


def wait_finished(agent, want: set, timeout: float, nap: float = 0.0002) -> None:
    """Poll ``agent`` until every id in ``want`` finished; a failure or the timeout raises."""
    deadline = time.monotonic() + timeout
    while want and time.monotonic() < deadline:
        c = agent.poll()
        if c.failed:
            raise RuntimeError(f"failed: {dict(list(c.failed.items())[:2])}")
        want = want - set(c.finished)
        if want and not c:
            time.sleep(nap)
    if want:
        raise RuntimeError(f"{len(want)} requests still open after {timeout}s")


def _kvlc_gbps(prod, peer, plan, tokens: int, inflight: int, rounds: int, tag: str) -> tuple[float, int, int]:
    batch = make_workload(plan, plan, inflight, tokens, ids="contiguous")[0]
    parts = _parts(peer, batch[0][2], batch[0][1], batch[0][3])
    nbytes = sum(int(p.nbytes) for p in parts.values())
    desc = sum(len(getattr(p, "local", p)) for p in parts.values())
    times = [one_round(prod, peer, [(f"{tag}-{i}-{k}", c, p, n) for k, (_, c, p, n) in enumerate(batch)])["total_s"]
             for i in range(rounds)]
    return len(batch) * nbytes / sorted(times)[len(times) // 2] / 1e9, nbytes, desc


def compare(args) -> list[dict]:
    """kvlc push vs raw NIXL single-descriptor WRITE on the same bytes, rounds alternated, one run."""
    from testkit.staging_pair import Pair, Ranges, Side

    plan, proc, prod, peer = setup(args.pool_mib, args.progress, args.interval)
    out = []
    try:
        sizes = [int(t) for t in args.compare.split(",")]
        _, cids, pids, n = make_workload(plan, plan, 1, max(sizes), ids="contiguous")[0][0]
        parts = _parts(peer, pids, cids, n)
        biggest = sum(int(p.nbytes) for p in parts.values())
        pair = Pair(Side((biggest,), fill=False, pin=False), Side((biggest,), fill=False, pin=False))
        try:
            for tokens in sizes:
                k, raw, ser = [], [], []
                for i in range(-1, args.rounds):  # round -1 warms connections and caches up, not counted
                    g, nbytes, desc = _kvlc_gbps(prod, peer, plan, tokens, args.inflight, 1, f"c{tokens}-{i}")
                    k.append(g)
                    one = np.array([[0, 0, nbytes]], dtype=np.int64)
                    req = [Ranges(one, one)] * args.inflight
                    r = pair.raw("WRITE", req, reps=1, single=True)
                    raw.append(r["bytes"] / r["seconds"] / 1e9)
                    r = pair.raw("WRITE", req, reps=1, single=True, serial=True)
                    ser.append(r["bytes"] / r["seconds"] / 1e9)
                    if i < 0:
                        k, raw, ser = [], [], []
                med = {n: sorted(v)[len(v) // 2] for n, v in (("kvlc", k), ("raw", raw), ("raw_serial", ser))}
                row = {"tokens": tokens, "bytes_per_request": nbytes, "descriptors": desc, "in_flight": args.inflight,
                       "rounds": args.rounds, "kvlc_push_gbps": med["kvlc"], "raw_write_1desc_gbps": med["raw"],
                       "raw_write_1desc_created_per_request_gbps": med["raw_serial"],
                       "ratio": med["kvlc"] / med["raw"], "ratio_vs_created": med["kvlc"] / med["raw_serial"]}
                out.append(row)
                print(f"{nbytes / 2**20:7.1f} MiB x{args.inflight} ({desc} descriptors): kvlc push {med['kvlc']:.2f} GB/s, "
                      f"raw 1-descriptor WRITE {med['raw']:.2f} (created per request {med['raw_serial']:.2f}) -> "
                      f"{row['ratio']:.2f} ({row['ratio_vs_created']:.2f})", flush=True)
        finally:
            pair.stop()
    finally:
        peer.close()
        prod.close()
        proc.stop()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pool-mib", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--inflight", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--progress", default="thread")
    ap.add_argument("--interval", type=float, default=0.001)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--sort", default="tottime", help="cProfile order (tottime, cumulative)")
    ap.add_argument("--legacy-pump", action="store_true", help="progress turn that waits for the lock (as before)")
    ap.add_argument("--gpu", action="store_true", help="VRAM on cuda:0 on both sides (a GPU machine)")
    ap.add_argument("--compare", default="", help="comma-separated tokens per request: kvlc push vs raw NIXL "
                    "single-descriptor WRITE of the same bytes, alternated (--rounds each); writes results/push_vs_raw.json")
    args = ap.parse_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if args.compare:
        from common import write_results

        rows = compare(args)
        extra = {"load_end": os.getloadavg()[0], "progress": args.progress, "pool_mib": args.pool_mib, "rows": rows}
        print(f"wrote {write_results('push_vs_raw', extra)}")
        return 0
    if args.legacy_pump:  # the progress turn as it was: wait for the lock, run whatever the engine does
        from kvlc.runtime.agent import KvAgent

        def legacy(self):
            with self._lock:
                if not self.closed:
                    self._pump()
        KvAgent.progress_turn = legacy
    plan, proc, prod, peer = setup(args.pool_mib, args.progress, args.interval, args.gpu)
    try:
        rounds = make_workload(plan, plan, args.inflight, args.tokens, ids="contiguous")
        batch = [(f"{r}-{k}", c, p, n) for k, (r, c, p, n) in enumerate(rounds[0])]
        parts = _parts(peer, batch[0][2], batch[0][1], batch[0][3])
        rows = sum(len(getattr(p, "local", p)) for p in parts.values())
        nbytes = sum(int(p.nbytes) for p in parts.values())
        one_round(prod, peer, [(f"warm-{i}", c, p, n) for i, (_, c, p, n) in enumerate(batch)])
        prof = cProfile.Profile() if args.profile else None
        results = []
        if prof:
            prof.enable()
        for i in range(args.rounds):
            results.append(one_round(prod, peer, [(f"r{i}-{r}", c, p, n) for r, c, p, n in batch]))
        if prof:
            prof.disable()
        t_inst = time.perf_counter()
        for _ in range(50):
            _parts(peer, batch[0][2], batch[0][1], batch[0][3])
        inst = (time.perf_counter() - t_inst) / 50
        n = args.inflight
        sub = sorted(r["submit_s"] for r in results)[len(results) // 2] / n
        tot = sorted(r["total_s"] for r in results)[len(results) // 2]
        print(f"{n} requests in flight, {rows} descriptors, {nbytes / 2**20:.1f} MiB each: "
              f"instantiate {inst * 1e6:.0f} us, submit (instantiate + create + post) {sub * 1e6:.0f} us per request, "
              f"round {tot * 1e3:.2f} ms = {tot / n * 1e6:.0f} us per request, {n * nbytes / tot / 1e9:.2f} GB/s; "
              f"load {os.getloadavg()[0]:.2f}")
        if prof:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(args.sort).print_stats(args.top)
            print(s.getvalue())
    finally:
        peer.close()
        prod.close()
        proc.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
