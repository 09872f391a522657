"""Faults: kill -9 and SIGSTOP of each side in each mode, counting bytes that land in reused blocks.

For every (fault, side, mode): a fresh producer process and consumer process (tiny dense TP1 layouts,
real NIXL/UCX agents on loopback), a burst of requests with a short timeout, the fault injected while
they are in flight (SIGSTOP: the process is continued after ``--stop`` seconds). Once every request is
reported terminal (finished or failed), its blocks count as *reused*: the consumer's memory is
snapshotted, the script waits ``--settle`` seconds (and the stopped peer has run again), and every byte
that changed since the snapshot is a byte that landed in a reused block. The contract says: zero.
Requests reported *held* (failed, but bytes could still land) are not reused until they are terminal.
A killed consumer has no memory left to count (reported as n/a).

    PYTHONPATH=. python3 benchmarks/checks/faults.py [--out faults.json]
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvlc import compile_spec  # noqa: E402
from kvlc.demo.procs import EngineConfig, EngineProcess, RemoteError  # noqa: E402

LAYOUT = ROOT / "tests" / "runtime" / "layouts" / "big-tp1.yaml"  # 64 blocks of 1 MiB: requests take a while
MODES = ("direct", "prepped", "pull_via_push", "push")


def one(plan, fault: str, side: str, mode: str, count: int, timeout: float, stop_s: float, settle: float):
    pp, cp = EngineProcess(), EngineProcess()
    prod = pp.add(EngineConfig(plan.to_json(), 0, fill="random", seed=1, engine_id="fault-p", timeout=timeout))
    cons = cp.add(EngineConfig(plan.to_json(), 0, fill="random", seed=2, engine_id="fault-c", timeout=timeout))
    victim = pp if side == "producer" else cp
    reqs = [(f"{mode}-{i}", {"full": [(4 * i + k) % 64 for k in range(4)]},
             {"full": [(7 * i + k) % 64 for k in range(4)]}, 64) for i in range(count)]
    ids = [r[0] for r in reqs]
    row = {"fault": fault, "side": side, "mode": mode, "requests": count}
    try:
        sent = _submit(pp, cp, prod, cons, mode, reqs, timeout)
        time.sleep(0.05)
        _inflict(victim, fault, stop_s)
        if sent.process.is_alive():
            try:
                sent._recv(60)  # the submit's answer
            except (RemoteError, TimeoutError, EOFError):
                pass
        if fault == "kill9" and side == "consumer":
            row.update(finished="n/a", failed="n/a", held_seen="n/a", late_bytes="n/a (consumer memory gone)")
            return row
        row.update(_consumer_outcome(cons, ids, timeout, settle))
        return row
    finally:
        for p in (pp, cp):
            try:
                p.signal(signal.SIGCONT)
            except (OSError, ProcessLookupError):
                pass
            p.stop(10)


def _submit(pp, cp, prod, cons, mode: str, reqs: list, timeout: float):
    """Connect and send the submit of every request without waiting for its answer; the process sent to."""
    if mode == "push":
        prod.connect([cons.address], "WRITE", "direct", "x")
        for r in (r[0] for r in reqs):
            cons.call("expect", r, timeout)
        pp._send("submit", prod.aid, "x", "write", [(r, b, a, n) for r, a, b, n in reqs], timeout)
        return pp
    cons.connect([prod.address], "READ", mode, "x")
    cp._send("submit", cons.aid, "x", "read", reqs, timeout)
    return cp


def _inflict(victim, fault: str, stop_s: float) -> None:
    """kill -9 the victim, or stop it for ``stop_s`` seconds and let it go on."""
    if fault == "kill9":
        victim.kill()
    else:
        victim.signal(signal.SIGSTOP)
        time.sleep(stop_s)
        victim.signal(signal.SIGCONT)


def _consumer_outcome(cons, ids: list, timeout: float, settle: float) -> dict:
    """How the consumer's requests ended, and the bytes that still changed after ``settle`` seconds."""
    out = cons.call("wait", ids, 3 * timeout + 30)
    snap = cons.call("dump")
    time.sleep(settle)
    again = cons.call("dump")
    late = int(sum(int(np.count_nonzero(snap[k] != again[k])) for k in snap))
    ev = cons.call("events")
    return dict(finished=len(out["finished"]), failed=len(out["failed"]), open=len(out["open"]),
                held_seen=len(out["ever_held"]), late_bytes=late, flips=len(ev["flips"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--timeout", type=float, default=1.0, help="each request's timeout (s)")
    ap.add_argument("--stop", type=float, default=2.5, help="how long a SIGSTOPped process stays stopped (s)")
    ap.add_argument("--settle", type=float, default=2.0)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    plan = compile_spec(LAYOUT)
    rows = []
    print(f"{'fault':6} {'side':9} {'mode':14} {'finished':>8} {'failed':>7} {'held seen':>9} {'late bytes':>11}")
    for fault in ("sigstop", "kill9"):
        for side in ("producer", "consumer"):
            for mode in MODES:
                r = one(plan, fault, side, mode, args.requests, args.timeout, args.stop, args.settle)
                rows.append(r)
                print(f"{fault:6} {side:9} {mode:14} {r['finished']!s:>8} {r['failed']!s:>7} "
                      f"{r['held_seen']!s:>9} {r['late_bytes']!s:>11}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    print("late bytes in reused blocks:", sum(r["late_bytes"] for r in rows if isinstance(r["late_bytes"], int)))
    return 1 if _bad(rows) else 0


def _bad(rows: list[dict]) -> list[dict]:
    """Rows where bytes landed late, a request stayed open, or a finished request had failed before."""
    bad = [r for r in rows if isinstance(r["late_bytes"], int) and r["late_bytes"]]
    return bad + [r for r in rows if r.get("open") or r.get("flips")]


if __name__ == "__main__":
    raise SystemExit(main())
