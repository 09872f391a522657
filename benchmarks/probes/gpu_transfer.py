"""GPU run: kvlc vs raw NIXL vs torch copies, push / pull / pull-via-push, staging, one or two GPUs.

In one run, each side on the cuda device given (``--producer-device``, ``--consumer-device``;
both 0 on a one-GPU machine):

* ceilings: torch device-to-device copy (same device, or ``tensor.to("cuda:C")`` across devices)
  and pinned host <-> device copies, for the request sizes measured;
* kvlc (KvAgent, two processes, ``kvlc.demo.run``): VRAM Llama-3.1-8B push, pull and
  pull-via-push at 256 MiB (32 descriptors) and 2 GiB per request, random block ids
  (4,086 descriptors), and mixed DRAM/VRAM DeepSeek-V3.2 -> HiSparse; content-coded
  correctness runs in every mode first (every destination byte checked);
* raw NIXL (no kvlc) between the same kind of processes: one descriptor of the same bytes,
  WRITE and READ, and the same rows with UCX thread-pool settings side by side;
* staging (``kvlc.runtime.staging.endpoint``): 4,086 x 64 KiB VRAM -> VRAM, 256 MiB DRAM -> VRAM and
  VRAM -> DRAM, with content-coded checks in every memory pairing (benchmarks/probes/gpu_staging.py).

Writes JSON (``--out``) and a plot next to it. Needs a CUDA GPU, torch and nixl (not part of CI).
Run from the repository root:

    python3 benchmarks/probes/gpu_transfer.py --producer-device 0 --consumer-device 0 \\
        --out benchmarks/results/gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "probes"))

MiB = 1 << 20
LLAMA = "layouts/llama-3.1-8b.yaml"
DSV32 = ("layouts/deepseek-v3.2-tp8.yaml", "layouts/deepseek-v3.2-hisparse-tp8.yaml")


def torch_copy_gbps(nbytes: int, kind: str, src_dev: int = 0, dst_dev: int = 0, reps: int = 10) -> float:
    """GB/s of a torch copy of ``nbytes``, counted once: d2d (src_dev -> dst_dev), h2d or d2h (pinned)."""
    import torch

    if kind == "d2d":
        src = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{src_dev}")
        dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst_dev}")
    elif kind == "h2d":
        src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst_dev}")
    else:
        src = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{src_dev}")
        dst = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / reps
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / seconds / 1e9


def on_device(layout: str, device: int, tmp: Path) -> str:
    """A copy of ``layout`` with every VRAM storage on cuda ``device`` (the other side's layout may differ)."""
    data = yaml.safe_load((ROOT / layout).read_text())

    def move(entries):
        for e in entries:
            if "repeat" in e:
                move(e["storages"])
            elif e.get("mem") == "VRAM":
                e["device"] = device
    move(data["storages"])
    out = tmp / f"{Path(layout).stem}-cuda{device}.yaml"
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(out)


def kvlc_case(rows: list, name: str, prod: str, cons: str, modes, runs, timeout: float = 300.0,
              check_bytes: int = 64 << 20) -> None:
    """Correctness (content codes, every byte) then timed runs through KvAgent, one row per run."""
    from kvlc.demo.run import run_demo

    for mode in modes:
        t0 = time.time()
        try:
            small = run_demo(prod, cons, mode=mode, requests=4, tokens=128, max_bytes=check_bytes,
                             device="gpu", check="all", timeout=120.0)
            rows.append({"case": f"kvlc {name} {mode} check", "ok": small.ok, "verified_bytes": small.checked_bytes,
                         "mismatches": small.mismatches[:5], "failed": dict(list(small.failed.items())[:5]),
                         "wall_s": round(time.time() - t0, 1)})
        except Exception as exc:
            rows.append({"case": f"kvlc {name} {mode} check", "ok": False, "error": f"{type(exc).__name__}: {exc}",
                         "traceback": traceback.format_exc()[-2000:]})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "traceback"}), flush=True)
        for label, requests, tokens, pool, ids, descriptors, *threads in runs(mode):
            t0 = time.time()
            if threads:  # agents created without options read this (UcxOptions.from_env)
                os.environ["KVLC_UCX_NUM_THREADS"] = threads[0]
            try:
                res = run_demo(prod, cons, mode=mode, requests=requests, tokens=tokens, max_bytes=pool,
                               device="gpu", check="none", fill="zeros", ids=ids, timeout=timeout,
                               descriptors=descriptors)
                row = {"case": f"kvlc {name} {mode} {label}", "ok": res.ok, "bytes": res.nbytes,
                       "seconds": res.seconds, "gbps": res.gbps, "requests": res.requests,
                       "bytes_per_request": res.nbytes // max(1, res.requests),
                       "descriptors_per_request": res.descriptors_per_request,
                       "failed": dict(list(res.failed.items())[:3])}
            except Exception as exc:
                row = {"case": f"kvlc {name} {mode} {label}", "error": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc()[-2000:]}
            os.environ.pop("KVLC_UCX_NUM_THREADS", None)
            row["wall_s"] = round(time.time() - t0, 1)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)


def kvlc_cases(pdev: int, cdev: int, quick: bool, tmp: Path) -> list[dict]:
    rows: list[dict] = []
    lp, lc = on_device(LLAMA, pdev, tmp), on_device(LLAMA, cdev, tmp)
    n = 32 if quick else 64

    def llama_runs(mode):  # pools of 8 and 32 GiB: 32 and 16 requests in flight per round
        out = [("256 MiB contiguous", n, 2048, 8 << 30, "contiguous", "rows"),
               ("2 GiB contiguous", 16, 16384, 32 << 30, "contiguous", "rows")]
        if mode != "pull_via_push":
            out.append(("256 MiB contiguous prepped", n, 2048, 8 << 30, "contiguous", "prepped"))
        if mode == "push":
            out += [("256 MiB contiguous [UCX threads=4]", n, 2048, 8 << 30, "contiguous", "rows", "4"),
                    ("2 GiB contiguous [UCX threads=4]", 16, 16384, 32 << 30, "contiguous", "rows", "4")]
        out.append(("256 MiB random ids", 8 if quick else 16, 2048, 1 << 30, "random", "rows"))
        return out

    kvlc_case(rows, "VRAM llama-3.1-8b", lp, lc, ("push", "pull", "pull_via_push"), llama_runs)
    dp, dc = on_device(DSV32[0], pdev, tmp), on_device(DSV32[1], cdev, tmp)
    kvlc_case(rows, "mixed deepseek-v3.2 -> hisparse", dp, dc, ("push", "pull", "pull_via_push"),
              lambda mode: [("contiguous", 2, 512, 128 << 20, "contiguous", "rows")] if mode == "push" else [],
              check_bytes=16 << 20)
    return rows


def _kvlc_row(name: str, prod: str, cons: str, mode: str, requests: int, tokens: int, pool: int,
              descriptors: str = "rows", progress: str = "thread", timeout: float = 300.0) -> dict:
    """One timed kvlc run (contiguous ids, no check): GB/s, requests in flight per round, descriptors."""
    from kvlc.demo.run import run_demo

    t0 = time.time()
    try:
        res = run_demo(prod, cons, mode=mode, requests=requests, tokens=tokens, max_bytes=pool, device="gpu",
                       check="none", fill="zeros", ids="contiguous", timeout=timeout, descriptors=descriptors,
                       progress_mode=progress)
        row = {"case": name, "ok": res.ok, "bytes": res.nbytes, "seconds": res.seconds, "gbps": res.gbps,
               "requests": res.requests, "rounds": res.rounds, "in_flight": res.requests // max(1, res.rounds),
               "bytes_per_request": res.nbytes // max(1, res.requests),
               "descriptors_per_request": res.descriptors_per_request, "progress": progress,
               "failed": dict(list(res.failed.items())[:3]), **_steady(res)}
    except Exception as exc:
        row = {"case": name, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
    row["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
    return row


def _steady(res) -> dict:
    """The first round apart (it pays first-use costs: UCX maps the peer's memory) and the rest."""
    secs = res.round_seconds
    if len(secs) < 2 or not res.rounds:
        return {"round_seconds": secs}
    per_round = res.nbytes / res.rounds
    return {"round_seconds": [round(x, 5) for x in secs], "first_round_gbps": per_round / secs[0] / 1e9,
            "steady_gbps": per_round * (len(secs) - 1) / sum(secs[1:]) / 1e9}


def _raw_rows(pdev: int | None, cdev: int | None, big: int = 2048 * MiB) -> list[dict]:
    """Raw NIXL WRITE/READ (no kvlc, no UCX thread pool) on the shapes kvlc posts: 1 descriptor and
    32 descriptors per request, 4 or 32 requests in flight (created before the clock), and created
    inside the clock one at a time (what a runtime pays per request)."""
    import gpu_staging
    from testkit.staging_pair import Pair, Side

    rows: list[dict] = []
    pair = Pair(Side((big,), device=pdev, fill=False), Side((big,), device=cdev, fill=False))
    try:
        for size, desc in ((big // 8, 1), (big // 8, 32), (big, 1), (big, 32)):
            for inflight in ((4, 32) if size < big else (2, 16)):
                req = [gpu_staging.contiguous(desc, size // desc)] * inflight
                reps = 3 if size < big else 2
                for op in (("WRITE", "READ") if desc == 1 and inflight in (4, 2) else ("WRITE",)):
                    gpu_staging._guard(rows, f"raw {op} {desc} desc {size // MiB} MiB x{inflight} in flight",
                                       lambda: dict(gpu_staging._raw(pair, op, req, reps, desc == 1),
                                                    in_flight=inflight))
            req = [gpu_staging.contiguous(desc, size // desc)] * 8
            gpu_staging._guard(rows, f"raw WRITE {desc} desc {size // MiB} MiB created per request, serial",
                               lambda: _serial(pair, req, desc))
    finally:
        pair.stop()
    pair = Pair(Side((big,), device=pdev, fill=False), Side((big,), device=cdev, fill=False))
    try:  # 32 descriptors NIXL cannot merge (apart in memory, as kvlc's layers are): kvlc's real shape
        for inflight in (4, 32):
            req = [_spread(32, big // 8 // 32, big // 32)] * inflight
            gpu_staging._guard(rows, f"raw WRITE 32 desc {big // 8 // MiB} MiB apart x{inflight} in flight",
                               lambda: dict(gpu_staging._raw(pair, "WRITE", req, 3, False), in_flight=inflight))
        req = [_spread(32, big // 8 // 32, big // 32)] * 8
        gpu_staging._guard(rows, f"raw WRITE 32 desc {big // 8 // MiB} MiB apart created per request, serial",
                           lambda: _serial(pair, req, 32))
    finally:
        pair.stop()
    ucx = {"num_threads": 4}  # UCX's thread pool posts a request's descriptors in parallel
    pair = Pair(Side((big,), device=pdev, fill=False, ucx=ucx), Side((big,), device=cdev, fill=False, ucx=ucx))
    try:
        for inflight in (4, 32):
            req = [gpu_staging.contiguous(32, big // 8 // 32)] * inflight
            gpu_staging._guard(rows, f"raw WRITE 32 desc {big // 8 // MiB} MiB x{inflight} in flight [UCX threads=4]",
                               lambda: dict(gpu_staging._raw(pair, "WRITE", req, 3, False), in_flight=inflight))
    finally:
        pair.stop()
    return rows


def _spread(n: int, size: int, pitch: int):
    """``n`` rows of ``size`` bytes, ``pitch`` apart (no two adjacent: nothing for NIXL to merge)."""
    import numpy as np

    from testkit.staging_pair import Ranges

    offs = np.arange(n, dtype=np.int64) * pitch
    rows = np.stack([np.zeros(n, dtype=np.int64), offs, np.full(n, size, dtype=np.int64)], axis=1)
    return Ranges(rows, rows.copy())


def _serial(pair, req, desc: int) -> dict:
    r = pair.raw("WRITE", req, reps=1, single=desc == 1, serial=True)
    return {"bytes": r["bytes"], "seconds": r["seconds"], "gbps": r["bytes"] / r["seconds"] / 1e9,
            "requests": len(req), "bytes_per_request": req[0].nbytes, "descriptors_per_request": desc}


def fastpath_cases(pdev: int, cdev: int, quick: bool, tmp: Path, select: str = "") -> list[dict]:
    """Per-request cost of push/pull: kvlc (rows, prepped; progress thread or manual polling; 4..32
    requests in flight) next to raw NIXL on the same shapes, in one run (see _raw_rows).
    ``select``: comma-separated labels; only those kvlc cases run (and raw NIXL only with the word "raw")."""
    words = [w for w in select.split(",") if w]
    rows = _raw_rows(pdev, cdev) if not words or "raw" in words else []
    lp, lc = on_device(LLAMA, pdev, tmp), on_device(LLAMA, cdev, tmp)
    n = 32 if quick else 320  # 256 MiB: 32 in flight (8 GiB pools), 10 rounds
    G = 1 << 30
    for label, mode, requests, tokens, pool, desc, prog in (
            ("push 256 MiB contiguous", "push", n, 2048, 8 * G, "rows", "thread"),
            ("push 256 MiB contiguous manual", "push", n, 2048, 8 * G, "rows", "manual"),
            ("push 256 MiB contiguous x4", "push", 32, 2048, 1 * G, "rows", "thread"),
            ("push 256 MiB contiguous prepped", "push", n, 2048, 8 * G, "prepped", "thread"),
            ("push 2 GiB contiguous", "push", 64, 16384, 32 * G, "rows", "thread"),
            ("push 2 GiB contiguous manual", "push", 64, 16384, 32 * G, "rows", "manual"),
            ("pull 256 MiB contiguous", "pull", n, 2048, 8 * G, "rows", "thread"),
            ("pull 2 GiB contiguous", "pull", 64, 16384, 32 * G, "rows", "thread")):
        if words and label not in words:
            continue
        rows.append(_kvlc_row(f"kvlc VRAM llama-3.1-8b {label}", lp, lc, mode, requests, tokens, pool, desc, prog))
    return rows


def ceilings(pdev: int, cdev: int) -> dict:
    out = {}
    for size in (256 * MiB, 2048 * MiB):
        out[f"d2d {size // MiB} MiB"] = torch_copy_gbps(size, "d2d", pdev, cdev)
    out["h2d 256 MiB"] = torch_copy_gbps(256 * MiB, "h2d", dst_dev=cdev)
    out["d2h 256 MiB"] = torch_copy_gbps(256 * MiB, "d2h", src_dev=pdev)
    for k, v in out.items():
        print(f"torch {k}: {v:.1f} GB/s", flush=True)
    return out


def machine(args) -> dict:
    import torch

    info = {"gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
            "command": " ".join(["python3", "benchmarks/probes/gpu_transfer.py", *sys.argv[1:]]),
            "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "producer_device": args.producer_device,
            "consumer_device": args.consumer_device,
            "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")}}
    try:
        from importlib.metadata import version

        info["nixl"] = version("nixl-cu13")
    except Exception as exc:
        info["nixl"] = f"unknown: {exc}"
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu.json"))
    ap.add_argument("--producer-device", type=int, default=0, help="cuda device of the producer (prefill) side")
    ap.add_argument("--consumer-device", type=int, default=0, help="cuda device of the consumer (decode) side")
    ap.add_argument("--quick", action="store_true", help="fewer and smaller requests")
    ap.add_argument("--merge", action="store_true", help="add the rows to an existing --out document")
    ap.add_argument("--only", default="kvlc,staging,raw,check",
                    help="comma-separated parts: kvlc, kvlc-staging, kvlc-staging-fix, staging, raw, check, diag, "
                    "fastpath (diag, fastpath, kvlc-staging-fix: not by default)")
    ap.add_argument("--select", default="", help="fastpath part: comma-separated labels of its kvlc cases to run "
                    "(e.g. 'push 256 MiB contiguous,raw'; 'raw' for raw NIXL); default all")
    args = ap.parse_args(argv)
    import torch

    count = torch.cuda.device_count()
    for which, dev in (("--producer-device", args.producer_device), ("--consumer-device", args.consumer_device)):
        if not 0 <= dev < count:
            ap.error(f"{which} {dev}: this machine has {count} CUDA device(s); use 0..{count - 1}")
    import gpu_kvlc_staging
    import gpu_staging
    from gpu_plot import annotate, plot, verdicts

    parts = set(args.only.split(","))
    p, c = args.producer_device, args.consumer_device
    out_path = Path(args.out)
    if out_path.exists() and args.merge:  # add this run's parts to an earlier run's document
        doc = json.loads(out_path.read_text())
        doc.setdefault("runs", []).append(machine(args))
    else:
        doc = None
    doc = doc or {"benchmark": "gpu", "machine": machine(args), "torch_copy_gbps": ceilings(p, c), "rows": [],
           "verdicts": []}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    steps = (("check", lambda tmp: gpu_staging.check_cases(p, c)),
             ("diag", lambda tmp: gpu_staging.diag_cases(p, c)),
             ("staging", lambda tmp: gpu_staging.staged_cases(p, c, args.quick)),
             ("raw", lambda tmp: gpu_staging.raw_cases(p, c, args.quick)),
             ("kvlc", lambda tmp: kvlc_cases(p, c, args.quick, tmp)),
             ("fastpath", lambda tmp: fastpath_cases(p, c, args.quick, tmp, args.select)),
             ("kvlc-staging", lambda tmp: gpu_kvlc_staging.cases(
                 (on_device(LLAMA, p, tmp), on_device(LLAMA, c, tmp)),
                 (on_device(DSV32[0], p, tmp), on_device(DSV32[1], c, tmp)), args.quick)),
             ("kvlc-staging-fix", lambda tmp: gpu_kvlc_staging.fix_cases(
                 (on_device(LLAMA, p, tmp), on_device(LLAMA, c, tmp)),
                 (on_device(DSV32[0], p, tmp), on_device(DSV32[1], c, tmp)))))
    with tempfile.TemporaryDirectory() as tmp:
        for part, run in steps:
            if part in parts:
                doc["rows"] += run(Path(tmp))
                doc["verdicts"] = verdicts(annotate(doc))
                path.write_text(json.dumps(doc, indent=2) + "\n")  # what ran so far survives a cut-off run
    for v in doc["verdicts"]:
        print(f"{v['target']}: {v['verdict']} ({v['detail']})", flush=True)
    try:
        plot(doc, path.with_name(path.stem + "_transfer.png"))  # gpu.png is run.py's summary plot
    except Exception as exc:  # the JSON is what counts
        print(f"plot failed: {exc}")
    print(f"wrote {path}")
    ok = all(r.get("ok", True) and "error" not in r for r in doc["rows"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
