"""kvlc per request vs per batch (Peer.write_many / read_many), against raw NIXL on the same shape, one run.

One pair of engines per (direction, size): this process hosts the initiating KvAgent (the producer
for push, the consumer for pull), a spawned engine process the other side, both with Llama-3.1-8B
scaled to the pool given, contiguous ids (32 descriptors per request: one per layer region). A
round is ``--inflight`` requests; rounds with batch sizes 1 (``write`` / ``read`` per request),
8 and the whole round (``write_many`` / ``read_many``) alternate, so drift shows as spread, not as
a difference. The same run measures raw NIXL on kvlc's shape (32 descriptors apart, created
before the clock or in flight, with kvlc's default UCX pool; ``gpu_submit.raw_rows``).

Per row: median GB/s over the rounds, and the engine thread's time per request to hand the
round over (submit µs). ``--device cpu`` is a small dry run on DRAM (correctness of the script).

Run (from the repository root):  python3 benchmarks/probes/gpu_batch.py [--device cpu] [--rounds 8] [--out OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, the suite
sys.path.insert(0, str(Path(__file__).resolve().parent))  # probes/

from profile_push import wait_finished  # noqa: E402

MiB = 1 << 20
LLAMA = "layouts/llama-3.1-8b.yaml"



def _parts(peer, local_ids, remote_ids, num_tokens):
    """The NIXL parts one request posts (the peer's own decision on staging left out)."""
    return peer.parts(local_ids, remote_ids, num_tokens)[0]

def _pair(direction: str, pool: int, gpu: bool):
    """(plan, engine process, local agent, peer): the local agent initiates ``direction``."""
    from kvlc.runtime.agent import KvAgent
    from kvlc.runtime.settings import AgentSettings
    from kvlc.runtime.binding import allocate
    from kvlc.demo.run import scaled_plan
    from kvlc.demo.procs import EngineConfig, EngineProcess

    plan = scaled_plan(LLAMA, pool, to_dram=not gpu)
    secret = secrets.token_hex(32)
    proc = EngineProcess()
    other = proc.add(EngineConfig(plan.to_json(), 0, fill="zeros", secret=secret, pin=gpu,
                                  engine_id=f"batch-{direction}-remote"))
    local = KvAgent(plan, 0, allocate(plan, pin=gpu), AgentSettings(secret=secret, engine_id=f"batch-{direction}-local"))
    peer = local.connect(other.address, direction=direction)
    return plan, proc, local, peer


def _round(agent, peer, reqs: list, batch: int, timeout: float = 120.0) -> dict:
    """Hand one round over (``batch`` requests per call; 1: write/read each), wait until all are done."""
    write = peer.direction.value == "WRITE"
    created = agent.stats["nixl_requests"]
    t0 = time.perf_counter()
    if batch == 1:
        for r in reqs:
            (peer.write if write else peer.read)(r.request_id, r.local_block_ids, r.remote_block_ids, r.num_tokens)
    else:
        for at in range(0, len(reqs), batch):
            (peer.write_many if write else peer.read_many)(reqs[at:at + batch])
    handed = time.perf_counter() - t0
    wait_finished(agent, {r.request_id for r in reqs}, timeout, nap=0.0001)
    return {"handed_s": handed, "total_s": time.perf_counter() - t0,
            "nixl_requests": agent.stats["nixl_requests"] - created}


def kvlc_rows(direction: str, pool: int, tokens: int, inflight: int, rounds: int, gpu: bool) -> list[dict]:
    from kvlc.runtime.batch import BlockRequest
    from kvlc.demo.run import make_workload

    plan, proc, agent, peer = _pair(direction, pool, gpu)
    try:
        work = make_workload(plan, plan, inflight, tokens, ids="contiguous")[0]
        if len(work) != inflight:
            raise RuntimeError(f"the pool holds {len(work)} requests of {tokens} tokens at once, not {inflight}")
        flip = direction == "WRITE"  # the workload is (id, consumer ids, producer ids, tokens)

        def reqs(tag):
            return [BlockRequest(f"{tag}-{k}", p if flip else c, c if flip else p, n)
                    for k, (_, c, p, n) in enumerate(work)]
        nbytes = sum(int(x.nbytes) for x in _parts(peer, *[getattr(reqs("probe")[0], f) for f in (
            "local_block_ids", "remote_block_ids", "num_tokens")]).values()) * inflight
        sizes = sorted({1, 4, 8, inflight})
        for b in sizes:  # warm: first use of the peer's memory, and of each path
            _round(agent, peer, reqs(f"warm{b}"), b)
        got: dict[int, list[dict]] = {b: [] for b in sizes}
        for i in range(rounds):
            for b in sizes:
                got[b].append(_round(agent, peer, reqs(f"r{i}b{b}"), b))
        rows = []
        for b in sizes:
            tot = [g["total_s"] for g in got[b]]
            rows.append({"case": f"kvlc {'push' if flip else 'pull'} {nbytes // inflight // MiB} MiB x{inflight}, "
                                 f"batch {b}", "batch": b, "bytes_per_round": nbytes, "rounds": rounds,
                         "gbps": nbytes / statistics.median(tot) / 1e9,
                         "gbps_best": nbytes / min(tot) / 1e9,
                         "submit_us_per_request": statistics.median(g["handed_s"] for g in got[b]) / inflight * 1e6,
                         "nixl_requests_per_round": got[b][-1]["nixl_requests"]})
            print(json.dumps(rows[-1]), flush=True)
        return rows
    finally:
        peer.close()
        agent.close()
        proc.stop()


def content_rows(gpu: bool) -> list[dict]:
    """Batched push, pull and pull via push with content-coded bytes, every destination byte checked."""
    from kvlc.demo.run import run_demo

    rows = []
    for mode in ("push", "pull", "pull_via_push"):
        res = run_demo(LLAMA, mode=mode, requests=16, max_bytes=(1 << 30) if gpu else (64 << 20),
                       device="gpu" if gpu else "cpu", batch=8)
        rows.append({"case": f"content check {mode}, batch 8", "ok": res.ok, "requests": res.requests,
                     "checked_bytes": res.checked_bytes, "mismatches": res.mismatches[:3],
                     "failed": dict(list(res.failed.items())[:3])})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--only", default="", help="comma list of: check, 256,2048 (MiB per request), raw, push, pull")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    gpu = args.device == "gpu"
    only = set(filter(None, args.only.split(",")))
    doc = {"benchmark": "gpu_batch", "command": " ".join(["python3", "benchmarks/probes/gpu_batch.py", *sys.argv[1:]]),
           "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "rows": []}
    # (MiB per request, tokens, in flight, pool per side): 2048 tokens of Llama-3.1-8B are 256 MiB
    # (the largest pool scaled_plan makes is the spec's own: four 2 GiB requests at once)
    shapes = [(256, 2048, 32, 10 << 30), (2048, 16384, 4, 10 << 30)] if gpu else [(8, 64, 8, 256 << 20)]
    if gpu:
        from gpu_transfer import ceilings
        doc["torch_copy_gbps"] = ceilings(0, 0)

    def save():
        if args.out:
            Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    if not only or "check" in only:
        doc["rows"] += content_rows(gpu)
        save()
    for mib, tokens, inflight, pool in shapes:
        if gpu and only & {"256", "2048"} and str(mib) not in only:
            continue
        if not only or "raw" in only:
            from gpu_submit import raw_rows
            doc["rows"] += raw_rows(0 if gpu else None, mib * MiB, inflight, 3 if gpu else 1)
            save()
        for direction, name in (("WRITE", "push"), ("READ", "pull")):
            if not only or name in only:
                doc["rows"] += kvlc_rows(direction, pool, tokens, inflight, args.rounds, gpu)
                save()
    return 0 if all("error" not in r and r.get("ok", True) for r in doc["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
