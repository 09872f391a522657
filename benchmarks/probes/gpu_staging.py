"""GPU cases around raw NIXL and staging (imported by gpu_transfer.py; runs alone too).

Every case is two processes with real NIXL agents (``testkit.staging_pair``), on the
producer's and the consumer's cuda device as given:

* raw NIXL: one descriptor of the same bytes, WRITE and READ (256 MiB, 2 GiB), requests in flight
  together; the same bytes as the request's own rows (32 x 8 MiB, 4,086 x 64 KiB) with UCX thread
  pool settings side by side;
* staged: 4,086 scattered 64 KiB blocks VRAM -> VRAM, and 256 MiB DRAM -> VRAM and VRAM -> DRAM
  (contiguous 32 x 8 MiB and fragmented 4,086 x 64 KiB), through VRAM bounce buffers;
* checks: the same modes on small regions with content-coded bytes, every destination byte
  compared and every other byte unchanged.

    python3 benchmarks/probes/gpu_staging.py [--producer-device 0] [--consumer-device 0]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MiB = 1 << 20
BLOCK = 64 << 10
FRAG = 4086           # descriptors of a 256 MiB Llama-3.1-8B request with random block ids
LAYERS = 32


def contiguous(n_rows: int, size: int, src_region: int = 0, dst_region: int = 0):
    from testkit.staging_pair import Ranges

    offs = np.arange(n_rows, dtype=np.int64) * size
    src = np.stack([np.full(n_rows, src_region), offs, np.full(n_rows, size)], axis=1)
    dst = np.stack([np.full(n_rows, dst_region), offs, np.full(n_rows, size)], axis=1)
    return Ranges(src, dst)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds else 0.0


def _guard(rows: list, name: str, fn) -> None:
    t0 = time.time()
    try:
        row = fn()
    except Exception as exc:  # record and go on: one device call should tell everything
        row = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
    row = {"case": name, **row, "wall_s": round(time.time() - t0, 1)}
    rows.append(row)
    print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)


def raw_cases(pdev: int, cdev: int, quick: bool) -> list[dict]:
    """Raw NIXL between the two devices' processes: single descriptor, and rows, with UCX settings."""
    from testkit.staging_pair import Pair, Side

    rows: list[dict] = []
    big = (512 if quick else 2048) * MiB
    for label, ucx in ((RAW_DEFAULT, {}), ("threads=4 split=4", {"num_threads": 4}),
                       ("threads=4 split=8", {"num_threads": 4, "split_batch_size": 8}),
                       ("threads=8 split=8", {"num_threads": 8, "split_batch_size": 8})):
        pair = Pair(Side((big,), device=pdev, fill=False, ucx=ucx), Side((big,), device=cdev, fill=False, ucx=ucx))
        try:
            _raw_setting(rows, pair, label, big)
        finally:
            pair.stop()
    return rows


RAW_DEFAULT = "no thread pool (kvlc default)"


def _raw_setting(rows: list[dict], pair, label: str, big: int) -> None:
    """The raw cases of one UCX setting: the default runs every one, the thread pools the WRITEs that matter."""
    from testkit.staging_pair import fragmented

    for size, inflight, reps in ((256 * MiB, 4, 4), (big, 1, 3)):
        for op in ("WRITE", "READ"):
            if label != RAW_DEFAULT and (op == "READ" or size != 256 * MiB):
                continue
            req = [contiguous(1, size)] * inflight
            _guard(rows, f"raw {op} 1 desc {size // MiB} MiB [{label}]",
                   lambda: _raw(pair, op, req, reps, True))
    for desc, size in ((32, 8 * MiB), (32, 64 * MiB)):
        if desc * size > big or (size > 8 * MiB and label not in (RAW_DEFAULT, "threads=4 split=4")):
            continue
        req = [contiguous(desc, size)] * (4 if size == 8 * MiB else 2)
        _guard(rows, f"raw WRITE {desc} x {size // MiB} MiB rows [{label}]",
               lambda: _raw(pair, "WRITE", req, 3, False))
    frag = [fragmented(1, 1, FRAG, BLOCK, big // BLOCK, seed=s) for s in range(2)]
    _guard(rows, f"raw WRITE {FRAG} x 64 KiB rows [{label}]", lambda: _raw(pair, "WRITE", frag, 1, False))


def _raw(pair, op, req, reps, single) -> dict:
    r = pair.raw(op, req, reps=reps, single=single)
    return {"bytes": r["bytes"], "seconds": r["seconds"], "gbps": _gbps(r["bytes"], r["seconds"]),
            "requests": len(req) * reps, "bytes_per_request": req[0].nbytes,
            "descriptors_per_request": 1 if single else len(req[0].src)}


def staged_cases(pdev: int, cdev: int, quick: bool) -> list[dict]:
    """Staged throughput: fragmented VRAM -> VRAM, mixed both ways (contiguous and fragmented)."""
    from testkit.staging_pair import Pair, Side, fragmented

    rows: list[dict] = []
    region = 32 * MiB                       # 512 blocks of 64 KiB per "layer" region
    pool = (LAYERS * region,)
    n_req = 4 if quick else 8
    frag = [fragmented(1, 1, FRAG, BLOCK, pool[0] // BLOCK, seed=s) for s in range(n_req)]
    cont = [contiguous(32, 8 * MiB)] * n_req
    setups = [
        ("VRAM -> VRAM", ("VRAM",), ("VRAM",), [("fragmented", frag)]),
        ("DRAM -> VRAM", ("DRAM",), ("VRAM",), [("contiguous", cont), ("fragmented", frag)]),
        ("VRAM -> DRAM", ("VRAM",), ("DRAM",), [("contiguous", cont), ("fragmented", frag)]),
    ]
    for name, pm, cm, loads in setups:
        for slot_bytes, slots in ((64 * MiB, 4),) if quick else ((64 * MiB, 4), (128 * MiB, 4), (32 * MiB, 8)):
            pair = Pair(Side(pool, pm, pdev, slot_bytes, slots, fill=False),
                        Side(pool, cm, cdev, slot_bytes, slots, fill=False))
            try:
                for ids, reqs in loads:
                    pair.staged(reqs[:1])  # warm: first chunk allocations, CUDA caching allocator
                    _guard(rows, f"staged {name} {ids} [{slots} x {slot_bytes // MiB} MiB]",
                           lambda: _staged(pair, reqs))
                if name != "VRAM -> VRAM":
                    one = [contiguous(1, 256 * MiB)]
                    _guard(rows, f"raw WRITE {name} 1 desc 256 MiB (no staging)", lambda: _raw(pair, "WRITE", one, 1, True))
            finally:
                pair.stop()
    return rows


def _raw_serial(pair, req) -> dict:
    r = pair.raw("WRITE", req, reps=2, single=True, serial=True)
    return {"bytes": r["bytes"], "seconds": r["seconds"], "gbps": _gbps(r["bytes"], r["seconds"]),
            "requests": 2 * len(req), "ms_per_request": r["seconds"] / (2 * len(req)) * 1e3}


def _staged(pair, reqs) -> dict:
    s, r = pair.staged(reqs, timeout=120.0)
    nbytes = sum(q.nbytes for q in reqs)
    return {"bytes": nbytes, "seconds": s["seconds"], "gbps": _gbps(nbytes, s["seconds"]),
            "requests": len(reqs), "descriptors_per_request": len(reqs[0].src),
            "copy_calls_sender": s["copy_calls"], "copy_calls_receiver": r["copy_calls"],
            "failed": {**s["failed"], **r["failed"]}}


def diag_cases(pdev: int, cdev: int) -> list[dict]:
    """Where staged fragmented VRAM time goes: the same run without the receiver's scatter, without the
    sender's gather, and one process doing gather, copy and scatter of the same chunks on one stream."""
    from testkit.staging_pair import Pair, Side, fragmented

    rows: list[dict] = []
    pool = (LAYERS * 32 * MiB,)
    reqs = [fragmented(1, 1, FRAG, BLOCK, pool[0] // BLOCK, seed=s) for s in range(8)]
    for what, sd, rd, prepped in (("full, WRITE per chunk created", "", "", False), ("full", "", "", True),
                                  ("no copies, WRITE per chunk created", "no-gather", "no-scatter", False),
                                  ("no copies", "no-gather", "no-scatter", True)):
        pair = Pair(Side(pool, ("VRAM",), pdev, 128 * MiB, 4, fill=False, diag=sd, prepped=prepped),
                    Side(pool, ("VRAM",), cdev, 128 * MiB, 4, fill=False, diag=rd, prepped=prepped))
        try:
            pair.staged(reqs[:1])
            _guard(rows, f"diag staged VRAM -> VRAM fragmented, {what} [4 x 128 MiB]", lambda: _staged(pair, reqs))
            if prepped and not sd:
                _guard(rows, "diag notification round trip (ping/pong)", lambda: pair.ping(300))
                one = [contiguous(1, 256 * MiB)]
                _guard(rows, "diag raw WRITE 1 desc 256 MiB, created per request, one at a time",
                       lambda: _raw_serial(pair, one * 8))
        finally:
            pair.stop()
    _guard(rows, "diag one process: gather + d2d copy + scatter, 4,086 x 64 KiB x 8", lambda: _one_process(pdev, reqs))
    return rows


def _one_process(dev: int, reqs) -> dict:
    import torch

    from kvlc.runtime.staging.copy import Copier, Regions

    src = torch.zeros(LAYERS * 32 * MiB, dtype=torch.uint8, device=f"cuda:{dev}")
    dst = torch.zeros_like(src)
    a = torch.empty(256 * MiB, dtype=torch.uint8, device=src.device)
    b = torch.empty_like(a)
    gather, scatter = Copier(Regions.of_tensors([src])), Copier(Regions.of_tensors([dst]))
    rows = [(_abs(r.src, src), _abs(r.dst, dst)) for r in reqs]
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for s_rows, d_rows in rows:
            gather.gather(s_rows, a)
            b.copy_(a)
            scatter.scatter(b, d_rows)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    nbytes = sum(r.nbytes for r in reqs)
    return {"bytes": nbytes, "seconds": seconds, "gbps": _gbps(nbytes, seconds), "requests": len(reqs)}


def _abs(r, t):
    return np.stack([r[:, 1].astype(np.uint64) + np.uint64(t.data_ptr()), r[:, 2].astype(np.uint64)], axis=1)


def check_cases(pdev: int, cdev: int) -> list[dict]:
    """Content-coded bytes through staging in every memory pairing: all destination bytes compared."""
    from testkit.staging_pair import Pair, Ranges, Side, fragmented

    rows: list[dict] = []
    regions = (8 * MiB,) * 4
    for pm, cm in (("VRAM", "VRAM"), ("DRAM", "VRAM"), ("VRAM", "DRAM"), ("DRAM", "DRAM")):
        def run(pm=pm, cm=cm):
            pair = Pair(Side(regions, (pm,) * 4, pdev, 1 * MiB, 3), Side(regions, (cm,) * 4, cdev, 1 * MiB, 3))
            try:
                frag = fragmented(4, 4, 1200, 16 << 10, 512, seed=3)
                big = contiguous(3, 2 * MiB + 4096, 0, 1)  # crosses chunk boundaries
                odd = Ranges(np.array([[2, 5, 300_001], [3, 7, 33]]), np.array([[3, 1 << 22, 300_001], [2, 99, 33]]))
                s, r = pair.staged([frag, big, odd])
                checked = pair.check([frag, big, odd])
                ok = not s["failed"] and not r["failed"] and not checked["mismatches"] and r["received"] == 3
                return {"ok": ok, "verified_bytes": checked["checked_bytes"], "mismatches": checked["mismatches"][:5],
                        "failed": {**s["failed"], **r["failed"]}, "moved_bytes": frag.nbytes + big.nbytes + odd.nbytes}
            finally:
                pair.stop()
        _guard(rows, f"check staged {pm} -> {cm}", run)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--producer-device", type=int, default=0)
    ap.add_argument("--consumer-device", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    p, c = args.producer_device, args.consumer_device
    rows = check_cases(p, c) + raw_cases(p, c, args.quick) + staged_cases(p, c, args.quick)
    if args.out:
        Path(args.out).write_text(json.dumps({"benchmark": "gpu-staging", "rows": rows}, indent=2) + "\n")
    return 0 if all(r.get("ok", True) and "error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
