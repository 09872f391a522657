"""Compiler: compile time and memory vs num_blocks, and ``Plan.local_descriptors`` vs one numpy pass.

Measured in one run, on one machine:
  * compile time of the largest checked-in layout (most regions among layouts/*.yaml) with every
    region's ``num_blocks`` set to 1k, 10k, 100k and 1M: the compile passes on the validated
    spec, and load + validate + compile from YAML text; tracemalloc peak of one compile and the
    plan's JSON size, to show that nothing grows with the number of blocks (a plan holds
    geometry, never per-block descriptors). Target: < 50 ms at 1M.
  * ``Plan.local_descriptors`` for 128 regions x 100,000 blocks against ONE numpy
    ``np.arange(N, dtype=np.uint64) * stride + base`` over the same element count N, and
    their ratio. Target: within 3x.

Run:  python3 benchmarks/bench_compile.py [--repeat 15] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LAYOUTS, ms, timeit, write_results  # noqa: E402

import kvlc  # noqa: E402
from kvlc.compiler.plan.model import Plan  # noqa: E402
from kvlc.compiler.spec.models import LayoutSpec, Region, RepeatRegions, RepeatStorages, Storage  # noqa: E402

BLOCK_COUNTS = (1_000, 10_000, 100_000, 1_000_000)
COMPILE_TARGET_S = 0.050
DESCRIPTOR_TARGET_RATIO = 3.0


def largest_layout() -> tuple[Path, int]:
    """The checked-in layout with the most regions (ties: the first by name) and its region count."""
    best: tuple[int, str] | None = None
    for path in sorted(LAYOUTS.glob("*.yaml")):
        try:
            n = len(kvlc.compile_spec(path).regions)
        except kvlc.KvlcError:
            continue  # not a layout spec (e.g. a list of pairs)
        if best is None or n > best[0]:
            best = (n, path.name)
    if best is None:
        raise SystemExit("no compilable layout under layouts/")
    return LAYOUTS / best[1], best[0]


def _set_blocks(entries, n: int):
    out = []
    for e in entries:
        if isinstance(e, RepeatRegions):
            out.append(e.model_copy(update={"regions": _set_blocks(e.regions, n)}))
        else:
            out.append(e.model_copy(update={"num_blocks": n}))
    return tuple(out)


def _unsized(entries):
    out = []
    for e in entries:
        if isinstance(e, RepeatStorages):
            out.append(e.model_copy(update={"storages": _unsized(e.storages)}))
        else:
            out.append(e.model_copy(update={"size": None}))
    return tuple(out)


def with_blocks(spec: LayoutSpec, n: int) -> LayoutSpec:
    """``spec`` with every region holding ``n`` blocks; declared storage sizes are dropped so
    that the storages grow with the regions (the compiler then infers them)."""
    new = spec.model_copy(update={"regions": _set_blocks(spec.regions, n),
                                  "storages": _unsized(spec.storages)})
    new._source = spec._source
    return new


def text_with_blocks(text: str, n: int) -> str:
    """The YAML text of ``with_blocks``: same edits made on the plain data, dumped again."""
    def edit(entries, key):
        for e in entries:
            if "repeat" in e:
                edit(e[key], key)
            elif key == "regions":
                e["num_blocks"] = n
            else:
                e.pop("size", None)
    data = yaml.safe_load(text)
    edit(data["regions"], "regions")
    edit(data["storages"], "storages")
    return yaml.safe_dump(data, sort_keys=False)


def bench_compile(path: Path, repeat: int, counts) -> list[dict]:
    spec = kvlc.load_spec(path)
    text = path.read_text()
    rows = []
    for n in counts:
        big = with_blocks(spec, n)
        plan = kvlc.compile_spec(big)
        assert all(r.num_blocks == n for r in plan.regions)
        passes = timeit(lambda: kvlc.compile_spec(big), repeat=repeat)
        big_text = text_with_blocks(text, n)
        same = kvlc.compile_spec(big_text)
        full = timeit(lambda: kvlc.compile_spec(big_text), repeat=repeat)
        tracemalloc.start()
        kvlc.compile_spec(big)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rows.append({"num_blocks": n, "regions": len(plan.regions), "compile_s": passes,
                     "load_and_compile_s": full, "tracemalloc_peak_bytes": peak,
                     "plan_json_bytes": len(plan.to_json()),
                     "text_and_model_agree": same.to_json() == plan.to_json()})
    return rows


def descriptor_plan(plan: Plan, regions: int, blocks: int) -> Plan:
    """``regions`` regions of ``blocks`` blocks each, cycled from ``plan``'s regions (renamed)."""
    src = plan.regions
    out = [src[i % len(src)].model_copy(update={"name": f"{src[i % len(src)].name}#{i}",
                                                "num_blocks": blocks}) for i in range(regions)]
    return plan.model_copy(update={"regions": tuple(out)})


def bench_descriptors(plan: Plan, regions: int, blocks: int, repeat: int) -> dict:
    big = descriptor_plan(plan, regions, blocks)
    bases = {s.name: 0x7F00_0000_0000 + i * (1 << 36) for i, s in enumerate(big.storages)}
    n = regions * blocks
    stride = np.uint64(big.regions[0].block_stride)
    base = np.uint64(bases[big.regions[0].storage])

    def reference():
        return np.arange(n, dtype=np.uint64) * stride + base

    desc = big.local_descriptors(bases)
    assert desc.shape == (n, 3) and desc.dtype == np.uint64
    r0 = big.regions[0]
    assert int(desc[1, 0]) == bases[r0.storage] + r0.offset + r0.block_stride
    # Interleave the two measurements so that both see the same machine state.
    kvlc_t, ref_t = [], []
    for _ in range(repeat):
        kvlc_t.append(timeit(lambda: big.local_descriptors(bases), repeat=1, warmup=0)["median"])
        ref_t.append(timeit(reference, repeat=1, warmup=0)["median"])
    kvlc_t.sort()
    ref_t.sort()
    k, r = kvlc_t[len(kvlc_t) // 2], ref_t[len(ref_t) // 2]
    return {"regions": regions, "blocks_per_region": blocks, "rows": n,
            "local_descriptors_s": {"median": k, "min": kvlc_t[0], "max": kvlc_t[-1], "runs": repeat},
            "numpy_arange_mul_add_s": {"median": r, "min": ref_t[0], "max": ref_t[-1], "runs": repeat},
            "ratio": k / r, "target_ratio": DESCRIPTOR_TARGET_RATIO,
            "output_bytes": n * 3 * 8, "reference_output_bytes": n * 8}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=15, help="timed runs per measurement (median reported)")
    ap.add_argument("--quick", action="store_true", help="fewer runs and smaller descriptor plan (smoke test)")
    ap.add_argument("--layout", type=Path, help="compile this layout instead of the largest checked-in one")
    args = ap.parse_args(argv)
    repeat = 3 if args.quick else args.repeat

    if args.layout:
        path, nregions = args.layout, len(kvlc.compile_spec(args.layout).regions)
    else:
        path, nregions = largest_layout()
    print(f"layout: {path.name} ({nregions} regions), median of {repeat} runs")
    rows = bench_compile(path, repeat, BLOCK_COUNTS)
    print(f"{'num_blocks':>10} {'compile':>12} {'load+compile':>14} {'tracemalloc peak':>17} {'plan json':>10}")
    for row in rows:
        print(f"{row['num_blocks']:>10,} {ms(row['compile_s']['median']):>12} "
              f"{ms(row['load_and_compile_s']['median']):>14} "
              f"{row['tracemalloc_peak_bytes'] / 1024:>13.0f} KiB {row['plan_json_bytes']:>10,}")
    at_1m = rows[-1]["compile_s"]["median"]
    print(f"compile at {rows[-1]['num_blocks']:,} blocks/region: {ms(at_1m)} "
          f"(target < {ms(COMPILE_TARGET_S)}: {'met' if at_1m < COMPILE_TARGET_S else 'MISSED'})")

    regions, blocks = (16, 10_000) if args.quick else (128, 100_000)
    d = bench_descriptors(kvlc.compile_spec(path), regions, blocks, repeat)
    print(f"\nlocal_descriptors: {regions} regions x {blocks:,} blocks = {d['rows']:,} rows (N x 3 uint64)")
    print(f"{'Plan.local_descriptors':>32} {ms(d['local_descriptors_s']['median']):>12}")
    print(f"{'np.arange(N)*stride+base':>32} {ms(d['numpy_arange_mul_add_s']['median']):>12}")
    print(f"{'ratio':>32} {d['ratio']:>10.2f}x (target <= {DESCRIPTOR_TARGET_RATIO:.0f}x: "
          f"{'met' if d['ratio'] <= DESCRIPTOR_TARGET_RATIO else 'MISSED'})")

    out = write_results("compile", {
        "layout": path.name, "layout_regions": nregions, "repeat": repeat, "quick": args.quick,
        "compile": rows, "compile_target_s": COMPILE_TARGET_S,
        "compile_target_met": at_1m < COMPILE_TARGET_S,
        "local_descriptors": d, "descriptor_target_met": d["ratio"] <= DESCRIPTOR_TARGET_RATIO,
    })
    print(f"\nwrote {out.relative_to(out.parents[2])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
