"""Benchmark report: run the benchmark scripts, then summarize and plot what they recorded.

Entry point: ``python3 benchmarks/run.py``. This module
runs the selected scripts as subprocesses (rich progress; each script's output goes to
``<out>/<name>.log``), each writing ``<out>/<name>.json``; then it loads every result file,
prints one table per benchmark with its targets and whether they are met, and draws PNG
plots next to the JSON files. ``<out>`` is a fresh folder ``benchmarks/runs/<time>/`` unless
given; the recorded results in ``benchmarks/results/`` change only with ``--record``.

Summary and plots need only the JSON files (``summarize`` and ``plot_all`` take a results
folder), so they can be redrawn without running anything: ``run.py --no-run`` (plots of the
recorded results go to a fresh folder too).

Verdicts: a quick run (``--quick``: smaller sizes, fewer repetitions) states no verdict for a
target that depends on the size; push modes are compared with a single-descriptor WRITE, pull
with a single-descriptor READ (the same operation).

GPU hook: the H200 run (``probes/gpu_transfer.py``, by hand, not CI) writes ``benchmarks/results/gpu.json``
(and possibly more ``gpu*.json``); when present they get a table, a verdict and a plot.
Two shapes are read (see :func:`gpu_rows`): per case and mode, ``throughput_<ids>`` entries::

    {"benchmark": "gpu", "machine": {...}, "torch_copy_gbps": {"d2d": {"<bytes>": GB/s}},
     "cases": [{"case": "...", "modes": {"push": {"check": {"ok": true, "verified_bytes": N},
               "throughput_contiguous": {"gbps": G, "torch_d2d_gbps_same_bytes": D,
               "fraction_of_d2d": G / D, "descriptors_per_request": n}}}}]}

or flat ``{"rows": [{"case", "mode", "gbps", "fraction_of_d2d" | "ratio_vs_d2d", ...}]}``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plots import plot_all  # noqa: E402,F401
from results_data import (BenchError, gpu_docs, gpu_rows, load_results,  # noqa: E402,F401
                          per_descriptor_cost, pct as _pct)

# name → (script, result file). The order is the order they run in.
SCRIPTS: dict[str, tuple[str, str]] = {
    "compile": ("bench_compile.py", "compile.json"),
    "pair": ("bench_pair.py", "pair.json"),
    "prep": ("bench_nixl_prep.py", "nixl_prep.json"),
    "transfer": ("bench_transfer.py", "transfer.json"),
}
GPU_RESULTS = "gpu.json"  # GPU HOOK: written by the H200 run; every gpu*.json is summarized and plotted

# The suite's performance targets.
COMPILE_TARGET_S = 0.050  # compile at 1M blocks per region
LOCAL_DESCRIPTORS_RATIO = 3.0  # Plan.local_descriptors vs one numpy pass
PAIR_TARGET_S = 0.1  # pairing a checked-in pair
INSTANTIATE_TARGET_S = 0.002  # 128 regions x 512 blocks
DESCRIPTOR_RATIO_CONTIGUOUS = 0.1  # kvlc / per-block for contiguous ids
LOOPBACK_TARGET = 0.9  # kvlc / one single-descriptor transfer
GPU_TARGET = 0.8  # best direction / device-to-device copy




# ----------------------------------------------------------------------------- locating
def find_benchmarks(start: Path | None = None) -> Path:
    """The ``benchmarks/`` folder of the repository kvlc runs from.

    First the checkout this module belongs to (an editable install), then the current
    directory and its parents. Raises :class:`BenchError` with what was searched.
    """
    here = Path(__file__).resolve().parents[1]
    cwd = (start or Path.cwd()).resolve()
    candidates = [here, cwd, *cwd.parents]
    for root in candidates:
        folder = root / "benchmarks"
        if (folder / "common.py").is_file() and all((folder / s).is_file() for s, _ in SCRIPTS.values()):
            return folder
    raise BenchError(
        "benchmarks/run.py: no benchmarks/ folder with the benchmark scripts "
        f"({', '.join(s for s, _ in SCRIPTS.values())}) next to the kvlc package ({here}) or in "
        f"{cwd} or above it. The scripts are not installed with the package: run "
        "python3 benchmarks/run.py in a kvlc source checkout."
    )


def parse_only(only: str | Iterable[str] | None) -> list[str]:
    """``"compile,pair"`` → ``["compile", "pair"]`` in run order; unknown names raise."""
    if only is None:
        return list(SCRIPTS)
    names = [n.strip() for n in (only.split(",") if isinstance(only, str) else only) if n.strip()]
    bad = [n for n in names if n not in SCRIPTS]
    if bad:
        raise BenchError(f"unknown benchmark(s) {', '.join(bad)}: choose from {', '.join(SCRIPTS)}")
    return [n for n in SCRIPTS if n in names]


# ----------------------------------------------------------------------------- running
@dataclass
class RunResult:
    name: str
    returncode: int
    seconds: float
    log: Path


def run_scripts(bench_dir: Path, names: Sequence[str], quick: bool = False, console=None,
                out_dir: Path | None = None) -> list[RunResult]:
    """Run each selected script in turn (``python -u script [--quick]``) with a rich progress
    display showing its latest output line; results and full output go to ``out_dir``
    (``<out_dir>/<name>.json`` and ``.log``; default: a fresh folder)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = console or Console()
    results_dir = out_dir or fresh_folder(bench_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    out: list[RunResult] = []
    env = dict(os.environ, PYTHONUNBUFFERED="1", KVLC_BENCH_RESULTS=str(results_dir))
    with Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description:<9}"),
        BarColumn(bar_width=12),
        TimeElapsedColumn(),
        TextColumn("{task.fields[status]}", style="dim"),
        console=console,
        transient=False,
    ) as progress:
        tasks = {n: progress.add_task(n, total=1, status="waiting", start=False) for n in names}
        for n in names:
            script, _ = SCRIPTS[n]
            cmd = [sys.executable, "-u", str(bench_dir / script)] + (["--quick"] if quick else [])
            log = results_dir / f"{n}.log"
            progress.start_task(tasks[n])
            t0 = time.perf_counter()
            rc = _run_logged(cmd, bench_dir.parent, env, log, lambda text, task=tasks[n]: progress.update(
                task, status=text[:90]))
            dt = time.perf_counter() - t0
            progress.update(
                tasks[n],
                completed=1,
                status="[green]done[/green]" if rc == 0 else f"[red]failed (exit {rc}), see {log}[/red]",
            )
            progress.stop_task(tasks[n])
            out.append(RunResult(n, rc, dt, log))
    return out


def _run_logged(cmd: list[str], cwd: Path, env: dict, log: Path, status) -> int:
    """Run ``cmd``, every output line to ``log`` and each non-blank one to ``status``; its exit code."""
    with open(log, "w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            fh.write(line)
            fh.flush()
            text = line.strip()
            if text:
                status(text)
        return proc.wait()


# ----------------------------------------------------------------------------- verdicts
@dataclass(frozen=True)
class Verdict:
    benchmark: str
    target: str
    value: str
    met: bool | None  # None: not measured in these results


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms"


def _compile_verdicts(results: dict) -> list[Verdict]:
    c = results.get("compile")
    if not (c and c.get("compile")):
        return []
    last = max(c["compile"], key=lambda r: r["num_blocks"])
    t = last["compile_s"]["median"]
    quick = bool(c.get("quick"))
    note = " (quick run: smaller sizes, no verdict)" if quick else ""
    out = [Verdict("compile", f"compile at {last['num_blocks']:,} blocks/region < {_ms(COMPILE_TARGET_S)}",
                   _ms(t) + note, None if quick else t < COMPILE_TARGET_S)]
    if "local_descriptors" in c:
        r = c["local_descriptors"]["ratio"]
        out.append(Verdict("compile", f"local_descriptors within {LOCAL_DESCRIPTORS_RATIO:.0f}x of one numpy pass",
                           f"{r:.2f}x{note}", None if quick else r <= LOCAL_DESCRIPTORS_RATIO))
    return out


def _instantiate_verdicts(reqs: list[dict]) -> list[Verdict]:
    ok = [r for r in reqs if r["descriptor_ratio_kvlc_over_baseline"] <= 1]
    worst = max(ok or reqs, key=lambda r: r["instantiate_bound_s"])
    out = [Verdict("pair", f"instantiate 128 x 512 < {_ms(INSTANTIATE_TARGET_S)} (cases without descriptor "
                   "explosion)", f"{_ms(worst['instantiate_bound_s'])} ({worst['case']}, {worst['ids']})",
                   worst["instantiate_bound_s"] < INSTANTIATE_TARGET_S)]
    expl = [r for r in reqs if r not in ok]
    if expl:
        w = max(expl, key=lambda r: r["instantiate_bound_s"])
        out.append(Verdict("pair", f"instantiate 128 x 512 < {_ms(INSTANTIATE_TARGET_S)} (token-major hetero TP, "
                           "flagged at pairing)", f"{_ms(w['instantiate_bound_s'])} ({w['descriptors_kvlc']:,} "
                           "descriptors)", w["instantiate_bound_s"] < INSTANTIATE_TARGET_S))
    return out + _descriptor_verdicts(reqs)


def _descriptor_verdicts(reqs: list[dict]) -> list[Verdict]:
    """Descriptors at the coalesced minimum, and far below per-block for contiguous ids."""
    out = []
    if all("at_minimum" in r for r in reqs):
        out.append(Verdict("pair", "descriptors = coalesced minimum (every case)",
                           f"{sum(r['at_minimum'] for r in reqs)}/{len(reqs)}", all(r["at_minimum"] for r in reqs)))
    for r in (r for r in reqs if r["ids"] == "contiguous"):
        ratio = r["descriptor_ratio_kvlc_over_baseline"]
        note = "" if r.get("per_block_valid", True) else " (per-block scheme not valid here)"
        out.append(Verdict("pair", f"descriptors <= 1/10 of per-block, contiguous ids: {r['case']}",
                           f"{ratio:.4f}x{note}", ratio <= DESCRIPTOR_RATIO_CONTIGUOUS))
    return out


def _pair_verdicts(results: dict) -> list[Verdict]:
    p = results.get("pair")
    if not p:
        return []
    out = []
    if p.get("pairs"):
        worst = max(max(x["pull_s"], x["push_s"]) for x in p["pairs"])
        out.append(Verdict("pair", f"pairing every checked-in pair < {_ms(PAIR_TARGET_S)}", _ms(worst),
                           worst < PAIR_TARGET_S))
    reqs = [r for r in p.get("requests", []) if r["regions"] == 128 and r["blocks"] == 512]
    return out + (_instantiate_verdicts(reqs) if reqs else [])


def _transfer_verdicts(results: dict) -> list[Verdict]:
    x = results.get("transfer")
    if not x:
        return []
    out = []
    for case in x.get("cases", []):
        out.extend(_transfer_verdict(case, m, quick=bool(x.get("quick"))) for m in case.get("runs", []))
        if "verify" in case:
            how = "(pipeline stage, same request)" if "stage" in case["verify"].get("how", "") else \
                "(first round of every run)"
            out.append(Verdict("transfer", f"{case['case']}: bytes verified {how}",
                               f"{case['verify']['checked_bytes']:,} bytes", bool(case["verify"].get("ok"))))
    return out


def _gpu_verdicts(results: dict) -> list[Verdict]:  # GPU HOOK
    out = []
    for name, g in gpu_docs(results):
        target = g.get("target_ratio", GPU_TARGET)
        best: dict[str, dict] = {}
        for r in gpu_rows(g):
            if r["fraction"] is not None and r["ok"] and r["fraction"] > best.get(r["case"], {}).get("fraction", -1):
                best[r["case"]] = r
        out.extend(Verdict(name, f"{case}: best direction >= {target:.0%} of a torch device-to-device copy",
                           f"{_pct(r['fraction'])} ({r['mode']}, {r['ids']} ids, {r['gbps']:,.1f} GB/s)",
                           r["fraction"] >= target) for case, r in best.items())
    return out


VERDICTS = (_compile_verdicts, _pair_verdicts, _transfer_verdicts, _gpu_verdicts)


def verdicts(results: dict[str, dict]) -> list[Verdict]:
    """The targets against the recorded results (:data:`VERDICTS`; size-dependent ones: no verdict in quick runs)."""
    return [v for make in VERDICTS for v in make(results)]


def _transfer_verdict(case: dict, m: dict, quick: bool) -> Verdict:
    """One mode against one single-descriptor transfer of the same operation (push: WRITE, pull: READ)."""
    op = "WRITE" if m["mode"] in ("push", "pull_via_push") else "READ"
    ratio = m.get("ratio_vs_single_same_op", m["ratio_vs_single_read"] if op == "READ" else None)
    target = f"{case['case']} {m['mode']} ({m['ids']} ids) >= {LOOPBACK_TARGET:.0%} of one single-descriptor {op}"
    if ratio is None:
        return Verdict("transfer", target, "no same-operation baseline recorded", None)
    if quick:
        return Verdict("transfer", target, f"{ratio:.1%} (quick run: smaller sizes, no verdict)", None)
    return Verdict("transfer", target, f"{ratio:.1%}", ratio >= LOOPBACK_TARGET and not m.get("failed"))


# ----------------------------------------------------------------------------- tables
def _mark(met: bool | None) -> str:
    return {True: "[green]met[/green]", False: "[red]missed[/red]", None: "[dim]-[/dim]"}[met]


def _header(doc: dict) -> str:
    m = doc.get("machine", {})
    q = " [yellow](quick run)[/yellow]" if doc.get("quick") else ""
    return (
        f"{doc.get('command', '?')} — {doc.get('when', '?')}, {m.get('cpus', '?')} CPUs, "
        f"load {m.get('loadavg_at_start', '?')} at start{q}"
    )


def _table(title: str, cols, rows, left=(), caption: str | None = None):
    """A rich Table: ``cols`` in order (``left`` ones left-aligned, the rest right), then ``rows``."""
    from rich.table import Table

    t = Table(title=title, caption=caption)
    for col in cols:
        t.add_column(col, justify="left" if col in left else "right")
    for r in rows:
        t.add_row(*r)
    return t


def _compile_tables(results: dict) -> list:
    c = results.get("compile")
    if not c:
        return []
    rows = [(f"{r['num_blocks']:,}", _ms(r["compile_s"]["median"]), _ms(r["load_and_compile_s"]["median"]),
             f"{r['tracemalloc_peak_bytes'] / 1024:,.0f} KiB", f"{r['plan_json_bytes']:,} B")
            for r in c.get("compile", [])]
    return [_table(f"compile: {c.get('layout', '?')} ({c.get('layout_regions', '?')} regions)",
                   ("num_blocks", "compile", "load + compile", "tracemalloc peak", "plan JSON"), rows,
                   caption=_header(c))]


def _request_row(r: dict) -> tuple:
    valid = r.get("per_block_valid", True)
    return (r["case"], r["ids"], _ms(r["instantiate_bound_s"]), _ms(r["per_block_baseline_s"]),
            f"{r['time_ratio_kvlc_over_baseline']:.2f}x", f"{r['descriptors_kvlc']:,}",
            f"{r['descriptors_per_block']:,}" + ("" if valid else " [dim](invalid)[/dim]"),
            f"{r['descriptor_ratio_kvlc_over_baseline']:.4f}x",
            {True: "yes", False: "[red]no[/red]"}.get(r.get("at_minimum"), "-"))


def _pair_tables(results: dict) -> list:
    p = results.get("pair")
    out = []
    if p and p.get("pairs"):
        out.append(_table("pairing (checked-in pairs)", ("pair", "regions", "pull", "push"),
                          [(r["pair"], str(r["regions"]), _ms(r["pull_s"]), _ms(r["push_s"])) for r in p["pairs"]],
                          left=("pair",), caption=_header(p)))
    if p and p.get("requests"):
        out.append(_table("request instantiation and descriptors: kvlc vs per-block (128 regions x 512 blocks)",
                          ("case", "ids", "kvlc", "per-block", "time ratio", "descriptors kvlc", "per-block",
                           "ratio", "minimum"), [_request_row(r) for r in p["requests"]],
                          left=("case", "ids"), caption=_header(p)))
    return out


def _program_list_row(p: dict) -> tuple:
    return (p.get("pair", "?"), f"{p.get('strided_rows', 0):,}", f"{p.get('expanded_descriptors', 0):,}",
            _ms(p["prep_nx5_s"]), _ms(p["prep_nx3_s"]), f"{p.get('request_indices', 0):,} indices",
            _ms(p["prepared_indices_s"]) if "prepared_indices_s" in p else "-",
            _ms(p["instantiate_s"]) if "instantiate_s" in p else "-")


def _prep_tables(results: dict) -> list:
    n = results.get("nixl_prep")
    if not n:
        return []
    rows = [(f"{r['descriptors']:,}", _ms(r["build_nx3_s"]), _ms(r["prep_nx3_s"]), _ms(r["prep_nx5_s"]),
             str(r["strided_rows"]), f"{r['speedup_nx5']:,.0f}x") for r in n.get("rows", [])]
    out = [_table(f"NIXL list preparation: (N, 3) rows vs strided (N, 5) rows ({n.get('block_bytes', '?')} B "
                  "descriptors)", ("descriptors", "build Nx3", "prep Nx3", "prep Nx5", "strided rows", "speedup"),
                  rows, caption=_header(n))]
    progs = n.get("program_lists") or []
    if progs and all("prep_nx5_s" in p and "prep_nx3_s" in p for p in progs):
        out.append(_table("NIXL lists of real transfer programs: strided rows vs the descriptors they expand to",
                          ("pair", "strided rows", "descriptors", "prep Nx5", "prep Nx3", "request", "indices",
                           "instantiate"), [_program_list_row(p) for p in progs], left=("pair",)))
    return out


def _same_op(m: dict) -> float:
    """kvlc over one single-descriptor transfer of the same operation (older results: over a READ)."""
    return m.get("ratio_vs_single_same_op", m["ratio_vs_single_read"])


def _transfer_rows(x: dict) -> list[tuple]:
    return [(case["case"], m["mode"], m["ids"], f"{case['bytes_per_request'] / 2**20:,.0f}",
             f"{m['descriptors_per_request']:,.0f}", f"{m['gbps']['median']:.2f}",
             f"{m['single_read_gbps']['median']:.2f}", f"{m['single_write_gbps']['median']:.2f}",
             f"{case['memcpy']['gbps']:.2f}", f"{_same_op(m):.1%}", f"{m['ratio_vs_memcpy']:.1%}")
            for case in x.get("cases", []) for m in case.get("runs", [])]


def _transfer_tables(results: dict) -> list:
    x = results.get("transfer")
    if not x:
        return []
    out = [_table("loopback transfer, two processes, DRAM, UCX: kvlc vs (a) one descriptor, (b) memcpy",
                  ("case", "mode", "ids", "MiB/req", "desc/req", "kvlc GB/s", "(a) READ", "(a) WRITE",
                   "(b) memcpy", "kvlc/(a) same op", "kvlc/(b)"), _transfer_rows(x),
                  left=("case", "mode", "ids"), caption=_header(x))]
    sweep = x.get("nixl_sweep")
    if sweep:
        rows = [(r["op"], _bytes(r["descriptor_bytes"]), f"{r['descriptors']:,}", f"{r['gbps']:.2f}",
                 f"{r['extra_us_per_descriptor']:.2f} us" if r.get("extra_us_per_descriptor") is not None else "")
                for r in sweep["rows"]]
        out.append(_table(f"why: NIXL alone, {sweep['bytes'] / 2**20:.0f} MiB as descriptors of one size "
                          "(remote order permuted)", ("op", "descriptor", "descriptors", "GB/s",
                                                      "extra per descriptor"), rows, left=("op",)))
    extra = per_descriptor_cost(x)
    if extra:
        rows = [(r["case"], r["mode"], f"{r['descriptors_random']:,.0f}", f"{r['descriptors_contiguous']:,.0f}",
                 f"{r['ms_random']:.1f}", f"{r['ms_contiguous']:.1f}", f"{r['us_per_descriptor']:.2f} us")
                for r in extra]
        out.append(_table("why: cost of one more descriptor inside a kvlc request, same run "
                          "(random vs contiguous producer ids, same bytes)",
                          ("case", "mode", "descriptors random", "contiguous", "ms random", "ms contiguous",
                           "extra per descriptor"), rows, left=("case", "mode")))
    return out


def _gpu_tables(results: dict) -> list:  # GPU HOOK
    out = []
    for name, g in gpu_docs(results):
        rows = gpu_rows(g)
        if not rows:
            continue
        m = g.get("machine", {})
        out.append(_table(
            f"{name}: {m.get('gpu', 'GPU')} (recorded by hand, not CI)",
            ("case", "mode", "ids", "GB/s", "torch d2d GB/s", "fraction of d2d", "desc/req", "verified"),
            [(r["case"], r["mode"], r["ids"], f"{r['gbps']:,.1f}", f"{r['d2d_gbps']:,.0f}" if r["d2d_gbps"] else "-",
              _pct(r["fraction"]) if r["fraction"] is not None else "-",
              f"{r['descriptors']:,.0f}" if r["descriptors"] is not None else "-", _verified(r["verified"]))
             for r in rows],
            left=("case", "mode", "ids"),
            caption=f"{g.get('command', m.get('command', '?'))} — {g.get('when', m.get('when', '?'))}"))
    return out


def _targets_table(results: dict) -> list:
    v = verdicts(results)
    if not v:
        return []
    return [_table("targets", ("benchmark", "target", "measured", "verdict"),
                   [(x.benchmark, x.target, x.value, _mark(x.met)) for x in v],
                   left=("benchmark", "target", "measured", "verdict"))]


TABLES = (_compile_tables, _pair_tables, _prep_tables, _transfer_tables, _gpu_tables, _targets_table)


def tables(results: dict[str, dict]):
    """One rich Table per benchmark present (:data:`TABLES`, in order), then the targets table."""
    return [t for make in TABLES for t in make(results)]


def _verified(v) -> str:
    if v is None:
        return "-"
    if v is False:
        return "[red]no[/red]"
    return f"{v:,} B"


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def summarize(results: dict[str, dict], console=None) -> list[Verdict]:
    """Print every table; return the verdicts."""
    console = console or _console()
    for t in tables(results):
        console.print(t)
    return verdicts(results)


def _console():
    """A console; wide when output is not a terminal (logs, pipes) so tables keep their columns."""
    from rich.console import Console

    c = Console()
    return c if c.is_terminal else Console(width=160)


# ----------------------------------------------------------------------------- command
def fresh_folder(bench_dir: Path) -> Path:
    """A new folder ``benchmarks/runs/<date-time>[-n]/`` for one run's results and plots."""
    base = bench_dir / "runs" / time.strftime("%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        path, n = base.with_name(f"{base.name}-{n}"), n + 1
    path.mkdir(parents=True)
    return path


def _run_selected(bench_dir: Path, names: list[str], quick: bool, console, out: Path) -> list[RunResult]:
    """Run the selected scripts into ``out``; those that failed."""
    console.print(
        f"benchmarks/run.py: {', '.join(names)}{' (quick)' if quick else ''} from {bench_dir} into {out}",
        highlight=False)
    return [r for r in run_scripts(bench_dir, names, quick, console, out) if r.returncode]


def main_bench(only: str | None = None, quick: bool = False, run: bool = True, console=None,
               out: Path | None = None, record: bool = False) -> int:
    """What ``benchmarks/run.py`` does; returns the exit code (1 if a script failed).

    Results and plots go to ``out`` (default: a fresh folder; ``record``: the recorded
    ``benchmarks/results/``). ``run=False`` summarizes the recorded results.
    """
    console = console or _console()
    bench_dir = find_benchmarks()
    names = parse_only(only)
    recorded = bench_dir / "results"
    out = recorded if record else Path(out) if out else fresh_folder(bench_dir)
    out.mkdir(parents=True, exist_ok=True)
    failed = _run_selected(bench_dir, names, quick, console, out) if run else []
    source = out if run else recorded
    results = load_results(source)
    if not results:
        console.print(f"no results in {source}: run without --no-run first")
        return 1
    summarize(results, console)
    for p in plot_all(results, out):
        console.print(f"wrote {p}", highlight=False)
    for r in failed:
        console.print(f"[red]{r.name} failed (exit {r.returncode}); its output: {r.log}[/red]")
    return 1 if failed else 0
