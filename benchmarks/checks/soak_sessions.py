"""Soak: at least 10,000 requests over 2 producer engines x 3 consumer engines of mixed TP, every mode.

Engines (one process each, real NIXL/UCX agents on loopback, tiny dense test layouts):
P1 TP1 and P2 TP2 (producers, content-coded); C1 TP1, C2 TP2, C3 TP1 (consumers; C1 and C3 share a plan).
Every consumer rank connects to every producer engine in direct, prepped and pull-via-push mode, every
producer rank pushes to every consumer engine. Rounds of requests run until ``--requests`` are done; the
first and the last round are checked byte by byte (every destination byte, nothing else changed).
Open fds, threads, RSS and live NIXL handles of every engine process are reported after the warm-up
round and at the end: a leak shows as growth.

    PYTHONPATH=. python3 benchmarks/checks/soak_sessions.py --requests 10000 [--out soak.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvlc import compile_spec  # noqa: E402
from kvlc.demo.run import verify  # noqa: E402
from kvlc.demo.procs import EngineConfig, EngineProcess, stop_engines  # noqa: E402

LAYOUTS = ROOT / "tests" / "runtime" / "layouts"
MODES = ("direct", "prepped", "pull_via_push", "push")
SPEC = {"P1": ("dense-tp1", "content"), "P2": ("dense-tp2-hnd-b32", "content"),
        "C1": ("dense-tp1", "random"), "C2": ("dense-tp2-hnd-b32", "random"), "C3": ("dense-tp1", "random")}
TIMEOUT = 60.0


def start():
    plans = {n: compile_spec(LAYOUTS / f"{layout}.yaml") for n, (layout, _) in SPEC.items()}
    procs = {n: EngineProcess() for n in SPEC}
    eng = {}
    for n, (_, fill) in SPEC.items():
        hs = [procs[n].add_async(EngineConfig(plans[n].to_json(), r, fill=fill, seed=r, engine_id=n,
                                              timeout=TIMEOUT)) for r in range(plans[n].parallel.tp_size)]
        eng[n] = [h.ready() for h in hs]
    for c in ("C1", "C2", "C3"):
        for p in ("P1", "P2"):
            for mode in MODES:
                _connect(eng, c, p, mode)
    return plans, procs, eng


def _connect(eng, c: str, p: str, mode: str) -> None:
    """Push: every rank of producer ``p`` to consumer ``c``; otherwise every rank of ``c`` to ``p``."""
    if mode == "push":
        for h in eng[p]:
            h.connect([x.address for x in eng[c]], "WRITE", "direct", f"push-{c}")
    else:
        for h in eng[c]:
            h.connect([x.address for x in eng[p]], "READ", mode, f"{p}-{mode}")


def workload(plans, c, p, mode, count, tag, disjoint):
    """``count`` requests of 20 tokens; destinations disjoint only when the round is verified."""
    nc, np_ = plans[c].blocks_for("full", 20), plans[p].blocks_for("full", 20)
    cap_c = plans[c].group_capacity("full")
    out = []
    for i in range(count):
        slot = (disjoint + i) if disjoint is not None else i
        cids = [(slot * nc + k) % cap_c for k in range(nc)]
        pids = [(11 * i + 5 * k + len(tag)) % 40 for k in range(np_)]
        out.append((f"{tag}-{c}-{p}-{mode}-{i}", {"full": cids}, {"full": pids}, 20))
    return out


def run_round(plans, eng, tag, per_pair, check):
    before = {c: [h.call("dump") for h in eng[c]] for c in ("C1", "C2", "C3")} if check else None
    waits, batches = {}, {c: [] for c in ("C1", "C2", "C3")}
    for c in ("C1", "C2", "C3"):
        slot = 0
        for p in ("P1", "P2"):
            for mode in MODES:
                reqs = workload(plans, c, p, mode, per_pair, tag, slot if check else None)
                slot += per_pair
                batches[c].append((p, reqs))
                _submit(eng, c, p, mode, reqs, waits)
    failed = _wait_all(waits)
    checked, problems = _check_round(plans, eng, before, batches) if check else (0, [])
    return sum(len(r) for c in batches for _, r in batches[c]), failed, checked, problems


def _submit(eng, c: str, p: str, mode: str, reqs: list, waits: dict) -> None:
    """Submit ``reqs`` between consumer ``c`` and producer ``p``; ``waits`` gets what each rank waits for."""
    if mode == "push":
        for h in eng[p]:
            h.call("submit", f"push-{c}", "write", [(r, b, a, n) for r, a, b, n in reqs], TIMEOUT)
            waits.setdefault(id(h), (h, []))[1].extend(r[0] for r in reqs)
    else:
        for h in eng[c]:
            h.call("submit", f"{p}-{mode}", "read", reqs, TIMEOUT)
    for h in eng[c]:
        waits.setdefault(id(h), (h, []))[1].extend(r[0] for r in reqs)


def _wait_all(waits: dict) -> dict:
    """Wait on every rank for its requests; the failed and still open ones."""
    failed = {}
    for h, ids in waits.values():
        out = h.call("wait", ids, TIMEOUT + 30)
        failed.update(out["failed"])
        failed.update({r: "open" for r in out["open"]})
    return failed


def _check_round(plans, eng, before: dict, batches: dict) -> tuple[int, list[str]]:
    """Every consumer rank's bytes against the round's requests (writes of other pairs are not faults)."""
    checked, problems = 0, []
    for c in ("C1", "C2", "C3"):
        for h, b in zip(eng[c], before[c]):
            after = h.call("dump")
            for p, reqs in batches[c]:
                n, probs = verify(plans[c], h.config.rank, plans[p], b, after, reqs)
                checked += n
                problems += [x for x in probs if "outside the requested blocks" not in x]
    return checked, problems


def resources(eng):
    return {f"{n}.r{h.config.rank}": h.call("resources") for n, hs in eng.items() for h in hs}


def doorbells(eng) -> dict:
    """Per rank: the same-host doorbells open here, the notifications it rang on peers' and took from its own."""
    out = {}
    for n, hs in eng.items():
        for h in hs:
            st = h.call("stats")
            out[f"{n}.r{h.config.rank}"] = {k: st.get(k) for k in ("bells", "bell_rung", "bell_taken")}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--per-pair", type=int, default=20, help="requests per (consumer, producer, mode) per round")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    t0 = time.time()
    plans, procs, eng = start()
    try:
        done, failed, checked, problems = run_round(plans, eng, "warm", 1, True)
        res0 = resources(eng)
        t1 = time.time()
        rounds = 0
        while done < args.requests - 24:  # unchecked rounds, then one final checked round
            n, f, c, p = run_round(plans, eng, f"r{rounds}", args.per_pair, False)
            done, rounds = done + n, rounds + 1
            failed.update(f)
            problems += p
            if rounds % 5 == 0:
                print(f"  {done} requests, {len(failed)} failed, {time.time() - t1:.0f} s", flush=True)
        n, f, c, p = run_round(plans, eng, "last", 1, True)
        done, checked = done + n, checked + c
        failed.update(f)
        problems += p
        res1 = resources(eng)
        seconds = time.time() - t1
        bells = doorbells(eng)
    finally:
        stop_engines([h for hs in eng.values() for h in hs])
    result = {"requests": done, "failed": len(failed), "mismatches": len(problems), "bytes_checked": checked,
              "seconds": round(seconds, 1), "start": res0, "end": res1, "doorbells": bells,
              "total_s": round(time.time() - t0, 1),
              "command": " ".join(["benchmarks/checks/soak_sessions.py"] + (argv or sys.argv[1:]))}
    print(f"{done} requests in {seconds:.1f} s over 2x3 engines, {len(failed)} failed, {len(problems)} "
          f"mismatches, {checked:,} bytes checked (first and last rounds)")
    print(f"{'process':10} {'fds':>9} {'threads':>9} {'RSS MiB':>15} {'NIXL handles':>13} {'sessions':>9}")
    for k in res0:
        a, b = res0[k], res1[k]
        print(f"{k:10} {a['fds']:>4}->{b['fds']:<4} {a['threads']:>4}->{b['threads']:<4} "
              f"{a['rss_kib'] / 1024:>7.1f}->{b['rss_kib'] / 1024:<7.1f} {a['nixl_handles']:>6}->{b['nixl_handles']:<6}"
              f" {a['sessions']:>4}->{b['sessions']:<4}")
    rung, taken = (sum(v[k] or 0 for v in bells.values()) for k in ("bell_rung", "bell_taken"))
    print(f"same-host doorbells: {sum(v['bells'] or 0 for v in bells.values())} open, {rung:,} notifications "
          f"rung, {taken:,} taken")
    for f in list(failed.items())[:5]:
        print("  failed:", f)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if not failed and not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())
