"""What kvlc adds per request over raw NIXL: the same descriptors, the same agents, rounds alternated.

The bytes are made tiny on purpose (``--spec`` with one KV head of ``--head-dim`` 2: 32
descriptors of 128 bytes per 16-token request for Llama-3.1-8B), so the copy costs almost nothing
and what is left is each side's per-request work:

* ``raw``: for each request, NIXL's ``get_xfer_descs`` of both sides' rows, ``initialize_xfer``
  and ``transfer`` (post), then every request waited for and released: what any runtime pays.
  The rows are kvlc's own for that request, built before the clock.
* ``kvlc``: ``Peer.write`` of the same requests (check, descriptor rows, NIXL create and post,
  bookkeeping), then polled until every one is done on the producer (the consumer told, the
  ``done`` notification sent): what an engine pays.

The producer (this process) and consumer (a spawned process) are KvAgents over UCX on loopback;
raw NIXL uses the producer's own NIXL agent and connection, under its lock (the progress thread
uses the same UCX worker). ``--inflight`` requests per round, ``--rounds`` rounds of each kind
alternated (raw, kvlc, raw, ...) after two warm-up rounds; medians of µs per request. ``--gpu``
puts both caches in VRAM on cuda:0 (a GPU machine). Writes ``results/overhead.json``.

Run:  python3 benchmarks/probes/bench_overhead.py [--tokens 16] [--inflight 32] [--rounds 40] [--progress manual] [--gpu]
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, the suite
sys.path.insert(0, str(Path(__file__).resolve().parent))  # probes/

from common import write_results  # noqa: E402
from profile_push import one_round  # noqa: E402

from kvlc.demo.run import DEFAULT_LAYOUT, make_workload, scaled_plan  # noqa: E402



def _parts(peer, local_ids, remote_ids, num_tokens):
    """The NIXL parts one request posts (the peer's own decision on staging left out)."""
    return peer.parts(local_ids, remote_ids, num_tokens)[0]

def tiny_plan(spec: str, head_dim: int, pool_mib: int, gpu: bool):
    """``spec`` with one KV head of ``head_dim`` (the same descriptors, tiny bytes), pools scaled."""
    data = yaml.safe_load(Path(spec).read_text())
    data["model"].update(num_kv_heads=1, head_dim=head_dim)
    data["name"] = f"{data['name']}-tiny"
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(data, f, sort_keys=False)
    try:
        return scaled_plan(f.name, pool_mib << 20, to_dram=not gpu)
    finally:
        os.unlink(f.name)


def raw_round(nixl, remote: str, parts: list) -> tuple[float, float]:
    """Create and post one NIXL WRITE per request part, then wait for all: (post time, total) seconds."""
    n, lock = nixl._n, nixl._lock
    t0 = time.perf_counter()
    xfers = []
    for req in parts:
        for key, p in req.items():
            with lock:
                ld = n.get_xfer_descs(p.local.view("int64"), key.local_mem)
                rd = n.get_xfer_descs(p.remote.view("int64"), key.remote_mem)
                x = n.initialize_xfer("WRITE", ld, rd, remote, b"")
                if n.transfer(x) == "ERR":
                    raise RuntimeError("raw NIXL post failed")
            xfers.append(x)
    t1 = time.perf_counter()
    for x in xfers:
        while True:
            with lock:
                state = n.check_xfer_state(x)
                if state != "PROC":
                    n.release_xfer_handle(x)
                    break
        if state == "ERR":
            raise RuntimeError("raw NIXL transfer failed")
    return t1 - t0, time.perf_counter() - t0


def per_call(fn, repeat: int = 200) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default=str(DEFAULT_LAYOUT))
    ap.add_argument("--head-dim", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--inflight", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--pool-mib", type=int, default=64)
    ap.add_argument("--progress", default="thread", help="the producer's progress: thread (default) or manual")
    ap.add_argument("--nap", type=float, default=0.0,
                    help="seconds kvlc's wait sleeps between empty polls (default 0: it spins, as raw's wait does)")
    ap.add_argument("--gpu", action="store_true", help="VRAM on cuda:0 on both sides (a GPU machine)")
    ap.add_argument("--out", default="overhead", help="result name under benchmarks/results (no .json)")
    args = ap.parse_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from kvlc.runtime.agent import KvAgent
    from kvlc.runtime.settings import AgentSettings
    from kvlc.runtime.binding import allocate
    from kvlc.runtime.channel.notifs import agents_of
    from kvlc.demo.procs import EngineConfig, EngineProcess

    plan = tiny_plan(args.spec, args.head_dim, args.pool_mib, args.gpu)
    secret = secrets.token_hex(32)
    proc = EngineProcess()
    try:
        cons = proc.add(EngineConfig(plan.to_json(), 0, fill="zeros", secret=secret, engine_id="overhead-consumer",
                                     pin=args.gpu))
        prod = KvAgent(plan, 0, allocate(plan, pin=args.gpu),
                       AgentSettings(secret=secret, engine_id="overhead-producer", progress=args.progress))
        peer = prod.connect(cons.address, direction="WRITE")
        batch = make_workload(plan, plan, args.inflight, args.tokens, ids="contiguous")[0]
        parts = [_parts(peer, p, c, n) for _, c, p, n in batch]
        remote = agents_of(peer._targets())[0]
        rows = sum(len(p) for p in parts[0].values())
        nbytes = sum(int(p.nbytes) for p in parts[0].values())
        times = {"raw": [], "kvlc": []}
        for i in range(-2, args.rounds):  # rounds -2, -1 warm both paths up, not counted
            raw = raw_round(prod.nixl, remote, parts)
            k = one_round(prod, peer, [(f"o{i}-{j}", c, p, n) for j, (_, c, p, n) in enumerate(batch)], nap=args.nap)
            if i >= 0:
                times["raw"].append(raw)
                times["kvlc"].append((k["submit_s"], k["total_s"]))
        _, c0, p0, n0 = batch[0]
        inst = per_call(lambda: _parts(peer, p0, c0, n0))
        peer.close()
        prod.close()
    finally:
        proc.stop()
    n = args.inflight
    med = {k: {"post_us": statistics.median(a for a, _ in v) / n * 1e6,
               "total_us": statistics.median(b for _, b in v) / n * 1e6} for k, v in times.items()}
    extra = med["kvlc"]["total_us"] - med["raw"]["total_us"]
    doc = {"plan": plan.name, "gpu": args.gpu, "progress": args.progress, "tokens": args.tokens,
           "in_flight": n, "rounds": args.rounds, "descriptors_per_request": rows, "bytes_per_request": nbytes,
           "raw": med["raw"], "kvlc": med["kvlc"], "kvlc_instantiate_us": inst * 1e6,
           "kvlc_extra_us": extra, "ratio_raw_over_kvlc": med["raw"]["total_us"] / med["kvlc"]["total_us"],
           "load_end": os.getloadavg()[0]}
    print(f"{plan.name}: {rows} descriptors, {nbytes} bytes per request, {n} in flight, {args.rounds} rounds each, "
          f"progress {args.progress}")
    for k in ("raw", "kvlc"):
        print(f"  {k:5s} posted {med[k]['post_us']:7.1f} us/request, done {med[k]['total_us']:7.1f} us/request")
    print(f"  kvlc adds {extra:.1f} us per request (instantiate alone {inst * 1e6:.1f}); raw / kvlc "
          f"{doc['ratio_raw_over_kvlc']:.2f}; load {doc['load_end']:.2f}")
    print(f"wrote {write_results(args.out, doc)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
