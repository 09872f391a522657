"""GPU: the same-host copy kernel alone (kvlc.runtime.ipc), in one process, against torch's copies.

Two pools on cuda:0 (``--pool-mib`` each, random bytes); per case, ``count`` random distinct blocks
of ``block`` bytes of one pool are copied to random distinct blocks of the other (what a P/D
handover from an engine's pool after warm-up looks like), timed with CUDA events after warm-up
(median of ``--reps``), every destination block checked and the rest of the destination pool
unchanged:

* ``rows <words>w x<warps>[ host table]``: :class:`kvlc.runtime.ipc.copy.GpuCopy` (row table read in
  place from pinned host memory, or uploaded first + ONE Triton kernel, a program per row cut at
  256 KiB, looping ``<words>`` 8-byte words at a time), host work
  included (a request's real cost); ``host us``: the host's time to start it; ``gpu only``: from
  the copy stream's first work to its end;
* ``torch``: ``index_select`` into a scratch buffer + ``index_copy_`` out of it, on int64 rows;
* ``d2d``: one contiguous ``copy_`` of the same number of bytes (the ceiling).

Also the host's time in each stage of ``GpuCopy.start`` (``host stages``), and with ``--host-mib``
rows read from a pinned host pool through unified addressing (``h2d``: one pinned ``copy_``).

Run (from the repository root):  python3 benchmarks/probes/gpu_ipc_kernel.py [--host-mib 2048] [--out OUT.json]
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

CASES = ((16 << 10, 16384), (32 << 10, 8192), (64 << 10, 2048), (64 << 10, 4096), (64 << 10, 16384),
         (2 << 20, 128), (64 << 20, 32))
VARIANTS = ((1024, 4, True), (1024, 4, False), (512, 4, True), (2048, 8, True))  # (8-byte words per step,
# warps, row table read in place from pinned host memory: else uploaded to the device first)


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


def _timed_copy(torch, cp, fn, reps: int) -> tuple[list[float], list[float], list]:
    host, gpu = [], []

    def go():
        e0 = torch.cuda.Event(enable_timing=True)
        e0.record(cp.stream)
        t0 = time.perf_counter()
        ev = fn()
        host.append(time.perf_counter() - t0)
        e1 = torch.cuda.Event(enable_timing=True)
        e1.record(cp.stream)
        torch.cuda.current_stream().wait_event(ev)
        gpu.append((e0, e1))

    for _ in range(3):
        go()
    host.clear()
    gpu.clear()
    ts = _time(go, reps, torch)
    torch.cuda.synchronize()
    return ts, host, [a.elapsed_time(b) / 1e3 for a, b in gpu]


def one_case(block: int, count: int, pools, reps: int, torch, src_host=None) -> dict:
    from kvlc.runtime.ipc.copy import GpuCopy

    src, dst = pools
    if src_host is not None:
        src = src_host
    nblocks = min(src.numel(), dst.numel()) // block
    rng = np.random.default_rng(block + count)
    s_ids = rng.choice(nblocks, count, replace=False)
    d_ids = rng.choice(nblocks, count, replace=False)
    nbytes = block * count
    row = {"block": block, "count": count, "mib": nbytes / 2**20, "source": "pinned host" if src_host is not None else "vram"}
    srcs = (src.data_ptr() + s_ids.astype(np.uint64) * block).astype(np.uint64)
    dsts = (dst.data_ptr() + d_ids.astype(np.uint64) * block).astype(np.uint64)
    lens = np.full(count, block, dtype=np.uint64)
    cp = GpuCopy(0)
    cp.warm()
    row["direct launch"], row["host table"], row["vec"] = cp.direct, cp.host_table, cp.vec
    for words, warps, host_table in VARIANTS:
        cp.block_words, cp.num_warps, cp.host_table = words, warps, host_table and cp.host_table
        name = f"rows {words}w x{warps}{' host table' if cp.host_table else ''}"
        ts, host, gpu = _timed_copy(torch, cp, lambda: cp.start(srcs, dsts, lens).event, reps)
        row[name] = nbytes / statistics.median(ts) / 1e9
        row[f"{name} host us"] = statistics.median(host) * 1e6
        row[f"{name} gpu only"] = nbytes / statistics.median(gpu) / 1e9
    cp.block_words, cp.num_warps, cp.host_table = 1024, 4, row["host table"]
    dst.zero_()
    cp.start(srcs, dsts, lens).event.synchronize()
    sv, dv = src[:nblocks * block].view(-1, block), dst[:nblocks * block].view(-1, block)
    si, di = torch.from_numpy(s_ids).to(sv.device), torch.from_numpy(d_ids).cuda()
    ok = bool(torch.equal(dv[di].cpu(), sv[si].cpu()))
    mask = torch.ones(dv.shape[0], dtype=torch.bool, device="cuda")
    mask[di] = False
    row["content ok"] = ok and not bool(dv[mask].any())
    if src_host is None:
        s64, d64 = (t[:nblocks * block].view(torch.int64).view(-1, block // 8) for t in (src, dst))
        scratch = torch.empty(count, block // 8, dtype=torch.int64, device="cuda")
        si = si.cuda()

        def tcopy():
            torch.index_select(s64, 0, si, out=scratch)
            d64.index_copy_(0, di, scratch)

        row["torch index"] = nbytes / statistics.median(_time(tcopy, reps, torch)) / 1e9
    a, b = src[:nbytes], dst[:nbytes]
    ceiling = "h2d" if src_host is not None else "d2d"
    row[ceiling] = nbytes / statistics.median(_time(lambda: b.copy_(a, non_blocking=True), reps, torch)) / 1e9
    best = max(v for k, v in row.items() if k.startswith("rows") and k.endswith(("x4", "x8", "table")))
    row[f"rows / {ceiling}"] = best / row[ceiling]
    return row


def host_stages(torch, pools, count: int, block: int = 64 << 10, reps: int = 200) -> dict:
    """Host µs of each stage of GpuCopy.start (median of ``reps``, GPU idle between calls), direct
    launch on and off."""
    from kvlc.runtime.ipc.copy import GpuCopy, row_table

    src, dst = pools
    rng = np.random.default_rng(count)
    nblocks = src.numel() // block
    srcs = (src.data_ptr() + rng.choice(nblocks, count, replace=False).astype(np.uint64) * block).astype(np.uint64)
    dsts = (dst.data_ptr() + rng.choice(nblocks, count, replace=False).astype(np.uint64) * block).astype(np.uint64)
    lens = np.full(count, block, dtype=np.uint64)
    cp = GpuCopy(0)
    cp.warm()
    out = {"rows": count, "block": block, "direct launch": cp.direct, "host table": cp.host_table}
    stages: dict[str, list] = {}

    def t(name, fn):
        t0 = time.perf_counter()
        r = fn()
        stages.setdefault(name, []).append(time.perf_counter() - t0)
        return r

    for _ in range(reps):
        g = t("row_table", lambda: row_table(srcs, dsts, lens))
        t("wait for the caller's stream", lambda: (cp._waited.record(torch.cuda.current_stream(0)),
                                                   cp.stream.wait_event(cp._waited)))
        at, table, keep = t("table (ring write" + (")" if cp.host_table else " + upload)"), lambda: cp._upload(g.table))
        t("launch", lambda: cp._launch(g, table))
        ev = t("event", lambda: (lambda e: (e.record(cp.stream), e)[1])(torch.cuda.Event()))
        cp.ring.used(at, len(g.table), ev)
        t("event.query (running)", ev.query)
        ev.synchronize()
        t("event.query (done)", ev.query)
        t("start (whole)", lambda: cp.start(srcs, dsts, lens)).event.synchronize()
        cp.direct = not cp.direct
        t("start (whole, other launch)", lambda: cp.start(srcs, dsts, lens)).event.synchronize()
        cp.direct = not cp.direct
    for k, v in stages.items():
        out[k] = statistics.median(v) * 1e6
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pool-mib", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--host-mib", type=int, default=0, help="also copy rows from a pinned host pool of this size")
    ap.add_argument("--cases", default="", help="BLOCK:COUNT,... instead of the default cases")
    args = ap.parse_args(argv)
    import torch

    n = args.pool_mib << 20
    pools = (torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda"),
             torch.zeros(n, dtype=torch.uint8, device="cuda"))
    rows, stages = [], []

    def say(r):
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}), flush=True)

    for count in (2048, 8192):
        stages.append(host_stages(torch, pools, count))
        say(stages[-1])
    cases = [tuple(int(x) for x in c.split(":")) for c in args.cases.split(",")] if args.cases else CASES
    for block, count in cases:
        rows.append(one_case(block, count, pools, args.reps, torch))
        say(rows[-1])
    if args.host_mib:
        host = torch.randint(0, 256, (args.host_mib << 20,), dtype=torch.uint8).pin_memory()
        for block, count in ((64 << 10, 2048), (656 * 64, 4096), (2 << 20, 64)):
            rows.append(one_case(block, count, pools, args.reps, torch, src_host=host))
            say(rows[-1])
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows,
                                        "host stages": stages}, indent=1))
    return 0 if all(r["content ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
