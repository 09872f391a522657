"""GPU: the same-host copy kernel alone (kvlc.runtime.ipc), in one process, against torch's copies.

Two pools on cuda:0 (``--pool-mib`` each, random bytes); per case, ``count`` random distinct blocks
of ``block`` bytes of one pool are copied to random distinct blocks of the other (what a P/D
handover from an engine's pool after warm-up looks like), timed with CUDA events after warm-up
(median of ``--reps``), every destination block checked and the rest of the destination pool
unchanged:

* ``kernel``: :class:`kvlc.runtime.ipc.copy.GpuCopy` (row table upload + ONE Triton kernel), for a
  few program sizes (``BLOCK_WORDS``) and warp counts, host work included (a request's real cost);
  ``host us``: the host's time to start it; ``gpu only``: from the copy stream's first work to its end;
  ``kernel``: the general row kernel (``copy_rows``), ``chunks``: rows cut into equal chunks (``copy_chunks``);
* ``torch``: ``index_select`` into a scratch buffer + ``index_copy_`` out of it, on int64 rows;
* ``d2d``: one contiguous ``copy_`` of the same number of bytes (the ceiling).

Run (from the repository root):  python3 benchmarks/probes/gpu_ipc_kernel.py [--out OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

CASES = ((16 << 10, 16384), (32 << 10, 8192), (64 << 10, 4096), (64 << 10, 16384), (2 << 20, 128), (64 << 20, 32))
VARIANTS = ((1024, 4, False), (2048, 8, False), (0, 4, True), (0, 8, True))  # (rows kernel's words, warps, chunks)


def _time(fn, reps: int, torch) -> list[float]:
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return out


def one_case(block: int, count: int, pools, reps: int, torch) -> dict:
    import kvlc.runtime.ipc.copy as ipc_copy
    from kvlc.runtime.ipc.copy import GpuCopy

    src, dst = pools
    nblocks = src.numel() // block
    rng = np.random.default_rng(block + count)
    s_ids = rng.choice(nblocks, count, replace=False)
    d_ids = rng.choice(nblocks, count, replace=False)
    nbytes = block * count
    row = {"block": block, "count": count, "mib": nbytes / 2**20}
    srcs = (src.data_ptr() + s_ids.astype(np.uint64) * block).astype(np.uint64)
    dsts = (dst.data_ptr() + d_ids.astype(np.uint64) * block).astype(np.uint64)
    lens = np.full(count, block, dtype=np.uint64)
    cp = GpuCopy(0)
    for words, warps, chunked in VARIANTS:
        cp.block_words, cp.num_warps, cp.chunked = words or ipc_copy.BLOCK_WORDS, warps, chunked
        name = f"chunks x{warps}" if chunked else f"kernel {words}w x{warps}"
        host, gpu = [], []

        def go():
            e0 = torch.cuda.Event(enable_timing=True)
            e0.record(cp.stream)
            t0 = time.perf_counter()
            launch = cp.start(srcs, dsts, lens)
            host.append(time.perf_counter() - t0)
            e1 = torch.cuda.Event(enable_timing=True)
            e1.record(cp.stream)
            torch.cuda.current_stream().wait_event(launch.event)
            gpu.append((e0, e1))

        for _ in range(3):
            go()
        host.clear()
        gpu.clear()
        ts = _time(go, reps, torch)
        torch.cuda.synchronize()
        row[name] = nbytes / statistics.median(ts) / 1e9
        row[f"{name} host us"] = statistics.median(host) * 1e6
        row[f"{name} gpu only"] = nbytes / statistics.median(a.elapsed_time(b) / 1e3 for a, b in gpu) / 1e9
    cp.block_words, cp.num_warps, cp.chunked = ipc_copy.BLOCK_WORDS, ipc_copy.NUM_WARPS, False
    dst.zero_()
    cp.start(srcs, dsts, lens).event.synchronize()
    sv, dv = src.view(-1, block), dst.view(-1, block)
    si, di = torch.from_numpy(s_ids).cuda(), torch.from_numpy(d_ids).cuda()
    ok = bool(torch.equal(dv[di], sv[si]))
    mask = torch.ones(dv.shape[0], dtype=torch.bool, device="cuda")
    mask[di] = False
    row["content ok"] = ok and not bool(dv[mask].any())
    s64, d64 = src.view(torch.int64).view(-1, block // 8), dst.view(torch.int64).view(-1, block // 8)
    scratch = torch.empty(count, block // 8, dtype=torch.int64, device="cuda")

    def tcopy():
        torch.index_select(s64, 0, si, out=scratch)
        d64.index_copy_(0, di, scratch)

    row["torch index"] = nbytes / statistics.median(_time(tcopy, reps, torch)) / 1e9
    a, b = src[:nbytes], dst[:nbytes]
    row["d2d"] = nbytes / statistics.median(_time(lambda: b.copy_(a), reps, torch)) / 1e9
    best = max(v for k, v in row.items() if k.endswith(("x4", "x8")))
    row["kernel / d2d"] = best / row["d2d"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pool-mib", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import torch

    n = args.pool_mib << 20
    pools = (torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda"),
             torch.zeros(n, dtype=torch.uint8, device="cuda"))
    rows = []
    for block, count in CASES:
        r = one_case(block, count, pools, args.reps, torch)
        rows.append(r)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0 if all(r["content ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
