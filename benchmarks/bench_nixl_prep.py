"""NIXL descriptor-list preparation: (N, 3) rows against strided (N, 5) rows.

A plan region is `num_blocks` blocks of `block_bytes` every `block_stride` bytes:
exactly one strided row (addr, len, dev, stride, count). Preparing a list of N
block descriptors as N rows of (addr, len, dev) is what a per-block scheme does;
as strided rows it is one row per region. Both lists are prepared from the
same registered DRAM buffer, in the same run, for N = 10k ... 10M.

Run:  python3 benchmarks/bench_nixl_prep.py [--max 10000000] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ms, write_results  # noqa: E402

BLOCK = 16          # bytes per descriptor (small, so 10M descriptors fit a 160 MB buffer)
REGIONS = 8         # strided rows (one per region)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max", type=int, default=10_000_000, help="largest descriptor count")
    ap.add_argument("--quick", action="store_true", help="one repetition per size")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)

    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    logging.getLogger("nixl").setLevel(logging.WARNING)
    from nixl._api import nixl_agent, nixl_agent_config

    sizes = [n for n in (10_000, 100_000, 1_000_000, 10_000_000) if n <= args.max]
    per_region = max(sizes) // REGIONS
    buf = np.zeros(REGIONS * per_region * BLOCK + 4096, dtype=np.uint8)
    agent = nixl_agent("prep-bench", nixl_agent_config(backends=["UCX"]))
    reg = agent.register_memory(np.array([[buf.ctypes.data, buf.nbytes, 0]], dtype=np.uint64), "DRAM")
    base = buf.ctypes.data
    rows = []
    try:
        for n in sizes:
            per = n // REGIONS
            starts = np.uint64(base) + np.arange(REGIONS, dtype=np.uint64) * np.uint64(per * BLOCK)
            # (N, 3): one row per block, the way a per-block scheme prepares its lists
            t0 = time.perf_counter()
            idx = np.arange(per, dtype=np.uint64)
            n3 = np.empty((REGIONS * per, 3), dtype=np.uint64)
            n3[:, 0] = (starts[:, None] + idx[None, :] * np.uint64(BLOCK)).ravel()
            n3[:, 1] = BLOCK
            n3[:, 2] = 0
            build3 = time.perf_counter() - t0
            # (R, 5): one strided row per region
            n5 = np.empty((REGIONS, 5), dtype=np.uint64)
            n5[:, 0] = starts
            n5[:, 1] = BLOCK
            n5[:, 2] = 0
            n5[:, 3] = BLOCK
            n5[:, 4] = per
            reps = 1 if args.quick or n >= 10_000_000 else 3
            t3, t5 = [], []
            for _ in range(reps):
                gc.collect()
                t0 = time.perf_counter()
                h3 = agent.prep_xfer_dlist("NIXL_INIT_AGENT", n3, "DRAM")
                t3.append(time.perf_counter() - t0)
                agent.release_dlist_handle(h3)
                t0 = time.perf_counter()
                h5 = agent.prep_xfer_dlist("NIXL_INIT_AGENT", n5, "DRAM")
                t5.append(time.perf_counter() - t0)
                agent.release_dlist_handle(h5)
            expanded = int(n5[:, 4].sum())
            row = {"descriptors": REGIONS * per, "strided_rows": REGIONS, "strided_expanded": expanded,
                   "build_nx3_s": build3, "prep_nx3_s": min(t3), "prep_nx5_s": min(t5),
                   "speedup_nx5": min(t3) / max(min(t5), 1e-9)}
            rows.append(row)
            print(f"N={REGIONS * per:>10,d}  build Nx3 {ms(build3):>12}  prep Nx3 {ms(min(t3)):>12}  "
                  f"prep Nx5 ({REGIONS} rows, {expanded:,d} descs) {ms(min(t5)):>10}  "
                  f"{row['speedup_nx5']:.0f}x")
            del n3
    finally:
        agent.deregister_memory(reg)
    if not args.no_write:
        print(f"wrote {write_results('nixl_prep', {'block_bytes': BLOCK, 'rows': rows})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
