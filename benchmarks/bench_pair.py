"""Pairing and request instantiation: kvlc against the per-block descriptor scheme.

Measured in one run, on one machine:
  * ``pair`` time for every checked-in pair (layouts/pairs/pairs.yaml), pull and push;
  * ``instantiate`` time for 128 regions x 512 blocks (bases bound once, as the
    runtime does), against a per-block baseline that builds one descriptor per
    block per region per source rank with numpy (the way upstream connectors do),
    the two called in turn in every timed round;
  * descriptors per request, kvlc vs per-block, for contiguous, fragmented and
    random block ids, homogeneous and heterogeneous TP, head-major (HND) and
    token-major (NHD) orders. The per-block scheme moves the right bytes only where a
    source rank's share of a block is one contiguous piece: same TP, or K/V-separate
    head-major (HND) regions; rows marked ``per_block_valid: false`` count descriptors
    of a scheme that would not be correct (token-major under heterogeneous TP).

Run:  python3 benchmarks/bench_pair.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LAYOUTS, ms, timeit, write_results  # noqa: E402

import kvlc  # noqa: E402
from kvlc.compiler.algebra.layout import ceildiv  # noqa: E402
from kvlc.compiler.pairing.pair import pair  # noqa: E402
from kvlc import bind, instantiate

QWEN = (LAYOUTS / "qwen3-32b-tp2.yaml").read_text()


def qwen(tp: int, order: str = "nhd") -> kvlc.Plan:
    """Qwen3-32B with K and V as separate regions (128 regions, 4096 blocks each) at TP ``tp``.

    K and V outermost is the layout upstream's per-block scheme is correct for: a
    head slice of a block is one contiguous piece in HND order.
    """
    text = QWEN.replace("tp_size: 2", f"tp_size: {tp}")
    if order == "hnd":
        text = text.replace("          - {name: token, role: token}\n          - {name: head, role: head}",
                            "          - {name: head, role: head}\n          - {name: token, role: token}")
    return kvlc.compile_spec(text)


def fake_bases(plan: kvlc.Plan, salt: int) -> dict:
    return {s.name: ((salt << 44) + (i << 34), s.device) for i, s in enumerate(plan.storages)}


def block_ids(kind: str, n: int, capacity: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "contiguous":
        start = int(rng.integers(0, capacity - n))
        return np.arange(start, start + n)
    if kind == "fragmented":  # runs of 8 consecutive blocks at random places
        starts = rng.permutation(capacity // 8)[: ceildiv(n, 8)] * 8
        return (starts[:, None] + np.arange(8)[None, :]).ravel()[:n]
    return rng.permutation(capacity)[:n]


def per_block_baseline(cons: kvlc.Plan, prod: kvlc.Plan, rank: int, lb: dict, rb: dict,
                       lids: np.ndarray, rids: np.ndarray) -> int:
    """One descriptor per block per region per source rank (numpy, as upstream builds them).

    With heterogeneous TP each descriptor covers one source rank's head share of a
    block (the upstream layout requirement), so its count is regions x blocks x sources.
    """
    ratio = max(1, prod.parallel.tp_size // cons.parallel.tp_size)
    srcs = [rank * ratio + i for i in range(ratio)] if prod.parallel.tp_size >= cons.parallel.tp_size \
        else [rank * prod.parallel.tp_size // cons.parallel.tp_size]
    lst = np.array([lb[r.storage][0] + r.offset for r in cons.regions], dtype=np.int64)
    lstr = np.array([r.block_stride for r in cons.regions], dtype=np.int64)
    blen = np.array([r.block_bytes for r in cons.regions], dtype=np.int64) // len(srcs)
    rows = []
    for j, s in enumerate(srcs):
        rst = np.array([rb[s][r.storage][0] + r.offset for r in prod.regions], dtype=np.int64)
        rstr = np.array([r.block_stride for r in prod.regions], dtype=np.int64)
        local = np.empty((len(lst), len(lids), 3), dtype=np.int64)
        remote = np.empty_like(local)
        local[:, :, 0] = lst[:, None] + lids[None, :] * lstr[:, None] + j * blen[:, None]
        local[:, :, 1] = blen[:, None]
        local[:, :, 2] = 0
        remote[:, :, 0] = rst[:, None] + rids[None, :] * rstr[:, None]
        remote[:, :, 1] = blen[:, None]
        remote[:, :, 2] = 0
        rows.append((local.reshape(-1, 3).view(np.uint64), remote.reshape(-1, 3).view(np.uint64)))
    return sum(len(r[0]) for r in rows)


def bench_pairs(quick: bool) -> list[dict]:
    pairs = yaml.safe_load((LAYOUTS / "pairs" / "pairs.yaml").read_text())["pairs"]
    out = []
    for p in pairs:
        prod = kvlc.compile_spec(LAYOUTS / p["producer"])
        cons = kvlc.compile_spec(LAYOUTS / p["consumer"])
        pull = timeit(lambda: pair(cons, prod, local_rank=0, direction="READ"), repeat=3 if quick else 7)
        push = timeit(lambda: pair(prod, cons, local_rank=0, direction="WRITE"), repeat=3 if quick else 7)
        out.append({"pair": p["name"], "regions": len(cons.regions), "pull_s": pull["median"],
                    "push_s": push["median"]})
        print(f"pair {p['name']:32s} regions={len(cons.regions):4d} pull {ms(pull['median'])}  "
              f"push {ms(push['median'])}")
    return out


CASES = [  # (name, consumer tp, producer tp, order)
    ("homogeneous tp1<-tp1", 1, 1, "nhd"),
    ("hetero tp2<-tp4 HND", 2, 4, "hnd"),
    ("hetero tp4<-tp2 HND", 4, 2, "hnd"),
    ("hetero tp2<-tp4 NHD", 2, 4, "nhd"),
]


def interleaved(fns: dict, repeat: int, warmup: int = 2) -> dict:
    """Median / min of each function, the functions called in turn in every round (same machine
    and allocator state for all of them)."""
    times = {k: [] for k in fns}
    for i in range(warmup + repeat):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                times[k].append(time.perf_counter() - t0)
    return {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "runs": len(v)}
            for k, v in times.items()}


def bench_requests(quick: bool, regions: int = 128, blocks: int = 512) -> list[dict]:
    out = []
    for name, ctp, ptp, order in CASES:
        cons, prod = qwen(ctp, order), qwen(ptp, order)
        assert len(cons.regions) == regions
        prog = pair(cons, prod, local_rank=0, direction="READ")
        lb = fake_bases(cons, 1)
        rb = {r: fake_bases(prod, 2 + r) for r in range(ptp)}
        bound = bind(prog, lb, rb)
        for kind in ("contiguous", "fragmented", "random"):
            lids = block_ids(kind, blocks, 4096, 1)
            rids = block_ids(kind, blocks, 4096, 2)
            req = ({"full": lids}, {"full": rids}, blocks * 16)
            t = interleaved({"bound": lambda b=bound, q=req: instantiate(b, *q),
                             "unbound": lambda p=prog, lb=lb, rb=rb, q=req: instantiate(bind(p, lb, rb), *q),
                             "per_block": lambda c=cons, p=prod, lb=lb, rb=rb, li=lids, ri=rids:
                                 per_block_baseline(c, p, 0, lb, rb, li, ri)},
                            repeat=7 if quick else 31)
            t_kvlc, t_full, t_base = t["bound"], t["unbound"], t["per_block"]
            parts = instantiate(bound, *req)
            n_kvlc = sum(len(p) for p in parts.values())
            # the coalesced minimum: every part sorted by address, then merged (O(N log N))
            n_min = sum(len(p) for p in instantiate(bound, *req, coalesce="sort").values())
            n_base = per_block_baseline(cons, prod, 0, lb, rb, lids, rids)
            row = {"case": name, "ids": kind, "regions": regions, "blocks": blocks,
                   "instantiate_bound_s": t_kvlc["median"], "instantiate_bound_min_s": t_kvlc["min"],
                   "instantiate_unbound_s": t_full["median"],
                   "per_block_baseline_s": t_base["median"], "per_block_baseline_min_s": t_base["min"],
                   "descriptors_kvlc": n_kvlc, "descriptors_per_block": n_base,
                   "descriptors_min": n_min, "at_minimum": n_kvlc == n_min,
                   "bytes": sum(p.nbytes for p in parts.values()),
                   "per_block_valid": order == "hnd" or ctp == ptp,
                   "time_ratio_kvlc_over_baseline": t_kvlc["median"] / t_base["median"],
                   "descriptor_ratio_kvlc_over_baseline": n_kvlc / n_base}
            out.append(row)
            print(f"{name:22s} {kind:10s} instantiate {ms(t_kvlc['median'])} "
                  f"(min {ms(t_kvlc['min'])}, unbound {ms(t_full['median'])}) "
                  f"per-block {ms(t_base['median'])}  descriptors {n_kvlc:7d} vs {n_base:7d} "
                  f"({n_kvlc / n_base:.4f}x)")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (for smoke runs)")
    ap.add_argument("--no-write", action="store_true", help="do not write benchmarks/results/pair.json")
    args = ap.parse_args(argv)
    pairs = bench_pairs(args.quick)
    reqs = bench_requests(args.quick)
    if not args.no_write:
        path = write_results("pair", {"pairs": pairs, "requests": reqs,
                                      "targets": {"pair_s": 0.1, "instantiate_128x512_s": 0.002,
                                                  "descriptor_ratio_contiguous": 0.1}})
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
