"""Shared helpers for kvlc benchmarks: timing, machine facts, atomic result files.

Every benchmark compares kvlc against a baseline measured in the same process,
in the same run, and reports ratios next to absolute numbers.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
# where results go: the recorded folder, unless the report runs a script into a fresh one
RESULTS = Path(os.environ.get("KVLC_BENCH_RESULTS") or ROOT / "benchmarks" / "results")
LAYOUTS = ROOT / "layouts"


def machine() -> dict:
    """Facts about the machine a result was measured on."""
    info = {"python": platform.python_version(), "platform": platform.platform(),
            "cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()}
    try:
        import numpy
        info["numpy"] = numpy.__version__
    except ImportError:
        pass
    try:
        with open("/proc/loadavg") as fh:
            info["loadavg_at_start"] = fh.read().split()[0]
    except OSError:
        pass
    return info


def timeit(fn: Callable[[], object], repeat: int = 15, warmup: int = 2, min_time: float = 0.0) -> dict:
    """Median, min and max wall time of ``fn`` in seconds over ``repeat`` runs after warm-up."""
    for _ in range(warmup):
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < repeat or (time.perf_counter() - start) < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return spread(times)


def spread(values: list[float]) -> dict:
    """Median, min, max and count of measured ``values``."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": len(values)}


def write_results(name: str, payload: dict) -> Path:
    """Write ``<RESULTS>/<name>.json`` atomically, with machine facts, the command and the quick flag."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": name, "command": " ".join([Path(sys.executable).name, *sys.argv]),
           "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine(),
           "quick": "--quick" in sys.argv, **payload}
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return path


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"
