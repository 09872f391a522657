"""GPU run: pull, push and pull-via-push on VRAM and on mixed DRAM/VRAM layouts, one GPU.

A producer process and a consumer process (each hosting every rank of its engine,
tensors on cuda:0 or pinned host memory as the layout says) move requests with
real NIXL agents (UCX; cuda_ipc where it applies). Every case runs twice:

  * correctness: a few content-coded requests, every destination byte checked;
  * throughput: larger requests of random bytes, timed, not checked;

and, in the same run, a torch device-to-device copy of the same number of bytes
(and host<->device copies for the mixed case) as the ceiling to compare with.

Needs a CUDA GPU, torch and nixl (not part of CI). Run from the repository root:

    python3 benchmarks/gpu_transfer.py [--out benchmarks/results/gpu.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = [
    # name, producer layout, consumer layout, what it shows, large-run sizes per mode:
    # {"pull"|"other": (requests, tokens per request, pool bytes per rank)}
    ("vram llama-3.1-8b", "layouts/llama-3.1-8b.yaml", None, "VRAM -> VRAM, 32 regions",
     {"pull": (8, 512, 1 << 30), "other": (64, 2048, 1 << 30)}),
    ("mixed deepseek-v3.2 -> hisparse", "layouts/deepseek-v3.2-tp8.yaml",
     "layouts/deepseek-v3.2-hisparse-tp8.yaml", "VRAM producer -> DRAM latent + VRAM indexer consumer",
     {"pull": (4, 256, 128 << 20), "other": (8, 512, 128 << 20)}),
]
MODES = ("push", "pull_via_push", "pull")


def torch_copy_gbps(nbytes: int, kind: str, reps: int = 10) -> float:
    """GB/s of a torch copy of ``nbytes`` (d2d, h2d or d2h; pinned host memory), counted once."""
    import torch

    dev = torch.device("cuda", 0)
    if kind == "d2d":
        src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
    elif kind == "h2d":
        src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    else:
        src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        dst = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    stop.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(stop) / 1e3 / reps
    return nbytes / seconds / 1e9


def run_case(name, producer, consumer, quick: bool, big: dict) -> dict:
    from kvlc.runtime.demo import run_demo

    out = {"case": name, "producer": producer, "consumer": consumer, "modes": {}}
    for mode in MODES:
        row: dict = {}
        try:
            t0 = time.time()
            small = run_demo(producer, consumer, mode=mode, requests=4, tokens=128, max_bytes=64 << 20,
                             device="gpu", check="all", timeout=120.0)
            row["check"] = {"ok": small.ok, "requests": small.requests, "bytes": small.nbytes,
                            "verified_bytes": small.checked_bytes, "mismatches": small.mismatches[:5],
                            "failed": dict(list(small.failed.items())[:5]), "wall_s": time.time() - t0}
            print(f"[{name}] {mode:14s} check: ok={small.ok} verified {small.checked_bytes:,} bytes", flush=True)
            for ids in (("contiguous",) if mode == "pull" else ("contiguous", "random")):
                requests, tokens, pool = big["pull" if mode == "pull" else "other"]
                t0 = time.time()
                res = run_demo(producer, consumer, mode=mode, requests=requests, tokens=tokens,
                               max_bytes=pool, device="gpu", check="none", fill="random", ids=ids,
                               timeout=300.0)
                row[f"throughput_{ids}"] = {
                    "ok": res.ok, "requests": res.requests, "tokens": tokens, "bytes": res.nbytes,
                    "seconds": res.seconds, "gbps": res.gbps,
                    "descriptors_per_request": res.descriptors_per_request,
                    "failed": dict(list(res.failed.items())[:5]), "wall_s": time.time() - t0}
                print(f"[{name}] {mode:14s} {ids:10s} {res.nbytes / 1e9:.2f} GB in {res.seconds:.3f} s = "
                      f"{res.gbps:.1f} GB/s, {res.descriptors_per_request:.0f} descriptors/request", flush=True)
        except Exception as exc:  # record and go on: one call of the GPU machine should tell everything
            row["error"] = f"{type(exc).__name__}: {exc}"
            row["traceback"] = traceback.format_exc()[-3000:]
            print(f"[{name}] {mode} FAILED: {row['error']}", flush=True)
        out["modes"][mode] = row
    return out


def sweep(out: str) -> int:
    """Where does VRAM push time go? Progress mode (kKV thread vs NIXL's own) x request size."""
    from kvlc.runtime.demo import run_demo

    rows = []
    for progress in ("thread", "nixl"):
        for tokens, requests, pool in ((2048, 64, 1 << 30), (16384, 16, 8 << 30)):
            for mode in ("push", "pull_via_push"):
                try:
                    res = run_demo("layouts/llama-3.1-8b.yaml", mode=mode, requests=requests, tokens=tokens,
                                   max_bytes=pool, device="gpu", check="none", fill="zeros", ids="contiguous",
                                   timeout=300.0, progress_mode=progress)
                    per_req = res.nbytes // max(1, res.requests)
                    d2d = torch_copy_gbps(per_req, "d2d")
                    row = {"progress": progress, "mode": mode, "tokens": tokens, "requests": res.requests,
                           "bytes": res.nbytes, "seconds": res.seconds, "gbps": res.gbps,
                           "descriptors_per_request": res.descriptors_per_request, "ok": res.ok,
                           "torch_d2d_gbps_same_bytes": d2d, "fraction_of_d2d": res.gbps / d2d}
                except Exception as exc:
                    row = {"progress": progress, "mode": mode, "tokens": tokens, "error": repr(exc)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    Path(out).write_text(json.dumps({"benchmark": "gpu-sweep", "rows": rows}, indent=2) + "\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu.json"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated case-name substrings")
    ap.add_argument("--sweep", action="store_true",
                    help="push sweep on VRAM instead: progress mode x request size, contiguous ids")
    args = ap.parse_args(argv)
    if args.sweep:
        return sweep(args.out)

    import torch

    info = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "python": platform.python_version(),
            "cpus": os.cpu_count(), "command": " ".join(["python3", *sys.argv]),
            "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")}}
    try:
        import nixl
        info["nixl"] = getattr(nixl, "__version__", "?")
    except ImportError as exc:
        info["nixl"] = f"missing: {exc}"
    baselines = {}
    for kind in ("d2d", "h2d", "d2h"):
        baselines[kind] = {str(n): torch_copy_gbps(n, kind) for n in (64 << 20, 1 << 30)}
        print(f"torch {kind}: " + ", ".join(f"{int(k) >> 20} MiB {v:.1f} GB/s" for k, v in baselines[kind].items()),
              flush=True)
    cases = [c for c in CASES if not args.only or any(s in c[0] for s in args.only.split(","))]
    results = []
    for name, p, c, _, big in cases:
        results.append(run_case(name, p, c, args.quick, big))
        for mode, row in results[-1]["modes"].items():  # ceiling: a d2d copy of one request's bytes
            for key, tp in row.items():
                if key.startswith("throughput") and tp["bytes"]:
                    per_req = max(1, tp["bytes"] // max(1, tp["requests"]))
                    d2d = torch_copy_gbps(min(per_req, 4 << 30), "d2d")
                    tp["torch_d2d_gbps_same_bytes"] = d2d
                    tp["fraction_of_d2d"] = tp["gbps"] / d2d
    doc = {"benchmark": "gpu", "machine": info, "torch_copy_gbps": baselines, "cases": results}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, path)
    print(f"wrote {path}")
    ok = all(row.get("check", {}).get("ok") for r in results for row in r["modes"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
