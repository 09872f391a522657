"""How long a request stays held when its peer's host is cut off for good (no ceiling of kvlc's own).

Two network namespaces (testkit.netns; root), UCX over TCP: an 8 MiB request (tests/crosshost
layout dense-8m) with a 1 s deadline on a link slowed to 8 Mbit/s, whose link goes down 0.5 s
after it was posted and never comes back. Prints when it was reported held and when it ended.
Measured on the 2-core CPU machine (docs/runtime.md, "How long a request stays held"): ``direct``
held at its deadline, failed 18.8 s after posting (UCX: NIXL_ERR_REMOTE_DISCONNECT);
``pull_via_push`` still held after 200 s (its cancel times out on the side channel).

Run:  PYTHONPATH=. python3 benchmarks/probes/held_ceiling.py direct|prepped|pull_via_push
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # testkit, and this tree's kvlc
sys.path.insert(0, str(ROOT / "tests" / "runtime"))

from runtime_engines import config  # noqa: E402

from kvlc import compile_spec  # noqa: E402
from kvlc.demo.procs import stop_engines  # noqa: E402
from testkit.netns import Network, engine_on  # noqa: E402

LIMIT_S = 200.0


def main(mode: str) -> None:
    plan = compile_spec(ROOT / "tests" / "crosshost" / "layouts" / "dense-8m.yaml")
    with Network(2, subnet=81) as net:
        a, b = net.hosts
        prod = engine_on(a).add(config(plan, 0, "content", host=a.ip, engine_id="hc-p"))
        cons = engine_on(b).add(config(plan, 0, "random", seed=3, host=b.ip, engine_id="hc-c", timeout=1.0))
        try:
            ids = list(range(8, 72))
            req = ("big", {"full": ids}, {"full": ids}, len(ids) * 16)
            net.rate_limit(b, "8mbit")
            cons.connect([prod.address], "READ", mode, "f")
            t0 = time.monotonic()
            assert cons.call("submit", "f", "read", [req], 1.0) == {}
            time.sleep(0.5)
            net.link_down(b)
            while time.monotonic() - t0 < LIMIT_S:
                out = cons.call("wait", ["big"], 1.0)
                ev = cons.call("events")
                if ev["held"] or ev["failed"] or ev["finished"]:
                    print(f"{time.monotonic() - t0:.1f} s: held {ev['held']} failed {ev['failed']}", flush=True)
                if not out["open"]:
                    print(f"{mode}: ended {time.monotonic() - t0:.1f} s after posting", flush=True)
                    return
            print(f"{mode}: still open after {LIMIT_S:.0f} s: {cons.call('resources')}", flush=True)
        finally:
            stop_engines([prod, cons])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "direct")
