"""GPU: kvlc push against raw NIXL on kvlc's own shape, with the same UCX settings, alternated in one run.

kvlc's push of a 256 MiB Llama-3.1-8B request is 32 descriptors of 8 MiB, one per layer region
(apart in memory), 32 requests in flight. Raw NIXL here moves the same shape between two more
processes on the same GPU:

* ``pre-created``: every request of a round created before the clock, then posted together (NIXL's
  best case: no creation cost at all);
* ``created in flight``: created and posted one after another inside the clock, then waited for:
  what any runtime pays per request (descriptor lists + create + post), without kvlc's own code;

each without UCX's thread pool and with kvlc's default for VRAM agents (``UcxOptions.for_agent``:
4 threads, split 4). kvlc runs with its defaults (pool on) and with ``KVLC_UCX_NUM_THREADS=0``.
Raw and kvlc rows alternate twice (A B A B), so drift on the machine shows as spread, not as a
difference. Prints one JSON row per case; writes the document to OUT.

Run (from the repository root):  python3 benchmarks/probes/gpu_submit.py [--device cpu] [--out OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, the suite
sys.path.insert(0, str(Path(__file__).resolve().parent))  # probes/

MiB = 1 << 20


def raw_rows(device: int | None, size: int, inflight: int, reps: int) -> list[dict]:
    """Raw NIXL WRITE of 32 descriptors ``size // 32`` apart: pre-created and created in flight,
    without the UCX pool and with kvlc's default pool settings."""
    import gpu_staging
    from gpu_transfer import _spread

    from kvlc.runtime.nixl.ucx import UcxOptions
    from testkit.staging_pair import Pair, Side

    rows: list[dict] = []
    pool = UcxOptions.for_agent(True, {})  # what a kvlc agent with VRAM gets by default
    pool_fields = {"num_threads": pool.num_threads}
    big = size * 8  # the request's 32 rows spread over 8x its bytes, as kvlc's layer regions are
    req = [_spread(32, size // 32, big // 32)] * inflight
    for label, ucx in (("no pool", {}), (f"pool {pool_fields}", pool_fields)):
        pair = Pair(Side((big,), device=device, fill=False, ucx=ucx), Side((big,), device=device, fill=False, ucx=ucx))
        try:
            pair.raw("WRITE", req[:2], reps=1, single=False)  # first use of the peer's memory, untimed
            for how, inline in (("pre-created", False), ("created in flight", True)):
                gpu_staging._guard(rows, f"raw WRITE 32 desc {size // MiB} MiB apart x{inflight} {how} [{label}]",
                                   lambda: dict(_raw(pair, req, reps, inline), in_flight=inflight))
        finally:
            pair.stop()
    return rows


def _raw(pair, req, reps: int, inline: bool) -> dict:
    r = pair.raw("WRITE", req, reps=reps, single=False, inflight=inline)
    per = r["seconds"] / (reps * len(req))
    return {"bytes": r["bytes"], "seconds": r["seconds"], "gbps": r["bytes"] / r["seconds"] / 1e9,
            "us_per_request": per * 1e6}


def kvlc_rows(device: str, layout: str, requests: int, tokens: int, pool: int) -> list[dict]:
    from gpu_transfer import _kvlc_row

    rows = []
    for label, threads in (("defaults (pool)", None), ("KVLC_UCX_NUM_THREADS=0", "0")):
        if threads is not None:
            os.environ["KVLC_UCX_NUM_THREADS"] = threads
        try:
            if device == "gpu":
                rows.append(_kvlc_row(f"kvlc push 256 MiB contiguous x32 [{label}]", layout, layout, "push",
                                      requests, tokens, pool))
            else:
                rows.append(_cpu_kvlc_row(f"kvlc push contiguous [{label}]", layout, requests, tokens, pool))
        finally:
            os.environ.pop("KVLC_UCX_NUM_THREADS", None)
    return rows


def _cpu_kvlc_row(name: str, layout: str, requests: int, tokens: int, pool: int) -> dict:
    from kvlc.demo.run import run_demo

    res = run_demo(layout, layout, mode="push", requests=requests, tokens=tokens, max_bytes=pool, device="cpu",
                   check="none", fill="zeros", ids="contiguous")
    row = {"case": name, "ok": res.ok, "gbps": res.gbps, "requests": res.requests, "rounds": res.rounds,
           "round_seconds": res.round_seconds, "descriptors_per_request": res.descriptors_per_request}
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("gpu", "cpu"), default="gpu", help="cpu: a small dry run on DRAM")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    from gpu_transfer import LLAMA, on_device

    gpu = args.device == "gpu"
    doc: dict = {"benchmark": "gpu_submit", "command": " ".join(["python3", "benchmarks/probes/gpu_submit.py", *sys.argv[1:]]),
                 "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "rows": []}
    if gpu:
        from gpu_transfer import ceilings

        doc["torch_copy_gbps"] = ceilings(0, 0)
    with tempfile.TemporaryDirectory() as tmp:
        layout = on_device(LLAMA, 0, Path(tmp)) if gpu else LLAMA
        for _ in range(2):  # A B A B
            doc["rows"] += raw_rows(0 if gpu else None, 256 * MiB if gpu else 8 * MiB, 32, 3 if gpu else 1)
            doc["rows"] += kvlc_rows(args.device, layout, 320 if gpu else 64, 2048 if gpu else 64,
                                     (8 << 30) if gpu else (256 << 20))
            if args.out:
                Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if all(r.get("ok", True) and "error" not in r for r in doc["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
