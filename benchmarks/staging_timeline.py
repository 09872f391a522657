"""Where staged chunks spend their time: read ``KVLC_STAGING_TRACE`` files, print each step's duration.

Run a staged transfer with ``KVLC_STAGING_TRACE=<folder>`` set in every engine process (see
kvlc/runtime/staging/trace.py), then::

    python3 benchmarks/staging_timeline.py <folder> [--json out.json]

Each chunk's steps, in order: queued -> gather -> gathered -> posted -> written (sender) ->
landed -> ranges -> scatter -> scattered (receiver) -> freed (sender). The table gives, per
transition, how many chunks made it and the median / 90th percentile / largest time between
the two steps (one monotonic clock for every process of the machine); ``scattered -> freed`` is
the notification's trip back. On a GPU two more rows give the gather's and the scatter's own time
on the GPU (between CUDA timing events around each), to tell a slow copy from one that waited.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

STEPS = ("queued", "gather", "gathered", "posted", "written", "landed", "ranges", "scatter", "scattered", "freed")


RECEIVER = {"landed", "ranges", "scatter", "scattered", "scatter_gpu"}  # steps the receiving endpoint records
GPU_TIMES = ("gather_gpu", "scatter_gpu")  # their value: the copy's time on the GPU, µs


def load(folder: Path) -> dict[tuple[str, int, str], dict[str, int]]:
    """(request, chunk, sending agent) -> step -> time in ns (the first time each step was seen).

    A sender's rows name itself as ``agent``, a receiver's name the sender as ``peer``, so one chunk's
    rows meet under one key even with several TP ranks (and endpoints) in one process."""
    chunks: dict[tuple[str, int, str], dict[str, int]] = defaultdict(dict)
    for path in sorted(folder.glob("staging-*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if "step" in row:
                sender = row.get("peer", "") if row["step"] in RECEIVER else row.get("agent", "")
                value = row.get("value", 0.0) if row["step"] in GPU_TIMES else row["t_ns"]
                chunks[(row["req"], row["seq"], sender)].setdefault(row["step"], value)
    return chunks


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


def summarize(chunks: dict[tuple[str, int, str], dict[str, int]]) -> dict:
    rows = []
    for a, b in zip(STEPS, STEPS[1:]):
        d = [(c[b] - c[a]) / 1e3 for c in chunks.values() if a in c and b in c]
        if d:
            rows.append({"from": a, "to": b, "chunks": len(d), "median_us": _pct(d, 0.5),
                         "p90_us": _pct(d, 0.9), "max_us": max(d)})
    for step in GPU_TIMES:
        d = [c[step] for c in chunks.values() if step in c]
        if d:
            rows.append({"from": step, "to": "(on the GPU)", "chunks": len(d), "median_us": _pct(d, 0.5),
                         "p90_us": _pct(d, 0.9), "max_us": max(d)})
    whole = [(c["freed"] - c["queued"]) / 1e3 for c in chunks.values() if "queued" in c and "freed" in c]
    per_req: dict[tuple[str, str], list[int]] = defaultdict(list)
    for (req, _, sender), c in chunks.items():
        per_req[(req, sender)] += [t for k, t in c.items() if k not in GPU_TIMES]
    spans = [(max(t) - min(t)) / 1e3 for t in per_req.values()]
    return {"chunks": len(chunks), "requests": len(per_req), "steps": rows,
            "chunk_life_median_us": _pct(whole, 0.5) if whole else None,
            "request_span_median_us": _pct(spans, 0.5) if spans else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    chunks = load(args.folder)
    if not chunks:
        print(f"no staging-*.jsonl rows under {args.folder}", file=sys.stderr)
        return 1
    s = summarize(chunks)
    print(f"{s['chunks']} chunks of {s['requests']} requests; chunk life (queued -> freed) median "
          f"{s['chunk_life_median_us']} us; request span median {s['request_span_median_us']} us")
    print(f"{'step':>22} {'chunks':>7} {'median us':>10} {'p90 us':>10} {'max us':>10}")
    for r in s["steps"]:
        print(f"{r['from'] + ' -> ' + r['to']:>22} {r['chunks']:7d} {r['median_us']:10.1f} {r['p90_us']:10.1f} "
              f"{r['max_us']:10.1f}")
    if args.json:
        args.json.write_text(json.dumps(s, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
