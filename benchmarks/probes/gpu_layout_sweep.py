"""Content check of every checked-in layout pair on one GPU, through kvlc's default paths, with odd sizes.

The GPU suite times Llama-3.1-8B and DeepSeek-V3 MLA only; the same-host copy's row and block kernels, the
pinned ring and the copy engines also serve every other pair kvlc compiles (other block sizes either way,
TP mismatches with every rank on one GPU, HND / NHD, split K / V, FP8 scales, NVFP4, Mamba state, sliding
windows, compressed caches, DCP / PCP, host-resident DRAM regions). This probe moves requests of random
block ids between two engine processes (``kvlc.demo.run.run_demo``, ``check="all"``: every destination
byte compared with its content code, every other byte unchanged), one case after another:

* ``pairs``: every pair of ``layouts/pairs/pairs.yaml`` by pull (the pool scaled to ``--pool-mib`` per
  rank, more where a pair needs it; the demo's default tokens: two requests share the smallest consumer
  pool; ``--ids``: both sides' ids at random by default), then a few of them (``MORE_MODES``) by push and
  pull via push (``--modes``: these modes for every pair instead; ``--select``: these pairs only);
* ``sizes``: Llama-3.1-8B requests of the tokens in ``SIZES`` (1 token, partial blocks, a prompt's 1,023 and
  4,095, 8,192), pushed and pulled via push; DeepSeek-V3 MLA at TP1 the same.

Each case prints one JSON line (and appends it to ``--out``): the case, ``ok``, requests moved, how many
went through the same-host copy (``copied``: the rest through NIXL), seconds, and the first mismatches or
failures. ``--budget-s`` stops starting cases once spent (what ran is kept). ``--device cpu`` runs the same
cases on DRAM (a dry run; the same-host copy is not used there).

Run:  python3 benchmarks/probes/gpu_layout_sweep.py [--only pairs,sizes] [--select PAIR,...] [--modes MODE,...]
           [--ids scattered] [--pool-mib 32] [--out sweep.jsonl] [--budget-s 540] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_transfer import on_device  # noqa: E402

MiB = 1 << 20
# pairs also moved by push and by pull via push: block sizes either way, TP, MLA, Mamba, mixed DRAM, split K / V
MORE_MODES = ("gemma3-b16-to-b32", "llama70b-hnd-tp4-to-tp8", "deepseek-v3-tp8-to-tp1", "nemotron-h-tp4-to-tp2",
              "deepseek-v3.2-to-hisparse", "llama8b-split-to-joint", "v4-compressed-b128-to-b256",
              "qwen3-next-pool-tp4-to-tp2")
# pools a pair needs larger than --pool-mib: four groups share each page pool (a hybrid engine's), each its pages
POOL_MIB = {"qwen3-next-pool-tp4-to-tp2": 128, "qwen3-next-pool-tp2-to-tp4": 128}
SIZES = (("layouts/llama-3.1-8b.yaml", (1, 15, 17, 1023, 4095, 8192)),
         ("layouts/deepseek-v3-tp1.yaml", (1, 63, 4097)))


def _layout(name: str, device: str, tmp: Path) -> str:
    """``layouts/<name>`` as run: on a GPU every VRAM storage on cuda:0 (all ranks on one GPU)."""
    path = name if "/" in name else f"layouts/{name}"
    return str(ROOT / path) if device == "cpu" else on_device(path, 0, tmp)


def _case(case: dict, prod: str, cons: str, args, tmp: Path, ids: str, **kw) -> dict:
    from kvlc.demo.run import run_demo

    t0 = time.perf_counter()
    try:
        r = run_demo(_layout(prod, args.device, tmp), _layout(cons, args.device, tmp), device=args.device,
                     check="all", fill="content", ids=ids, timeout=120.0, start_timeout=300.0, **kw)
        case.update(ok=r.ok, requests=r.requests, copied=r.copied_requests, checked_bytes=r.checked_bytes,
                    mismatches=r.mismatches[:3], failed=dict(list(r.failed.items())[:3]))
    except Exception as exc:  # a case that cannot run is a result too (and a failure)
        case.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:800],
                    where=traceback.format_exc(limit=-3)[-1200:])
    case["seconds"] = round(time.perf_counter() - t0, 2)
    return case


def cases(args) -> list[tuple[dict, str, str, dict]]:
    pairs = yaml.safe_load((ROOT / "layouts" / "pairs" / "pairs.yaml").read_text())["pairs"]
    out = []
    if "pairs" in args.only:
        chosen = [n for n in args.select.split(",") if n]
        unknown = set(chosen) - {p["name"] for p in pairs}
        if unknown:
            raise SystemExit(f"--select: no pair named {', '.join(sorted(unknown))} in layouts/pairs/pairs.yaml")
        for p in sorted(pairs, key=lambda p: chosen.index(p["name"]) if p["name"] in chosen else 0):
            if chosen and p["name"] not in chosen:
                continue
            for mode in ("pull", "push", "pull_via_push"):
                if mode in args.modes if args.modes else (mode == "pull" or p["name"] in MORE_MODES):
                    pool = max(args.pool_mib, POOL_MIB.get(p["name"], 0)) * MiB
                    out.append(({"set": "pairs", "pair": p["name"], "mode": mode, "ids": args.ids}, p["producer"],
                                p["consumer"], {"mode": mode, "requests": 4, "max_bytes": pool, "ids": args.ids}))
    if "sizes" in args.only:
        for layout, tokens in SIZES:
            for t in tokens:
                for mode in ("push", "pull_via_push"):
                    pool = max(64 * MiB, 3 * t * 160 * 1024 + 16 * MiB) if args.device == "gpu" else 64 * MiB
                    if args.device == "cpu" and t > 1100:
                        continue  # (the dry run keeps its pools small)
                    out.append(({"set": "sizes", "layout": Path(layout).stem, "tokens": t, "mode": mode,
                                 "ids": args.ids}, layout, layout,
                                {"mode": mode, "requests": 3, "tokens": t, "max_bytes": pool, "ids": args.ids}))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--only", default="pairs,sizes", help="comma-separated: pairs, sizes")
    ap.add_argument("--pool-mib", type=int, default=32, help="pairs: pool per rank")
    ap.add_argument("--select", default="", help="pairs: only these (names in layouts/pairs/pairs.yaml), in this order")
    ap.add_argument("--modes", default="", help="pairs: these modes for every pair (default: pull, and push and pull "
                                                "via push for MORE_MODES)")
    ap.add_argument("--ids", choices=("random", "scattered", "contiguous"), default="scattered",
                    help="block ids: both sides' at random (scattered), the producer's (random), or runs")
    ap.add_argument("--budget-s", type=float, default=540.0, help="start no case after this many seconds")
    ap.add_argument("--out", default="", help="append each case's JSON line here too")
    args = ap.parse_args(argv)
    args.only = set(args.only.split(","))
    args.modes = {m for m in args.modes.split(",") if m}
    if args.modes - {"pull", "push", "pull_via_push"}:
        ap.error(f"--modes: use pull, push, pull_via_push (got {args.modes})")
    tmp = Path(tempfile.mkdtemp())
    t0, bad, ran, todo = time.perf_counter(), 0, 0, cases(args)
    for case, prod, cons, kw in todo:
        if time.perf_counter() - t0 > args.budget_s:
            print(json.dumps({"skipped": len(todo) - ran, "why": f"--budget-s {args.budget_s:g} spent"}), flush=True)
            break
        row = _case(case, prod, cons, args, tmp, **kw)
        ran += 1
        bad += not row["ok"]
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    print(f"{ran} cases, {bad} failed, {time.perf_counter() - t0:.0f} s", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
