"""NIXL descriptor-list preparation: (N, 3) rows against strided (N, 5) rows.

A plan region is `num_blocks` blocks of `block_bytes` every `block_stride` bytes:
exactly one strided row (addr, len, dev, stride, count). Preparing a list of N
block descriptors as N rows of (addr, len, dev) is what a per-block scheme does;
as strided rows it is one row per region. Both lists are prepared from the
same registered DRAM buffer, in the same run, for N = 10k ... 10M.

Section "program lists": the strided lists of real transfer programs (Llama-3.1-70B HND TP8->TP4,
Qwen3-32B): strided rows against the descriptors they expand to, prep time of both forms, and the
time to build one request's index arrays (BoundProgram.prepared_indices) against instantiate.

Run:  python3 benchmarks/bench_nixl_prep.py [--max 10000000] [--quick] [--no-programs]
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

from kvlc.compiler.algebra.layout import ceildiv  # noqa: E402
from kvlc import bind, instantiate
from kvlc.compiler.request.prepared import prepared_indices, prepared_rows

BLOCK = 16          # bytes per descriptor (small, so 10M descriptors fit a 160 MB buffer)
REGIONS = 8         # strided rows (one per region)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max", type=int, default=10_000_000, help="largest descriptor count")
    ap.add_argument("--quick", action="store_true", help="one repetition per size")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--no-programs", action="store_true", help="skip the 'program lists' section")
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
            rows.append(_size_row(agent, base, n, 1 if args.quick or n >= 10_000_000 else 3))
    finally:
        agent.deregister_memory(reg)
    programs = [] if args.no_programs else program_lists(nixl_agent, nixl_agent_config, args.quick)
    if not args.no_write:
        print(f"wrote {write_results('nixl_prep', {'block_bytes': BLOCK, 'rows': rows, 'program_lists': programs})}")
    return 0


def _size_row(agent, base: int, n: int, reps: int) -> dict:
    """Build and prep times of ``n`` descriptors as an (N, 3) list and as one strided (R, 5) row per region."""
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
    t3, t5 = [], []
    for _ in range(reps):
        gc.collect()
        t3.append(_prep_once(agent, n3))
        t5.append(_prep_once(agent, n5))
    expanded = int(n5[:, 4].sum())
    row = {"descriptors": REGIONS * per, "strided_rows": REGIONS, "strided_expanded": expanded,
           "build_nx3_s": build3, "prep_nx3_s": min(t3), "prep_nx5_s": min(t5),
           "speedup_nx5": min(t3) / max(min(t5), 1e-9)}
    print(f"N={REGIONS * per:>10,d}  build Nx3 {ms(build3):>12}  prep Nx3 {ms(min(t3)):>12}  "
          f"prep Nx5 ({REGIONS} rows, {expanded:,d} descs) {ms(min(t5)):>10}  "
          f"{row['speedup_nx5']:.0f}x")
    return row


def _prep_once(agent, rows: np.ndarray) -> float:
    """Seconds NIXL takes to prepare one local list of ``rows`` (the handle is released after)."""
    t0 = time.perf_counter()
    h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, "DRAM")
    seconds = time.perf_counter() - t0
    agent.release_dlist_handle(h)
    return seconds


# ----------------------------------------------------------------------------- program lists
# (name, consumer layout, producer layout): consumer rank 0 pulls (READ) from the producer.
PROGRAM_PAIRS = (("llama70b-hnd-tp8-to-tp4", "llama-3.1-70b-hnd-tp4.yaml", "llama-3.1-70b-hnd-tp8.yaml"),
                 ("qwen3-32b-tp2", "qwen3-32b-tp2.yaml", "qwen3-32b-tp2.yaml"))
REQUEST_TOKENS = 4096


def _storage_buffer(plan):
    """One zeroed buffer holding every storage of a plan (pages stay untouched) and its bases."""
    sizes = [ceildiv(s.size, 4096) * 4096 for s in plan.storages]
    buf = np.zeros(sum(sizes) + 4096, dtype=np.uint8)
    offs = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    base = ceildiv(buf.ctypes.data, 4096) * 4096
    return buf, {s.name: (base + int(o), 0) for s, o in zip(plan.storages, offs)}


def _expand(rows5: np.ndarray) -> np.ndarray:
    """The (N, 3) list a strided (R, 5) list stands for, in NIXL's expansion order."""
    counts = rows5[:, 4].astype(np.int64)
    r = np.repeat(np.arange(len(rows5)), counts)
    k = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    out = np.empty((len(r), 3), dtype=np.uint64)
    out[:, 0] = rows5[r, 0] + k.astype(np.uint64) * rows5[r, 3]
    out[:, 1] = rows5[r, 1]
    out[:, 2] = rows5[r, 2]
    return out


def program_lists(nixl_agent, nixl_agent_config, quick: bool) -> list[dict]:
    """Strided lists of real transfer programs: rows vs expanded descriptors, prep time of both forms,
    and per request the index arrays (prepared_indices) against instantiate."""
    import kvlc
    from common import LAYOUTS
    from kvlc.compiler.pairing.pair import pair

    print(f"\nprogram lists (consumer rank 0 pulls; request of {REQUEST_TOKENS} tokens, random block ids)")
    out = []
    reps = 1 if quick else 3
    for name, cname, pname in PROGRAM_PAIRS:
        cons, prod = kvlc.compile_spec(LAYOUTS / cname), kvlc.compile_spec(LAYOUTS / pname)
        prog = pair(cons, prod, local_rank=0, direction="READ")
        local = nixl_agent(f"plist-local-{name}", nixl_agent_config(backends=["UCX"]))
        remote = nixl_agent(f"plist-remote-{name}", nixl_agent_config(backends=["UCX"]))
        lbuf, lbases = _storage_buffer(cons)
        regs = [(local, local.register_memory(np.array([[lbuf.ctypes.data, lbuf.nbytes, 0]], np.uint64), "DRAM"))]
        keep, rbases = [lbuf], {}
        for peer in prog.peer_ranks:
            rbuf, rbases[peer] = _storage_buffer(prod)
            keep.append(rbuf)
            regs.append((remote, remote.register_memory(np.array([[rbuf.ctypes.data, rbuf.nbytes, 0]], np.uint64),
                                                         "DRAM")))
        rname = local.add_remote_agent(remote.get_agent_metadata())
        rname = rname.decode() if isinstance(rname, bytes) else rname
        try:
            # the runtime registers DRAM here: prepare every list as DRAM whatever the plan says
            bound = bind(prog, lbases, rbases)
            row = {"pair": name, **_list_numbers(bound, local, rname, reps), "request_tokens": REQUEST_TOKENS,
                   **_request_numbers(bound, cons, prod)}
            out.append(row)
            _print_row(name, row)
        finally:
            local.remove_remote_agent(rname)
            for agent, reg in regs:
                agent.deregister_memory(reg)
            del keep
    return out


def _list_numbers(bound, local, rname: str, reps: int) -> dict:
    """The prepared lists of ``bound``: strided rows, descriptors, build and prep time of both forms."""
    t0 = time.perf_counter()
    lists = prepared_rows(bound)
    build5 = time.perf_counter() - t0
    srows = sum(2 * len(pl) for pl in lists.values())
    expanded = sum(pl.local_size + pl.remote_size for pl in lists.values())
    t0 = time.perf_counter()
    full = [(_expand(pl.local), _expand(pl.remote)) for pl in lists.values()]
    build3 = time.perf_counter() - t0
    t5, t3 = [], []
    for _ in range(reps):
        for times, pairs_ in ((t5, [(pl.local, pl.remote) for pl in lists.values()]), (t3, full)):
            times.append(_prep_seconds(local, rname, pairs_))
    return {"parts": len(lists), "strided_rows": srows, "expanded_descriptors": expanded,
            "build_nx5_s": build5, "build_nx3_s": build3, "prep_nx5_s": min(t5), "prep_nx3_s": min(t3)}


def _prep_seconds(local, rname: str, pairs_: list) -> float:
    """Seconds to prepare every (local rows, remote rows) list with NIXL (the handles are released after)."""
    gc.collect()
    t0 = time.perf_counter()
    hs = [local.prep_xfer_dlist("NIXL_INIT_AGENT", lrows, "DRAM") for lrows, _ in pairs_]
    hs += [local.prep_xfer_dlist(rname, rrows, "DRAM") for _, rrows in pairs_]
    seconds = time.perf_counter() - t0
    for h in hs:
        local.release_dlist_handle(h)
    return seconds


def _request_numbers(bound, cons, prod) -> dict:
    """One request of random block ids: prepared_indices against instantiate (sizes and median times)."""
    from common import timeit

    rng = np.random.default_rng(0)
    ids = {}
    for side, plan in (("local", cons), ("remote", prod)):
        g = plan.groups[0]
        cap = min(r.capacity for r in plan.regions if g.name in r.groups)
        ids[side] = {g.name: rng.choice(cap, ceildiv(REQUEST_TOKENS, g.block_size), replace=False)}
    req = prepared_indices(bound, ids["local"], ids["remote"], REQUEST_TOKENS)
    parts = instantiate(bound, ids["local"], ids["remote"], REQUEST_TOKENS)
    t_idx = timeit(lambda: prepared_indices(bound, ids["local"], ids["remote"], REQUEST_TOKENS), repeat=7)
    t_inst = timeit(lambda: instantiate(bound, ids["local"], ids["remote"], REQUEST_TOKENS), repeat=7)
    return {"request_indices": sum(len(i[0]) for i in req.indices.values()),
            "request_tail_rows": sum(len(p) for p in req.tail.values()),
            "instantiate_rows": sum(len(p) for p in parts.values()),
            "prepared_indices_s": t_idx["median"], "instantiate_s": t_inst["median"]}


def _print_row(name: str, row: dict) -> None:
    srows, expanded = row["strided_rows"], row["expanded_descriptors"]
    print(f"{name:<24} lists: {srows:,d} strided rows = {expanded:,d} descriptors "
          f"({row['parts']} parts x local+remote)  prep Nx5 {ms(row['prep_nx5_s'])}  "
          f"prep Nx3 {ms(row['prep_nx3_s'])} ({row['prep_nx3_s'] / max(row['prep_nx5_s'], 1e-9):.0f}x)")
    print(f"{'':<24} request: {row['request_indices']:,d} indices + {row['request_tail_rows']} tail rows "
          f"in {ms(row['prepared_indices_s'])}  vs instantiate {row['instantiate_rows']:,d} rows "
          f"in {ms(row['instantiate_s'])}")


if __name__ == "__main__":
    sys.exit(main())
