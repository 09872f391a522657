"""Where the time of one fragmented loopback request goes, on the initiator's CPU.

For the Llama-3.1-8B 2k-token request of ``bench_transfer.py`` (32 regions, pool shrunk to one
request, producer ids a random permutation: about 4,000 descriptors of 64 KiB), measured in
one process with two NIXL UCX agents over registered DRAM:

  * kvlc ``BoundProgram.instantiate`` (descriptor rows of both sides),
  * NIXL ``get_xfer_descs`` + ``initialize_xfer`` for those rows (what the runtime calls),
  * the same two for ONE descriptor of the same bytes,

so that the per-descriptor cost seen in ``bench_transfer.py`` (time of a random-id request
minus a contiguous one, divided by the extra descriptors) can be split into what kvlc and NIXL
spend before the transfer starts and what UCX spends moving the pieces. The move itself is
measured between two processes by ``bench_transfer.py`` (``nixl_sweep``); ``strace -c -f``
on that sweep shows one ``process_vm_readv`` system call per descriptor (UCX's cma transport).

Run:  python3 benchmarks/probes/profile_request.py [--tokens 2048] [--repeat 31]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, the suite
sys.path.insert(0, str(Path(__file__).resolve().parent))  # probes/
from bench_transfer import fitted_spec  # noqa: E402
from common import LAYOUTS, ms, timeit, write_results  # noqa: E402

from kvlc.compiler.pairing.pair import pair  # noqa: E402
from kvlc.demo.run import cpu_plan, make_workload  # noqa: E402
from kvlc import bind, instantiate


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--layout", default="llama-3.1-8b.yaml")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=31)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

    with tempfile.TemporaryDirectory() as tmp:
        plan = cpu_plan(fitted_spec(LAYOUTS / args.layout, args.tokens, Path(tmp)), max_bytes=1 << 62)
    prog = pair(plan, plan, local_rank=0, direction="READ")
    pair_ = _Loopback(sum(s.size for s in plan.storages))
    bound = bind(prog, _bases(plan, pair_.bufs[0]), {0: _bases(plan, pair_.bufs[1])})
    rows = []
    for ids in ("random", "contiguous"):
        row = _profile(pair_, bound, plan, ids, args.tokens, args.repeat)
        rows.append(row)
        _print_row(row)
    pair_.agents[0].remove_remote_agent(pair_.peer)
    if not args.no_write:
        print(f"wrote {write_results('profile_request', {'layout': args.layout, 'tokens': args.tokens, 'rows': rows})}")
    return 0


class _Loopback:
    """Two NIXL UCX agents in this process, each with a registered DRAM buffer of ``size`` bytes."""

    def __init__(self, size: int):
        from nixl._api import nixl_agent, nixl_agent_config

        self.bufs = [np.zeros(size, dtype=np.uint8) for _ in range(2)]
        for b in self.bufs:
            b[:] = 1  # fault the pages in
        self.agents = [nixl_agent(f"profile-{i}", nixl_agent_config(backends=["UCX"])) for i in range(2)]
        for a, b in zip(self.agents, self.bufs):
            a.register_memory(np.array([[b.ctypes.data, b.nbytes, 0]], dtype=np.uint64), "DRAM")
        self.peer = self.agents[0].add_remote_agent(self.agents[1].get_agent_metadata())

    def create(self, local: np.ndarray, remote: np.ndarray) -> None:
        """Describe both lists and create (then release) one READ of them: what the runtime does first."""
        a = self.agents[0]
        h = a.initialize_xfer("READ", a.get_xfer_descs(local, "DRAM"), a.get_xfer_descs(remote, "DRAM"),
                              self.peer, b"")
        a.release_xfer_handle(h)


def _bases(plan, buf: np.ndarray) -> dict:
    """The plan's storages back to back in ``buf``."""
    out, at = {}, buf.ctypes.data
    for s in plan.storages:
        out[s.name] = (at, 0)
        at += s.size
    return out


def _profile(pair_: _Loopback, bound, plan, ids: str, tokens: int, repeat: int) -> dict:
    """One request (``ids``: random or contiguous producer ids): instantiate and NIXL create times."""
    work = make_workload(plan, plan, 1, tokens, seed=1)[0][0]
    _, cids, pids, tokens = work
    if ids == "contiguous":  # storages lie back to back here: the whole request is one run
        pids = {g: sorted(v) for g, v in pids.items()}
    req = (cids, pids, tokens)
    parts = instantiate(bound, *req)
    (part,) = parts.values()
    n, nbytes = len(part), part.nbytes
    one_l = np.array([[pair_.bufs[0].ctypes.data, nbytes, 0]], dtype=np.uint64)
    one_r = np.array([[pair_.bufs[1].ctypes.data, nbytes, 0]], dtype=np.uint64)
    t_inst = timeit(lambda q=req: instantiate(bound, *q), repeat=repeat)
    t_create = timeit(lambda p=part: pair_.create(p.local, p.remote), repeat=repeat)
    t_one = timeit(lambda a=one_l, b=one_r: pair_.create(a, b), repeat=repeat)
    return {"ids": ids, "descriptors": n, "bytes": nbytes, "instantiate_s": t_inst["median"],
            "nixl_create_s": t_create["median"], "nixl_create_one_s": t_one["median"],
            "cpu_us_per_descriptor": (t_inst["median"] + t_create["median"] - t_one["median"]) / (n - 1) * 1e6
            if n > 1 else None}


def _print_row(row: dict) -> None:
    n, nbytes = row["descriptors"], row["bytes"]
    print(f"{row['ids']:10s} {n:6,d} descriptors ({nbytes / 2**20:.0f} MiB): instantiate {ms(row['instantiate_s'])}, "
          f"NIXL descs+create {ms(row['nixl_create_s'])} (one descriptor: {ms(row['nixl_create_one_s'])})"
          + (f" -> {row['cpu_us_per_descriptor']:.3f} us of initiator CPU per extra descriptor before the "
             "transfer" if n > 1 else ""))


if __name__ == "__main__":
    sys.exit(main())
