"""kvlc's own per-request Python on the direct path, without NIXL: checks, descriptors, notification.

Times, for a program of ``--layout`` paired with itself (``--direction``, default WRITE: a push),
``--tokens`` per request and block ids given as Python lists (as engines give them), contiguous
(one descriptor per region) and random (a fragmented pool):

  * ``check``: :meth:`TransferProgram.check_request` (types, counts, bounds, duplicates);
  * ``emit``: :meth:`BoundProgram.emit` of the checked request (descriptor rows, coalesced);
  * ``instantiate``: both, as :meth:`BoundProgram.instantiate` (what ``Peer.write`` calls);
  * ``notif``: one ``done`` notification (tag + bytes), as the executor sends per request.

``--against REF`` also runs the same measurement on git revision ``REF`` of this repository (exported
to a temporary folder, run in a subprocess with that tree first on ``sys.path``), rounds alternated,
so before / after medians come from one run under one machine load.

Run:  python3 benchmarks/probes/bench_request.py [--tokens 256] [--repeat 2000] [--against main --rounds 5]
Each number is the fastest of 5 batches; with --against, the fastest and the median of those over the rounds
(one process runs at up to twice the speed of the next on a shared machine: use many rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from kvlc import bind, check_request, instantiate
from kvlc.compiler.request.instantiate import emit

ROOT = Path(__file__).resolve().parents[2]


def _ids(plan, tokens: int, kind: str, seed: int = 0) -> dict[str, list[int]]:
    import numpy as np
    rng = np.random.default_rng(seed)
    out = {}
    for g in plan.groups:
        need = -(-tokens // g.block_size)
        cap = plan.group_capacity(g.name)
        out[g.name] = list(range(need)) if kind == "contiguous" else rng.choice(cap, need, replace=False).tolist()
    return out


def _per_call(fn, repeat: int) -> float:
    """Fastest of 5 batches of ``repeat`` calls, seconds per call (the shared machine's noise only adds)."""
    fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        times.append((time.perf_counter() - t0) / repeat)
    return min(times)


def measure(layout: str, tokens: int, direction: str, repeat: int) -> dict[str, float]:
    """Microseconds per call of each step, contiguous and random ids (this process's kvlc)."""
    import kvlc
    from kvlc import compile_spec
    from kvlc.compiler.pairing.pair import pair
    from kvlc.runtime.transfer import Target

    plan = compile_spec(str(ROOT / "layouts" / layout))
    prog = pair(plan, plan, local_rank=0, direction=direction)
    bound = bind(prog, {s.name: (1 + i) << 40 for i, s in enumerate(plan.storages)},
                      {0: {s.name: (9 + i) << 40 for i, s in enumerate(plan.storages)}})
    target = Target("consumer-agent", b"k" * 32)
    out = {}
    for kind in ("contiguous", "random"):
        lids, rids = _ids(plan, tokens, kind, 1), _ids(plan, tokens, kind, 2)
        req = check_request(prog, lids, rids, tokens)
        steps = {"check": lambda: check_request(prog, lids, rids, tokens),
                 "emit": lambda: emit(bound, req),
                 "instantiate": lambda: instantiate(bound, lids, rids, tokens)}
        for step, fn in steps.items():
            out[f"{kind} {step}"] = _per_call(fn, repeat) * 1e6
    out["notif"] = _per_call(lambda: target.notif("req-123456", 0, "done"), repeat) * 1e6
    print(f"kvlc from {Path(kvlc.__file__).parent}", file=sys.stderr)
    return out


def _export(ref: str, into: Path) -> Path:
    tree = into / "tree"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "kvlc", "layouts"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def _child(tree: Path, args) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--json", "--tokens", str(args.tokens),
           "--repeat", str(args.repeat), "--layout", args.layout, "--direction", args.direction]
    got = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, cwd=str(tree)).stdout
    return json.loads(got.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", default="llama-3.1-8b.yaml")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--direction", default="WRITE")
    ap.add_argument("--repeat", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds with --against")
    ap.add_argument("--against", default="", help="git revision to measure too, in the same run")
    ap.add_argument("--json", action="store_true", help="print one JSON line (used by --against)")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.getcwd() if args.json else str(ROOT))  # this tree's kvlc, not the installed one
    if args.json:
        print(json.dumps(measure(args.layout, args.tokens, args.direction, args.repeat)))
        return 0
    load0 = os.getloadavg()[0]
    if not args.against:
        for k, v in measure(args.layout, args.tokens, args.direction, args.repeat).items():
            print(f"{k:24s} {v:8.1f} us")
        print(f"load {load0:.2f} -> {os.getloadavg()[0]:.2f}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        old = _export(args.against, Path(tmp))
        runs: dict[str, list[dict]] = {"old": [], "new": []}
        for _ in range(args.rounds):
            runs["old"].append(_child(old, args))
            runs["new"].append(_child(ROOT, args))
    print(f"{'us per call (min | median)':28s} {args.against:>15s} {'worktree':>15s}")
    for k in runs["new"][0]:
        (o, om), (n, nm) = ((min(r[k] for r in runs[w]), statistics.median(r[k] for r in runs[w]))
                            for w in ("old", "new"))
        print(f"{k:28s} {o:6.1f} | {om:6.1f}  {n:6.1f} | {nm:6.1f}  ({n / o:.2f}x | {nm / om:.2f}x)")
    print(f"load {load0:.2f} -> {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
