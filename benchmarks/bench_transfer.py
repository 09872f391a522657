"""Loopback transfer: kvlc requests between two processes (DRAM, UCX) against the physical limits.

For realistic requests — Llama-3.1-8B at 2k and 32k tokens, DeepSeek-V3 (MLA latent, 62
layers) at 4k tokens, Nemotron-H-8B (Mamba-2 state + attention, TP2) at 8k tokens — a
producer process and a consumer process (``kvlc.demo.procs``, the demo's engines) move
one request per round as pull, push and pull-via-push. In the same processes, interleaved
round by round with the kvlc rounds, two more agents per rank move the same byte count as ONE
descriptor (a "flat" plan: one region, one block, one contiguous buffer), as a READ and as a
WRITE: baseline (a). Baseline (b) is a numpy memcpy of the same bytes in this process.

Pools are shrunk to hold one request (every region keeps its layout; only ``num_blocks``
changes), not the requests. Every mode runs twice: with the producer's block ids a random
permutation of its pool (``kvlc.demo.run.make_workload``: the fragmented worst case for
coalescing) and with ids 0..n-1; the consumer's are contiguous. The first round of every run
is verified byte by byte with content codes and not timed; the timed rounds are not verified. Where the consumer pool is
too large to dump through the engine pipe on this machine (``--verify-max``), the first
round is verified on a pipeline stage of the same layout instead (the same request on its
first layers, via ``kvlc.demo.run.run_demo``), and the result says so.

Why fragmented requests are slower is measured in the same run: NIXL alone (no kvlc) between
this process and a spawned one moves 256 MiB as descriptors of one size, 4 KiB ... 256 MiB
(``nixl_sweep`` in the results); ``benchmarks/run.py`` also derives the cost of one more descriptor
from the random-id and contiguous-id runs of each case.

Run:  python3 benchmarks/bench_transfer.py [--quick] [--rounds N] [--case NAME]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LAYOUTS, timeit, write_results  # noqa: E402
from common import spread as _stats  # noqa: E402
from nixl_sweep import nixl_descriptor_sweep  # noqa: E402

from kvlc.compiler import compile_spec  # noqa: E402
from kvlc.compiler.algebra.layout import ceildiv  # noqa: E402
from kvlc.compiler.pairing.pair import pair  # noqa: E402
from kvlc.demo.run import MODES, cpu_plan, make_workload, run_demo, verify  # noqa: E402
from kvlc import bind, instantiate

TARGET_RATIO = 0.9  # kvlc GB/s >= 90% of one single-descriptor transfer of the same bytes
TIMEOUT = 120.0
FLAT_GROUP = "state"
IDS = ("random", "contiguous")  # producer block ids: a random permutation of the pool, or 0..n-1

CASES = [  # name, layout (producer = consumer), tokens per request
    ("llama-3.1-8b 2k", "llama-3.1-8b.yaml", 2048),
    ("llama-3.1-8b 32k", "llama-3.1-8b.yaml", 32768),
    ("deepseek-v3 MLA 4k", "deepseek-v3-tp1.yaml", 4096),
    ("nemotron-h-8b tp2 8k", "nemotron-h-8b-tp2.yaml", 8192),
]

FLAT_SPEC = """\
kvlc: 1
name: flat-{nbytes}-tp{tp}
model: {{name: single-descriptor-baseline, num_layers: 1, sizes: {{row: {rows}, byte: {width}}}}}
parallel: {{tp_size: {tp}}}
block_size: 16
groups:
  - {{name: {group}, kind: mamba}}
storages:
  - {{name: buf, mem: DRAM}}
layouts:
  flat:
    fields:
      - {{name: bytes, dtype: uint8, dims: [{{name: row}}, {{name: byte}}]}}
regions:
  - {{name: flat, storage: buf, layout: flat, num_blocks: 1, groups: [{group}]}}
"""

FLAT_ROW = 1 << 16  # bytes per row of the flat baseline


def flat_plan(nbytes: int, tp: int):
    """One region of one block of ``nbytes`` bytes, replicated on every rank: a request is ONE descriptor."""
    width = math.gcd(nbytes, FLAT_ROW)  # rows x width bytes: one dim may hold at most 2**24 values
    return compile_spec(FLAT_SPEC.format(nbytes=nbytes, rows=nbytes // width, width=width, tp=tp,
                                         group=FLAT_GROUP))


# ----------------------------------------------------------------------------- pools
def _need(plan, group: str, tokens: int) -> int:
    """Logical blocks of ``group`` one request of ``tokens`` tokens takes."""
    g = plan.group(group)
    return 1 if g.is_state else ceildiv(tokens, g.block_size)


def fitted_spec(spec: Path, tokens: int, out_dir: Path, layers: int | None = None, requests: int = 1) -> Path:
    """``spec`` with every region holding exactly ``requests`` requests of ``tokens`` tokens.

    Only ``num_blocks`` changes (declared storage sizes are dropped so storages shrink with
    the regions); ``layers`` keeps the first layers only (a pipeline stage, ``parallel.layers``).
    The returned YAML still names its original memory types; ``cpu_plan`` moves it to DRAM.
    """
    full = compile_spec(spec)
    data = yaml.safe_load(spec.read_text())

    def blocks_for(groups) -> int:
        return max(_need(full, g, tokens) * full.group(g).kernel_blocks_per_block for g in groups) * requests

    def edit_regions(entries):
        for e in entries:
            if "repeat" in e:
                edit_regions(e["regions"])
            else:
                e["num_blocks"] = blocks_for(e["groups"])

    def edit_storages(entries):
        for e in entries:
            if "repeat" in e:
                edit_storages(e["storages"])
            else:
                e.pop("size", None)

    edit_regions(data["regions"])
    edit_storages(data["storages"])
    name = spec.stem
    if layers is not None:
        data["parallel"]["layers"] = [0, layers]
        name += f"-stage{layers}"
    path = out_dir / f"{name}-{tokens}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def request_bytes(cons, prod, batch) -> list[int]:
    """Bytes each consumer rank receives for one request (from the transfer program, offline)."""
    out = []
    _, cids, pids, tokens = batch[0]
    for rank in range(cons.parallel.tp_size):
        prog = pair(cons, prod, local_rank=rank, direction="READ")
        lb = {s.name: (0, s.device) for s in cons.storages}
        rb = {r: {s.name: (0, s.device) for s in prod.storages} for r in prog.peer_ranks}
        parts = instantiate(bind(prog, lb, rb), cids, pids, tokens)
        out.append(int(sum(p.nbytes for p in parts.values())))
    return out


def pool_bytes(plan) -> int:
    return sum(s.size for s in plan.storages)


# ----------------------------------------------------------------------------- baselines
def bench_memcpy(nbytes: int, repeat: int) -> dict:
    """numpy copy of ``nbytes`` contiguous bytes between two warm buffers of this process."""
    src = np.empty(nbytes, dtype=np.uint8)
    src[:] = 0x5A
    dst = np.zeros(nbytes, dtype=np.uint8)
    dst[:] = 1
    t = timeit(lambda: np.copyto(dst, src), repeat=repeat, warmup=1)
    assert dst[0] == 0x5A and dst[-1] == 0x5A
    return {"seconds": t, "gbps": nbytes / t["median"] / 1e9}


def _load() -> float:
    with open("/proc/loadavg") as fh:
        return float(fh.read().split()[0])


def _mem_available() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


# ----------------------------------------------------------------------------- rounds

def _outcome(out: dict, receivers, ids, movers, s0) -> dict:
    """Wait until every receiver has the requests; gather failures and what the movers moved."""
    failed = {}
    for h in receivers:
        got = h.call("wait", ids, TIMEOUT, timeout=TIMEOUT + 30)
        failed.update(got["failed"])
        failed.update({r: "still open" for r in got["open"]})
    for a in out["agents"].values():
        failed.update(a["failed"])
        failed.update(a["errors"])
    s1 = [h.call("stats") for h in movers]
    return {
        "seconds": out["seconds"],
        "failed": failed,
        "bytes": sum(b["bytes"] - a["bytes"] for a, b in zip(s0, s1)),
        "descriptors": sum(b["descriptors"] - a["descriptors"] for a, b in zip(s0, s1)),
    }

class Engines:
    """The producer process and the consumer process of one case, with the flat-baseline agents."""

    def __init__(self, prod, cons, flat, fill_producer: str, progress: str = "thread"):
        from kvlc.demo.procs import EngineConfig, EngineProcess

        self.EngineConfig = EngineConfig
        self.progress = progress
        self.prod_plan, self.cons_plan, self.flat_plan = prod, cons, flat
        self.P, self.C = EngineProcess(), EngineProcess()
        self.prods = [
            self.P.add_async(self.cfg(prod, r, fill_producer)) for r in range(prod.parallel.tp_size)
        ]
        tp = flat.parallel.tp_size
        self.flat_p = [self.P.add_async(self.cfg(flat, r, "zeros")) for r in range(tp)]
        self.flat_c = [self.C.add_async(self.cfg(flat, r, "zeros")) for r in range(tp)]
        for h in self.prods + self.flat_p + self.flat_c:
            h.ready(600)
        for h in self.flat_c:
            h.connect([x.address for x in self.flat_p], "READ", "direct", "flat-read")
        for h in self.flat_p:
            h.connect([x.address for x in self.flat_c], "WRITE", "direct", "flat-write")
        self.cons = []
        self.n = 0

    def cfg(self, plan, rank, fill, seed=0):
        return self.EngineConfig(
            plan.to_json(), rank, fill=fill, seed=seed, timeout=TIMEOUT, progress=self.progress
        )

    def add_consumers(self, fill: str, seed: int) -> None:
        self.cons = [
            self.C.add_async(self.cfg(self.cons_plan, r, fill, seed + r))
            for r in range(self.cons_plan.parallel.tp_size)
        ]
        for h in self.cons:
            h.ready(600)

    def drop_consumers(self) -> None:
        for h in self.cons:
            h.call("drop")
        self.cons = []

    def connect(self, mode: str) -> tuple:
        """Connect for ``mode``; returns (initiator handles, their process, method, peer id)."""
        if mode == "push":
            links = [
                h.connect([c.address for c in self.cons], "WRITE", "direct", f"push{self.n}")
                for h in self.prods
            ]
            init, proc, method = self.prods, self.P, "write"
        else:
            how = "direct" if mode == "pull" else "pull_via_push"
            links = [
                h.connect([p.address for p in self.prods], "READ", how, f"{mode}{self.n}") for h in self.cons
            ]
            init, proc, method = self.cons, self.C, "read"
        active = [h for h, link in zip(init, links) if link["peer_ranks"]]
        return active, proc, method, f"{mode}{self.n}"

    def movers(self, mode: str):
        return self.prods if mode in ("push", "pull_via_push") else self.cons

    def kvlc_round(self, mode: str, link: tuple, batch) -> dict:
        """One round of requests; returns seconds (initiator side), bytes and descriptors moved."""
        active, proc, method, peer = link
        movers = self.movers(mode)
        s0 = [h.call("stats") for h in movers]
        reqs = [(r, p, c, n) for r, c, p, n in batch] if mode == "push" else batch
        out = proc.call(
            "batch", -1, [(h.aid, peer, method, reqs) for h in active], TIMEOUT, timeout=TIMEOUT + 30
        )
        return _outcome(out, self.cons, [b[0] for b in batch], movers, s0)

    def flat_round(self, op: str) -> dict:
        """One single-descriptor request per rank: a READ by the consumer side or a WRITE by the producer."""
        self.n += 1
        rid = f"flat-{op.lower()}-{self.n}"
        ids = {FLAT_GROUP: [0]}
        init, proc, method, peer = (
            (self.flat_c, self.C, "read", "flat-read")
            if op == "READ"
            else (self.flat_p, self.P, "write", "flat-write")
        )
        s0 = [h.call("stats") for h in init]
        out = proc.call(
            "batch",
            -1,
            [(h.aid, peer, method, [(rid, ids, ids, 16)]) for h in init],
            TIMEOUT,
            timeout=TIMEOUT + 30,
        )
        return _outcome(out, self.flat_c, [rid], init, s0)

    def stop(self) -> None:
        for p in (self.C, self.P):
            p.stop()


def verify_stage(spec: Path, tokens: int, layers: int, tmp: Path) -> dict:
    """Byte check of one request per mode on the first ``layers`` layers of ``spec`` (run_demo)."""
    stage = fitted_spec(spec, tokens, tmp, layers=layers)
    out = {
        "how": f"pipeline stage: layers [0, {layers}) of the same layout, same request, run_demo "
        f"(check=all), one request per mode",
        "checked_bytes": 0,
        "mismatches": [],
        "failed": {},
    }
    for mode in MODES:
        res = run_demo(
            stage, mode=mode, requests=1, tokens=tokens, max_bytes=1 << 62, check="all", timeout=TIMEOUT
        )
        out["checked_bytes"] += res.checked_bytes
        out["mismatches"] += [f"{mode}: {m}" for m in res.mismatches]
        out["failed"].update({f"{mode}:{k}": v for k, v in res.failed.items()})
    out["ok"] = not out["mismatches"] and not out["failed"] and out["checked_bytes"] > 0
    return out


def contiguous_workload(cons, prod, requests: int, tokens: int):
    """Rounds of one request each whose block ids are 0..n-1 on both sides (one run per region)."""
    groups = [g.name for g in cons.groups if g.name in {x.name for x in prod.groups}]
    cids = {g: list(range(_need(cons, g, tokens))) for g in groups}
    pids = {g: list(range(_need(prod, g, tokens))) for g in groups}
    return [[(f"req-{i}", cids, pids, tokens)] for i in range(requests)]


def run_mode(
    eng: Engines,
    row: dict,
    mode: str,
    ids: str,
    rounds: int,
    inline: bool,
    memcpy_gbps: float,
    seed: int,
    log=print,
) -> dict:
    """Round 0 (verified when ``inline``, untimed), then ``rounds`` timed rounds, each followed by
    one single-descriptor READ and one single-descriptor WRITE of the same byte count."""
    # Inline verification needs fresh (noise-filled) consumers for every run, so that a byte an
    # earlier run wrote cannot pass for a transfer. Otherwise one set serves every run: a dropped
    # agent's memory comes back only when the child's garbage collector runs, and large pools
    # would not fit twice.
    if inline or not eng.cons:
        eng.add_consumers("random" if inline else "zeros", seed=10 * seed + 1)
    link = eng.connect(mode)
    work = _mode_workload(eng, row["tokens"], mode, ids, rounds, seed)
    # Round 0: verified (inline) and not timed; it also warms both paths up.
    first = _first_round(eng, row["verify"], mode, ids, link, work[0], inline)
    eng.flat_round("READ"), eng.flat_round("WRITE")
    timed = _timed_rounds(eng, mode, link, work[1:rounds + 1], row["bytes_per_request"], dict(first["failed"]))
    m = _mode_numbers(mode, ids, timed, row["tp"], memcpy_gbps)
    log(
        f"[{row['case']}] {mode:13s} {ids:10s} {m['gbps']['median']:6.2f} GB/s  single READ "
        f"{m['single_read_gbps']['median']:6.2f}  WRITE {m['single_write_gbps']['median']:6.2f}  "
        f"memcpy {memcpy_gbps:6.2f}  kvlc/(a) {m['ratio_vs_single_read']:.3f} "
        f"(same op {m['ratio_vs_single_same_op']:.3f})  kvlc/(b) {m['ratio_vs_memcpy']:.3f}  "
        f"{m['descriptors_per_request']:.0f} descriptors/request"
        + (f"  FAILED {len(m['failed'])}" if m["failed"] else "")
    )
    if inline:
        eng.drop_consumers()
    return m


def _mode_workload(eng: Engines, tokens: int, mode: str, ids: str, rounds: int, seed: int) -> list:
    """``rounds + 1`` rounds of one request each, named after the mode and the kind of ids."""
    cons, prod = eng.cons_plan, eng.prod_plan
    if ids == "random":
        work = make_workload(cons, prod, rounds + 1, tokens, seed=seed)
    else:
        work = contiguous_workload(cons, prod, rounds + 1, tokens)
    assert all(len(b) == 1 for b in work), "pools hold one request: one request per round"
    return [[(f"{mode}-{ids}-{i}", *b[0][1:])] for i, b in enumerate(work)]


def _first_round(eng: Engines, v: dict, mode: str, ids: str, link, batch: list, inline: bool) -> dict:
    """The untimed round 0; with ``inline``, every consumer byte checked into the verify record ``v``."""
    before = [h.call("dump") for h in eng.cons] if inline else None
    first = eng.kvlc_round(mode, link, batch)
    v["failed"].update(first["failed"])
    if inline:
        for h, b in zip(eng.cons, before):
            checked, problems = verify(eng.cons_plan, h.config.rank, eng.prod_plan, b, h.call("dump"), batch)
            v["checked_bytes"] += checked
            v["mismatches"] += [f"{mode}/{ids}: {p}" for p in problems]
    return first


def _timed_rounds(eng: Engines, mode: str, link, work: list, total: int, failed: dict) -> dict:
    """Each round: the kvlc request, then one single-descriptor READ and WRITE of ``total`` bytes (GB/s each)."""
    kv, rd, wr, desc = [], [], [], []
    for batch in work:
        a = eng.kvlc_round(mode, link, batch)
        b = eng.flat_round("READ")
        c = eng.flat_round("WRITE")
        for x in (a, b, c):
            failed.update(x["failed"])
        assert a["bytes"] == total and b["bytes"] == total and c["bytes"] == total, (a, b, c, total)
        kv.append(total / a["seconds"] / 1e9)
        rd.append(total / b["seconds"] / 1e9)
        wr.append(total / c["seconds"] / 1e9)
        desc.append(a["descriptors"])
    return {"kvlc": kv, "read": rd, "write": wr, "descriptors": desc, "failed": failed}


def _mode_numbers(mode: str, ids: str, timed: dict, tp: int, memcpy_gbps: float) -> dict:
    kv, rd, wr, failed = timed["kvlc"], timed["read"], timed["write"], timed["failed"]
    same_op = wr if mode in ("push", "pull_via_push") else rd
    m = {
        "mode": mode,
        "ids": ids,
        "gbps": _stats(kv),
        "single_read_gbps": _stats(rd),
        "single_write_gbps": _stats(wr),
        "descriptors_per_request": statistics.mean(timed["descriptors"]),
        "single_descriptors_per_request": tp,
        "ratio_vs_single_read": statistics.median(kv) / statistics.median(rd),
        "ratio_vs_single_same_op": statistics.median(kv) / statistics.median(same_op),
        "ratio_vs_memcpy": statistics.median(kv) / memcpy_gbps,
        "failed": failed,
    }
    m["target_met"] = m["ratio_vs_single_same_op"] >= TARGET_RATIO and not failed  # same operation
    return m


def run_case(
    name: str,
    layout: str,
    tokens: int,
    rounds: int,
    verify_max: int,
    tmp: Path,
    progress: str = "thread",
    log=print,
) -> dict:
    spec = LAYOUTS / layout
    fitted = fitted_spec(spec, tokens, tmp)
    prod = cons = cpu_plan(fitted, max_bytes=1 << 62)
    tp = cons.parallel.tp_size
    probe = make_workload(cons, prod, 1, tokens, seed=0)[0]
    per_rank = request_bytes(cons, prod, probe)
    if len(set(per_rank)) != 1:
        raise SystemExit(
            f"{name}: consumer ranks receive unequal bytes {per_rank}; the flat baseline "
            f"assumes one share per rank"
        )
    total = sum(per_rank)
    flat = flat_plan(per_rank[0], tp)
    inline = pool_bytes(cons) * tp <= verify_max
    row = {"case": name, "layout": layout, "tokens": tokens, "tp": tp, "regions": len(cons.regions),
           "bytes_per_request": total, "bytes_per_rank": per_rank[0], "pool_bytes_per_rank": pool_bytes(cons),
           "rounds": rounds, "load_start": _load(), "mem_available_start": _mem_available()}
    log(
        f"[{name}] {len(cons.regions)} regions, TP{tp}, {total / 2**20:.1f} MiB per request, "
        f"pool {pool_bytes(cons) / 2**20:.1f} MiB per rank, load {row['load_start']:.2f}"
    )

    memcpy = bench_memcpy(total, repeat=max(3, rounds // 2))
    row["memcpy"] = memcpy
    log(f"[{name}] numpy memcpy {memcpy['gbps']:.2f} GB/s")
    row["verify"] = _verify_record(name, spec, tokens, tmp, inline, log)
    eng = Engines(prod, cons, flat, "content" if inline else "zeros", progress)
    try:
        row["runs"] = []
        for k, (ids, mode) in enumerate(((ids, mode) for ids in IDS for mode in MODES), start=1):
            row["runs"].append(run_mode(eng, row, mode, ids, rounds, inline, memcpy["gbps"], k, log))
    finally:
        eng.stop()
    v = row["verify"]
    if inline:
        v["ok"] = not v["mismatches"] and not v["failed"] and v["checked_bytes"] > 0
    row["load_end"] = _load()
    return row


def _verify_record(name: str, spec: Path, tokens: int, tmp: Path, inline: bool, log) -> dict:
    """How a case's bytes are verified: inline (filled in by each mode's first round) or on a stage now."""
    if inline:
        return {
            "how": "first round of every mode, in the timed engines (content codes; every "
            "other consumer byte unchanged)",
            "checked_bytes": 0,
            "mismatches": [],
            "failed": {},
        }
    v = verify_stage(spec, tokens, 4, tmp)
    log(f"[{name}] verified on a stage: {v['checked_bytes']:,} bytes, ok={v['ok']}")
    return v


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per mode (default 12; 4 for 32k)")
    ap.add_argument("--quick", action="store_true", help="3 rounds, without the 32k case (smoke run)")
    ap.add_argument(
        "--case",
        action="append",
        help="run only this case (its full name or one word of it, e.g. 2k, 32k, deepseek-v3; repeatable)",
    )
    ap.add_argument(
        "--verify-max",
        type=int,
        default=1 << 30,
        help="largest consumer pool (bytes, all ranks) verified in the timed engines",
    )
    ap.add_argument(
        "--progress",
        choices=("thread", "nixl", "manual"),
        default="thread",
        help="who drives NIXL in every agent (KvAgent progress; default thread)",
    )
    ap.add_argument("--no-write", action="store_true")
    return ap


def _selected_cases(args) -> list[tuple[str, str, int]]:
    cases = [c for c in CASES if not args.case or any(s == c[0] or s in c[0].split() for s in args.case)]
    return [c for c in cases if c[2] < 32768] if args.quick else cases


def _default_rounds(tokens: int, quick: bool) -> int:
    return 3 if quick else (4 if tokens >= 32768 else 12)


def _print_sweep(sweep: dict) -> None:
    for r in sweep["rows"]:
        print(
            f"  {r['op']:5s} {r['descriptor_bytes']:>10,} B x {r['descriptors']:>6,}  {r['gbps']:6.2f} GB/s"
            + (
                f"  (+{r['extra_us_per_descriptor']:.2f} us per descriptor)"
                if "extra_us_per_descriptor" in r
                else ""
            )
        )


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    rows = []
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="kvlc-bench-") as tmp:
        for name, layout, tokens in _selected_cases(args):
            rounds = args.rounds or _default_rounds(tokens, args.quick)
            rows.append(run_case(name, layout, tokens, rounds, args.verify_max, Path(tmp), args.progress))
    print("NIXL alone, 256 MiB as descriptors of one size (why fragmented requests are slower):")
    sweep = nixl_descriptor_sweep(repeat=3 if args.quick else 9)
    _print_sweep(sweep)
    ok = all(r["verify"]["ok"] for r in rows) and not any(m["failed"] for r in rows for m in r["runs"])
    print(f"done in {time.time() - t0:.0f} s; bytes verified: {'yes' if ok else 'NO'}")
    if not args.no_write:
        path = write_results(
            "transfer",
            {
                "quick": args.quick,
                "target_ratio": TARGET_RATIO,
                "cases": rows,
                "progress": args.progress,
                "nixl_sweep": sweep,
                "load_end": _load(),
                "all_verified": ok,
            },
        )
        print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
