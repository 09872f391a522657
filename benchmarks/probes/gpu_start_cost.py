"""What the same-host copy's start costs on the host, step by step (one process, one GPU).

``GpuCopy.start_rows`` for a table of ``--rows`` rows (64 KiB each, scattered in a scratch buffer),
its steps timed one by one as it runs them (the caller's stream event, the ring, the table written,
the launch, the end event), then the whole call, and the kernel alone (CUDA events around it).
Prints p50 / p90 µs per step and writes JSON with ``--out``.

Run:  python3 benchmarks/probes/gpu_start_cost.py [--rows 32,8192] [--calls 400] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

for _p in (Path(__file__).resolve().parents[2], Path(__file__).resolve().parent):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))


def pct(v, q):
    return float(np.percentile(np.array(v) * 1e6, q))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="32,8192")
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    import torch

    from kvlc.runtime.ipc.copy import GpuCopy, row_table

    row = 64 << 10
    cp = GpuCopy(0)
    cp.warm()
    doc = {"device": torch.cuda.get_device_name(0), "direct": cp.direct, "host_table": cp.host_table,
           "vec": cp.vec, "cases": []}
    for n in [int(x) for x in args.rows.split(",")]:
        src = torch.empty(2 * n * row, dtype=torch.uint8, device="cuda:0")
        dst = torch.empty_like(src)
        rng = np.random.default_rng(n)
        s = src.data_ptr() + rng.permutation(2 * n)[:n].astype(np.uint64) * np.uint64(row)
        d = dst.data_ptr() + rng.permutation(2 * n)[:n].astype(np.uint64) * np.uint64(row)
        lens = np.full(n, row, dtype=np.uint64)
        g = row_table(s, d, lens)
        steps = {k: [] for k in ("table", "caller_event", "ring", "launch", "end_event", "whole", "kernel")}
        for i in range(-20, args.calls):
            t0 = time.perf_counter()
            g = row_table(s, d, lens)
            t1 = time.perf_counter()
            cp._waited.record(torch.cuda.current_stream(0))
            cp.stream.wait_event(cp._waited)
            t2 = time.perf_counter()
            at, table, keep = cp._upload(g.table)
            t3 = time.perf_counter()
            cp._launch(g, table)
            t4 = time.perf_counter()
            ev = torch.cuda.Event()
            ev.record(cp.stream)
            if at is not None:
                cp.ring.used(at, len(g.table), ev)
            t5 = time.perf_counter()
            ev.synchronize()
            t6 = time.perf_counter()
            launched = cp.start_rows(g)
            t7 = time.perf_counter()
            launched.event.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(cp.stream)
            cp._launch(g, cp._upload(g.table)[1])
            b.record(cp.stream)
            b.synchronize()
            if i >= 0:
                for k, v in (("table", t1 - t0), ("caller_event", t2 - t1), ("ring", t3 - t2), ("launch", t4 - t3),
                             ("end_event", t5 - t4), ("whole", t7 - t6), ("kernel", a.elapsed_time(b) / 1e3)):
                    steps[k].append(v)
        row_doc = {"rows": n, **{k: {"p50_us": pct(v, 50), "p90_us": pct(v, 90)} for k, v in steps.items()}}
        doc["cases"].append(row_doc)
        print(f"{n} rows: " + ", ".join(f"{k} {row_doc[k]['p50_us']:.1f}/{row_doc[k]['p90_us']:.1f}" for k in steps)
              + " us (p50/p90; whole: start_rows until it returns)", flush=True)
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
