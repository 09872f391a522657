"""A request's parts as block forms against its rows, on the CPU: what a same-host GPU copy needs per request.

For checked-in engine pairs (same layout; Llama-3.1-70B TP 8 reading from TP 4, token-major and head-major;
Gemma-3-27B block 32 reading from block 16, sliding windows; DeepSeek-V3 MLA), a 2,048-token and a
2,047-token request (a prompt's: the last block partial, its tokens as entries of the forms' partial-tile slots),
contiguous and random block ids: ``block_copies`` (the forms: their ids) and ``emit`` (the rows, coalesced),
called in turn in each timed round, with their sizes: rows, the forms' row estimate, ids, entries and those of
the partial tiles. The bytes of
both are checked equal once per case (tests/test_blocks.py checks them row for row).

Run:  python3 benchmarks/bench_blocks.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LAYOUTS, timeit, write_results  # noqa: E402

import kvlc  # noqa: E402
from kvlc import bind  # noqa: E402
from kvlc.compiler.pairing.pair import pair  # noqa: E402
from kvlc.compiler.request.blocks import block_copies  # noqa: E402
from kvlc.compiler.request.check import check_request  # noqa: E402
from kvlc.compiler.request.instantiate import emit  # noqa: E402

PAIRS = [  # (name, this side reads, from the peer's)
    ("llama-3.1-8b same layout", "llama-3.1-8b.yaml", "llama-3.1-8b.yaml"),
    ("llama-3.1-70b tp8 <- tp4 (token-major)", "llama-3.1-70b-tp8.yaml", "llama-3.1-70b-tp4.yaml"),
    ("llama-3.1-70b tp8 <- tp4 (head-major)", "llama-3.1-70b-hnd-tp8.yaml", "llama-3.1-70b-hnd-tp4.yaml"),
    ("gemma-3-27b block 32 <- block 16", "gemma-3-27b-tp2-b32.yaml", "gemma-3-27b-tp2-b16.yaml"),
    ("deepseek-v3 mla", "deepseek-v3-tp1.yaml", "deepseek-v3-tp1.yaml"),
]


def _ids(plan: kvlc.Plan, group, tokens: int, kind: str, rng) -> list[int]:
    n = -(-tokens // group.block_size)
    cap = min(r.capacity for r in plan.regions if group.name in r.groups)
    return list(range(n)) if kind == "contiguous" else rng.permutation(cap)[:n].tolist()


def _case(name: str, local: kvlc.Plan, remote: kvlc.Plan, tokens: int, kind: str, repeat: int) -> dict:
    prog = pair(local, remote, local_rank=0, direction="READ")
    bound = bind(prog, {s.name: 1 << 40 for s in local.storages},
                 {p: {s.name: 2 << 40 for s in remote.storages} for p in prog.peer_ranks})
    rng = np.random.default_rng(tokens)
    theirs = {g.name: g for g in remote.groups}
    req = check_request(prog, {g.name: _ids(local, g, tokens, kind, rng) for g in local.groups},
                        {g.name: _ids(remote, theirs[g.name], tokens, kind, rng) for g in local.groups}, tokens)
    rows, forms = emit(bound, req), block_copies(bound, req)
    assert set(forms) == set(rows) and all(f.nbytes == rows[k].nbytes for k, f in forms.items()), name
    t_forms, t_rows = [], []

    def both():  # in turn, in each round
        t_forms.append(timeit(lambda: block_copies(bound, req), repeat=1, warmup=0)["median"])
        t_rows.append(timeit(lambda: emit(bound, req), repeat=1, warmup=0)["median"])
    timeit(both, repeat=repeat, warmup=2)
    med = lambda v: float(np.median(v[2:]))  # noqa: E731  (after the warm-up rounds)
    return {"pair": name, "tokens": tokens, "ids": kind, "forms_us": med(t_forms) * 1e6,
            "rows_us": med(t_rows) * 1e6, "rows": sum(len(p) for p in rows.values()),
            "rows_estimate": sum(f.runs for f in forms.values()), "ids_words": sum(len(f.ids) for f in forms.values()),
            "partial_entries": sum(int(np.count_nonzero(f.table.slot >= len(f.table.blocks)))
                                   for f in forms.values()),
            "entries": sum(f.table.entries for f in forms.values()), "bytes": sum(f.nbytes for f in forms.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds")
    args = ap.parse_args()
    repeat = 5 if args.quick else 30
    out = []
    for name, mine, theirs in PAIRS:
        local, remote = kvlc.compile_spec(LAYOUTS / mine), kvlc.compile_spec(LAYOUTS / theirs)
        for tokens in (2048, 2047):
            for kind in ("contiguous", "random"):
                r = _case(name, local, remote, tokens, kind, repeat)
                out.append(r)
                print(f"{name:40s} {tokens:5d} {kind:10s} forms {r['forms_us']:8.1f} us  rows {r['rows_us']:9.1f} us"
                      f"  rows {r['rows']:7d} (estimate {r['rows_estimate']:7d})  ids {r['ids_words']:5d}"
                      f"  entries {r['entries']:5d} (partial tiles' {r['partial_entries']:5d})")
    print(write_results("blocks", {"cases": out}))


if __name__ == "__main__":
    main()
