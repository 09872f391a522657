"""Bare NIXL, no kvlc: does a ``done`` sent by a second agent pair keep the next WRITE from waiting?

A NIXL WRITE over UCX ends with a flush of its endpoint, and on this VM that flush waits until the consumer's
worker took the notification sent on the same endpoint before it (``bench_overhead.py --flush-probe``). A
runtime that tells every request's end (kvlc must) then makes each next WRITE wait for the consumer's polling.
This probe measures one request at a time, three ways, each in blocks of ``--requests`` alternated
``--blocks`` times:

* ``raw``: the WRITE of ``--rows`` rows (create, post, spin on the state, release), no notification;
* ``same``: the same, then a notification from the agent that wrote, to the agent it wrote to;
* ``apart``: the same, then a notification from a second agent of the producer to a second agent of the
  consumer (its own UCX worker and endpoints: nothing the data endpoint's flush waits for).

The consumer (a child process) fetches both its agents' notifications every ``--every`` seconds (``spin``:
without a pause), as an engine's polling loop would. p50 / p99 µs per kind, JSON under benchmarks/results.

    python3 benchmarks/probes/notif_agent.py --every spin,0.0002,0.001 --out notif-agent
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import write_results  # noqa: E402

KINDS = ("raw", "same", "apart")
ROW = 8192


def _consumer(conn, every: str, rows: int) -> None:  # pragma: no cover - runs in the child process
    import numpy as np
    from kvlc.runtime.nixl.core import Agent

    data, note = Agent(f"probe-data-c-{os.getpid()}"), Agent(f"probe-note-c-{os.getpid()}")
    buf = np.zeros(rows * ROW, dtype=np.uint8)
    data.register(np.array([[buf.ctypes.data, buf.nbytes, 0]], dtype=np.uint64), "DRAM")
    conn.send((data.metadata(), note.metadata(), buf.ctypes.data))
    a_md, n_md = conn.recv()
    data.add_remote(a_md)
    note.add_remote(n_md)
    pause = 0.0 if every == "spin" else float(every)
    got = 0
    while True:
        msgs = [m for a in (data, note) for v in a.notifs().values() for m in v]
        got += len(msgs)
        if any(m == b"stop" for m in msgs):
            break
        if pause:
            time.sleep(pause)
    conn.send(got)
    conn.recv()
    data.close()
    note.close()


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def run_every(every: str, args) -> dict:
    import numpy as np
    from kvlc.runtime.nixl.core import Agent, XferState

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_consumer, args=(there, every, args.rows), daemon=True)
    child.start()
    data, note = Agent(f"probe-data-p-{os.getpid()}"), Agent(f"probe-note-p-{os.getpid()}")
    buf = np.ones(args.rows * ROW, dtype=np.uint8)
    data.register(np.array([[buf.ctypes.data, buf.nbytes, 0]], dtype=np.uint64), "DRAM")
    d_md, n_md, base = here.recv()
    c_data, c_note = data.add_remote(d_md), note.add_remote(n_md)
    here.send((data.metadata(), note.metadata()))
    offs = np.arange(args.rows, dtype=np.uint64) * ROW
    local = np.stack([buf.ctypes.data + offs, np.full(args.rows, ROW, np.uint64), np.zeros(args.rows, np.uint64)], 1)
    remote = local.copy()
    remote[:, 0] = base + offs
    msg = b'{"v":1,"req":"probe-000000","rank":0,"status":"done","tag":"' + b"0" * 32 + b'"}'
    time.sleep(0.5)

    def one(kind: str) -> float:
        t0 = time.perf_counter()
        x = data.initialize("WRITE", local, "DRAM", remote, "DRAM", c_data)
        state = data.post(x)
        while state is XferState.PROC:
            state = data.state(x)
        x.release()
        if kind == "same":
            data.send_notif(c_data, msg)
        elif kind == "apart":
            note.send_notif(c_note, msg)
        return time.perf_counter() - t0

    for kind in KINDS:  # warm every path up
        for _ in range(20):
            one(kind)
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for b in range(args.blocks):
        for kind in KINDS[b % 3:] + KINDS[:b % 3]:
            times[kind] += [one(kind) for _ in range(args.requests)]
    data.send_notif(c_data, b"stop")
    got = here.recv()
    here.send("ok")
    child.join(10)
    data.close()
    note.close()
    row = {"consumer_fetches_every": every, "rows": args.rows, "row_bytes": ROW, "notifications_taken": got}
    for k, t in times.items():
        row[k] = {"p50_us": _pct(t, 0.5) * 1e6, "p99_us": _pct(t, 0.99) * 1e6, "mean_us": statistics.fmean(t) * 1e6}
    print(f"consumer fetching every {every}: p50 / p99 us " + ", ".join(
        f"{k} {row[k]['p50_us']:.1f} / {row[k]['p99_us']:.1f}" for k in KINDS), flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--every", default="spin,0.0002,0.001", help="the consumer's seconds between fetches")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--requests", type=int, default=200, help="requests of one kind in a block")
    ap.add_argument("--blocks", type=int, default=6, help="blocks in all, the kinds taken in turn")
    ap.add_argument("--out", default="notif-agent", help="result name under benchmarks/results (no .json)")
    args = ap.parse_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    rows = [run_every(e, args) for e in args.every.split(",")]
    doc = {"cases": rows, "requests": args.requests, "blocks": args.blocks, "load_end": os.getloadavg()[0]}
    print(f"wrote {write_results(args.out, doc)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
