"""kvlc's own host work on the same-host block path, per request, with the GPU calls stubbed out (on a CPU).

For Llama-3.1-8B (same layout, push), requests of random block ids of ``--tokens`` (default 1024, 1023: a
prompt's, last block partial, and 4096): the time per request of ``emit(..., blocks=True)`` (the check is
done before the clock), and of that plus what the executor and the same-host route do for its one part
(``Executor._one``: the route's block launch; ``post``: the ids into the pinned
ring, the kernel's launch; ``state``; ``release``), with torch.cuda's streams and events and the kernel
replaced by objects that do nothing. What is left is Python and numpy: the part of a request's host time
that a CPU can measure and that a GPU host pays as well (faster there; benchmarks/README.md, runs 7-9 for
the stages on a GPU).

Run:  python3 benchmarks/probes/ipc_host_path.py [--tokens 1024,1023,4096] [--requests 2000]
"""

from __future__ import annotations

import argparse
import sys
import time
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import LAYOUTS  # noqa: E402
from testkit.gpu_standin import TorchStandIn  # noqa: E402

import kvlc  # noqa: E402
from kvlc import bind  # noqa: E402
from kvlc.compiler.pairing.pair import pair  # noqa: E402
from kvlc.compiler.request.check import check_request  # noqa: E402
from kvlc.compiler.request.instantiate import emit  # noqa: E402

LOCAL, REMOTE, MAPPED = 1 << 40, 2 << 40, 7 << 40


class _Launch:
    def __getitem__(self, grid):
        return lambda *args, **kw: None


class _Kernel:
    copy_rows = copy_blocks = _Launch()


def _route(plan):
    from kvlc.runtime.ipc.copy import GpuCopy
    from kvlc.runtime.ipc.memory import Mapped, Window
    from kvlc.runtime.ipc.route import IpcRoute, _Windows

    storages = {s.name: types.SimpleNamespace(device=0, mem="VRAM", addr=LOCAL, nbytes=s.size) for s in plan.storages}
    route = IpcRoute(None, storages)
    route._gpu_copy = GpuCopy(0, torch=TorchStandIn(), kernel=_Kernel())  # (no warm-up: nothing runs)
    route.peers["peer"] = _Windows(Mapped("peer", [Window(s.name, "VRAM", REMOTE + i * (1 << 36), s.size,
                                                          MAPPED + i * (1 << 36), 0)
                                                   for i, s in enumerate(plan.storages)]))
    return route


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1024,1023,4096")
    ap.add_argument("--requests", type=int, default=2000)
    args = ap.parse_args()
    from kvlc.runtime.transfer import Executor

    plan = kvlc.compile_spec(LAYOUTS / "llama-3.1-8b.yaml")
    prog = pair(plan, plan, local_rank=0, direction="WRITE")
    at = lambda base: {s.name: base + i * (1 << 36) for i, s in enumerate(plan.storages)}  # noqa: E731
    bound = bind(prog, at(LOCAL), {0: at(REMOTE)})
    route = _route(plan)
    ex = Executor(route, 0)
    group, cap = plan.groups[0], plan.regions[0].capacity
    rng = np.random.default_rng(0)

    def one(req) -> None:
        for key, part in emit(bound, req, blocks=True).items():
            run = ex._one("r", "WRITE", key, part, "peer")
            route.post(run.xfer)
            route.state(run.xfer)
            run.xfer.release()

    def per_request(fn, reqs) -> float:
        for r in reqs[:5]:
            fn(r)
        t = time.perf_counter()
        for i in range(args.requests):
            fn(reqs[i % len(reqs)])
        return (time.perf_counter() - t) / args.requests * 1e6

    for tokens in (int(t) for t in args.tokens.split(",")):
        n = -(-tokens // group.block_size)
        reqs = [check_request(prog, {group.name: rng.permutation(cap)[:n].tolist()},
                              {group.name: rng.permutation(cap)[:n].tolist()}, tokens) for _ in range(50)]
        before = route.block_copies
        forms = per_request(lambda r: emit(bound, r, blocks=True), reqs)
        whole = per_request(one, reqs)
        assert route.block_copies > before, "the route did not take the block form"
        print(f"{tokens:5d} tokens: emit(blocks) {forms:6.1f} us; with executor, route and launch (stubbed) "
              f"{whole:6.1f} us per request")


if __name__ == "__main__":
    main()
