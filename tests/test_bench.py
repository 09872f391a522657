"""Benchmark report (benchmarks/report.py) summary and plots, from tiny synthetic result files (no runs here)."""

from __future__ import annotations

import io
import json
import re

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("rich")

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from kvlc.cli import main  # noqa: E402

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import report as bench  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"
MACHINE = {"cpus": 2, "loadavg_at_start": "0.5"}


def _t(s: float) -> dict:
    return {"median": s, "min": s, "max": s, "runs": 3}


def _req(case, ids, t_kvlc, n_kvlc, n_base, valid=True):
    return {"case": case, "ids": ids, "regions": 128, "blocks": 512, "instantiate_bound_s": t_kvlc,
            "instantiate_unbound_s": t_kvlc, "per_block_baseline_s": 0.001, "descriptors_kvlc": n_kvlc,
            "descriptors_per_block": n_base, "descriptors_min": n_kvlc, "at_minimum": True,
            "per_block_valid": valid, "time_ratio_kvlc_over_baseline": t_kvlc / 0.001,
            "descriptor_ratio_kvlc_over_baseline": n_kvlc / n_base, "bytes": 1 << 30}


def _run(mode, ids, gbps, read, desc):
    return {"mode": mode, "ids": ids, "gbps": _t(gbps), "single_read_gbps": _t(read),
            "single_write_gbps": _t(read), "descriptors_per_request": desc, "single_descriptors_per_request": 1,
            "ratio_vs_single_read": gbps / read, "ratio_vs_single_same_op": gbps / read,
            "ratio_vs_memcpy": gbps / 10, "failed": {}, "target_met": gbps / read >= 0.9}


SYNTHETIC = {
    "compile": {"benchmark": "compile", "command": "python bench_compile.py", "machine": MACHINE,
                "layout": "x.yaml", "layout_regions": 128,
                "compile": [{"num_blocks": n, "regions": 128, "compile_s": _t(0.003), "load_and_compile_s": _t(0.004),
                             "tracemalloc_peak_bytes": 400_000, "plan_json_bytes": 68_000}
                            for n in (1_000, 1_000_000)],
                "local_descriptors": {"ratio": 2.0}},
    "pair": {"benchmark": "pair", "command": "python bench_pair.py", "machine": MACHINE,
             "pairs": [{"pair": "a-to-b", "regions": 80, "pull_s": 0.004, "push_s": 0.005}],
             "requests": [_req("homogeneous", "contiguous", 0.0001, 128, 65536),
                          _req("homogeneous", "random", 0.0005, 65536, 65536),
                          _req("hetero NHD", "contiguous", 0.03, 2_097_152, 131072, valid=False)]},
    "nixl_prep": {"benchmark": "nixl_prep", "command": "python bench_nixl_prep.py", "machine": MACHINE,
                  "block_bytes": 16,
                  "rows": [{"descriptors": n, "strided_rows": 8, "strided_expanded": n, "build_nx3_s": n * 1e-8,
                            "prep_nx3_s": n * 3e-8, "prep_nx5_s": 1e-4, "speedup_nx5": n * 3e-4}
                           for n in (10_000, 100_000)]},
    "transfer": {"benchmark": "transfer", "command": "python bench_transfer.py", "machine": MACHINE,
                 "cases": [{"case": "llama 2k", "bytes_per_request": 256 << 20, "memcpy": {"gbps": 12.0},
                            "verify": {"checked_bytes": 1 << 28, "ok": True},
                            "runs": [_run("pull", "random", 5.0, 8.0, 4096), _run("push", "contiguous", 7.6, 8.0, 32)]}],
                 "nixl_sweep": {"bytes": 256 << 20, "rows": [
                     {"op": op, "descriptor_bytes": s, "descriptors": (256 << 20) // s, "gbps": g, "seconds": _t(0.1)}
                     for op in ("READ", "WRITE") for s, g in ((4096, 0.8), (1 << 20, 7.5), (256 << 20, 9.0))]}},
    "gpu": {"benchmark": "gpu", "machine": {"gpu": "NVIDIA H200", "command": "gpu_transfer.py"},
            "cases": [{"case": "vram llama", "modes": {"push": {
                "check": {"ok": True, "verified_bytes": 1 << 26},
                "throughput_contiguous": {"gbps": 1700.0, "torch_d2d_gbps_same_bytes": 2000.0,
                                          "fraction_of_d2d": 0.85, "descriptors_per_request": 32}}}}]},
}


@pytest.fixture()
def results_dir(tmp_path):
    d = tmp_path / "results"
    d.mkdir()
    for name, doc in SYNTHETIC.items():
        (d / f"{name}.json").write_text(json.dumps(doc))
    return d


def test_plots_render_valid_pngs(results_dir, tmp_path):
    results = bench.load_results(results_dir)
    assert set(results) == set(SYNTHETIC)
    out = tmp_path / "plots"
    made = bench.plot_all(results, out)
    names = {p.name for p in made}
    assert names == {"compile.png", "instantiate.png", "descriptors.png", "nixl_prep.png", "transfer.png",
                     "transfer_descriptors.png", "gpu.png"}
    for p in made:
        data = p.read_bytes()
        assert data[:8] == PNG and len(data) > 5_000, p


def test_summary_tables_and_verdicts(results_dir):
    results = bench.load_results(results_dir)
    buf = io.StringIO()
    from rich.console import Console

    verdicts = bench.summarize(results, Console(file=buf, width=220))
    text = buf.getvalue()
    for title in ("compile:", "pairing", "request instantiation", "NIXL list preparation", "loopback transfer",
                  "why: NIXL alone", "gpu: NVIDIA H200", "targets"):
        assert title in text, title
    by = {(v.benchmark, v.target.split(" (")[0]): v.met for v in verdicts}
    assert by[("compile", "compile at 1,000,000 blocks/region < 50.000 ms")] is True
    inst = [v.met for v in verdicts if v.target.startswith("instantiate")]
    assert inst == [True, False]               # 0.5 ms met; the token-major explosion case apart, missed
    loop = [v for v in verdicts if v.benchmark == "transfer" and "single-descriptor" in v.target]
    assert [v.met for v in loop] == [False, True]                              # 5/8 missed, 7.6/8 met
    assert "single-descriptor READ" in loop[0].target and "single-descriptor WRITE" in loop[1].target
    assert "issue" not in text
    gpu = [v for v in verdicts if v.benchmark == "gpu"]
    assert len(gpu) == 1 and gpu[0].met is True
    assert "per-block scheme not valid here" in " ".join(v.value for v in verdicts)


def test_no_run_uses_recorded_results(results_dir, monkeypatch):
    bench_dir = results_dir.parent
    monkeypatch.setattr(bench, "find_benchmarks", lambda start=None: bench_dir)
    from rich.console import Console

    buf = io.StringIO()
    before = {p.name for p in results_dir.iterdir()}
    assert bench.main_bench(run=False, console=Console(file=buf, width=200)) == 0
    runs = list((bench_dir / "runs").iterdir())             # plots go to a fresh folder
    assert len(runs) == 1 and (runs[0] / "transfer.png").read_bytes()[:8] == PNG
    assert {p.name for p in results_dir.iterdir()} == before  # the recorded results are left alone


def test_quick_runs_state_no_size_dependent_verdicts(results_dir):
    """A quick run's compile and transfer targets are reported without a verdict (met is None)."""
    results = bench.load_results(results_dir)
    for name in ("compile", "transfer"):
        results[name] = {**results[name], "quick": True}
    v = [x for x in bench.verdicts(results) if x.benchmark in ("compile", "transfer") and "verified" not in x.target]
    assert v and all(x.met is None and "quick run" in x.value for x in v)


def test_run_help_and_errors(tmp_path, monkeypatch):
    """`benchmarks/run.py --help` works; unknown names and a missing benchmarks folder raise clear errors."""
    r = subprocess.run([sys.executable, str(BENCHMARKS / "run.py"), "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--only" in r.stdout and "--record" in r.stdout
    with pytest.raises(bench.BenchError, match="unknown benchmark"):
        bench.parse_only("compile,nope")
    assert bench.parse_only("transfer, compile") == ["compile", "transfer"]
    # outside a checkout: a clear message naming what was searched
    monkeypatch.setattr(bench, "__file__", str(tmp_path / "site" / "kvlc" / "bench.py"))
    with pytest.raises(bench.BenchError, match="no benchmarks/ folder"):
        bench.find_benchmarks(tmp_path)


def test_no_bench_command():
    """`kvlc bench` is gone (the scripts are not installed); the suite is `python3 benchmarks/run.py`."""
    assert "bench" not in main.commands


IMPORT_ONE = """
import importlib.util, pathlib, sys
p = pathlib.Path(sys.argv[1])
sys.path[0] = str(p.parent)                        # as when run as a script
spec = importlib.util.spec_from_file_location("__bench__", p)
mod = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = mod
spec.loader.exec_module(mod)                       # module level only: main() is not called
assert (mod.__doc__ or "").strip(), "no docstring saying what it measures"
"""
SCRIPTS = sorted(BENCHMARKS.glob("*.py")) + sorted(BENCHMARKS.glob("probes/*.py")) + \
    sorted(BENCHMARKS.glob("checks/*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(BENCHMARKS)))
def test_every_script_imports(script):
    """Each script of the suite, probes/ and checks/ imports in a fresh interpreter from where it lies (its
    sys.path set-up finds common.py, the other probes and testkit) and has a docstring."""
    r = subprocess.run([sys.executable, "-c", IMPORT_ONE, str(script)], capture_output=True, text=True,
                       cwd=BENCHMARKS.parent, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]


def _cited_result_files() -> dict[str, set[str]]:
    """File names cited in the prose (outside code blocks) of every README under benchmarks/, by README:
    each name in backticks, alone or after a folder (`results/pair.json`, `pair.log`)."""
    out = {}
    for readme in sorted(BENCHMARKS.rglob("README.md")):
        prose = re.sub(r"```.*?```", "", readme.read_text(), flags=re.S)
        names = set()
        for quoted in re.findall(r"`([^`]+)`", prose):
            names |= set(re.findall(r"(?:^|[\s/])([\w.-]+\.(?:jsonl|json|log|png|txt))\b", quoted))
        out[str(readme.relative_to(BENCHMARKS.parent))] = names
    return out


def test_every_result_file_is_cited_and_every_citation_exists():
    """Each file under benchmarks/results/ is named in a README's prose (where its numbers are quoted), and
    each result file a README names is there: no orphaned results, no dangling citations."""
    results = BENCHMARKS / "results"
    files = {p.name for p in results.iterdir() if p.is_file()}
    cited = _cited_result_files()
    assert files and cited
    assert sorted(files - set().union(*cited.values())) == []
    dangling = {readme: sorted(names - files) for readme, names in cited.items() if names - files}
    assert dangling == {}
    assert not [p for p in results.iterdir() if p.is_dir()]  # results/ is flat


def test_the_device_carry_drops_only_the_unused_part_of_a_wheel(tmp_path):
    """device_carry.py repacks nixl-cu13 without its nixl_ep_cu13 part: those files and their RECORD lines go,
    every other file stays byte for byte (a wheel pip then installs)."""
    import zipfile

    import device_carry

    whl = tmp_path / "nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl"
    files = {"nixl_cu13/_bindings.so": b"\x7fELF core", "nixl_ep_cu13/ep.so": b"\x7fELF ep" * 100,
             "nixl_ep_cu13/__init__.py": b"", "nixl_cu13.libs/libucx.so": b"ucx"}
    record = "".join(f"{n},sha256=x,{len(b)}\n" for n, b in files.items()) + "nixl_cu13-1.5.1.dist-info/RECORD,,\n"
    with zipfile.ZipFile(whl, "w") as z:
        for n, b in files.items():
            z.writestr(n, b)
        z.writestr("nixl_cu13-1.5.1.dist-info/RECORD", record)
    device_carry._drop_part(whl, device_carry.DROPPED)
    with zipfile.ZipFile(whl) as z:
        kept = {n: z.read(n) for n in z.namelist()}
    assert {n: b for n, b in kept.items() if "dist-info" not in n} == {
        n: b for n, b in files.items() if not n.startswith("nixl_ep_cu13/")}
    lines = kept["nixl_cu13-1.5.1.dist-info/RECORD"].decode().splitlines()
    assert [ln.split(",")[0] for ln in lines] == ["nixl_cu13/_bindings.so", "nixl_cu13.libs/libucx.so",
                                                  "nixl_cu13-1.5.1.dist-info/RECORD"]
