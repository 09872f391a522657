"""Benchmark results: loading result files and deriving rows from them (shared by report and plots)."""

from __future__ import annotations

import json
from pathlib import Path

from kvlc.errors import KvlcError


class BenchError(KvlcError):
    """The benchmarks folder is missing, a results file is unreadable, or a benchmark failed."""


def pct(x: float) -> str:
    return f"{x:.1%}" if x >= 0.01 else f"{x:.3%}"


# ----------------------------------------------------------------------------- loading
def load_results(results_dir: Path) -> dict[str, dict]:
    """Every ``*.json`` in ``results_dir``, keyed by its ``benchmark`` field (or file stem)."""
    out = {}
    for path in sorted(Path(results_dir).glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise BenchError(f"{path}: not a readable results file: {exc}") from None
        if isinstance(doc, dict):
            out[doc.get("benchmark", path.stem)] = doc
    return out


def per_descriptor_cost(doc: dict) -> list[dict]:
    """Per case and mode: (time random - time contiguous) / (descriptors random - contiguous),
    from the median GB/s of the two runs of a transfer result (same bytes, same engines)."""
    out = []
    for c in doc.get("cases", []):
        by = {(m["mode"], m["ids"]): m for m in c.get("runs", [])}
        for mode in dict.fromkeys(m for m, _ in by):
            r, k = by.get((mode, "random")), by.get((mode, "contiguous"))
            if not r or not k or r["descriptors_per_request"] <= k["descriptors_per_request"]:
                continue
            tr = c["bytes_per_request"] / (r["gbps"]["median"] * 1e9)
            tk = c["bytes_per_request"] / (k["gbps"]["median"] * 1e9)
            out.append(
                {
                    "case": c["case"],
                    "mode": mode,
                    "descriptors_random": r["descriptors_per_request"],
                    "descriptors_contiguous": k["descriptors_per_request"],
                    "ms_random": tr * 1e3,
                    "ms_contiguous": tk * 1e3,
                    "us_per_descriptor": (tr - tk)
                    / (r["descriptors_per_request"] - k["descriptors_per_request"])
                    * 1e6,
                }
            )
    return out


# ----------------------------------------------------------------------------- GPU hook
def gpu_docs(results: dict[str, dict]) -> list[tuple[str, dict]]:
    """The GPU result documents (``gpu.json`` first, then other ``gpu*`` ones)."""
    return sorted(
        ((k, v) for k, v in results.items() if k.startswith("gpu")), key=lambda kv: (kv[0] != "gpu", kv[0])
    )


def gpu_rows(doc: dict) -> list[dict]:
    """One flat row per (case, mode, ids) of a GPU result: gbps, d2d_gbps, fraction, descriptors, verified."""
    out = []
    for c in doc.get("cases", []):
        for mode, m in c.get("modes", {}).items():
            out += [_case_row(c, mode, key, t, m.get("check", {})) for key, t in m.items()
                    if key.startswith("throughput") and isinstance(t, dict) and "gbps" in t]
    return out + [_flat_row(r) for r in doc.get("rows", []) if "gbps" in r]


def _case_row(c: dict, mode: str, key: str, t: dict, check: dict) -> dict:
    """The row of one ``throughput_<ids>`` entry of a per-case GPU result."""
    d2d = t.get("torch_d2d_gbps_same_bytes")
    return {
        "case": c.get("case", "?"),
        "mode": mode,
        "ids": key.partition("_")[2] or "-",
        "gbps": t["gbps"],
        "d2d_gbps": d2d,
        "fraction": t.get("fraction_of_d2d", t["gbps"] / d2d if d2d else None),
        "descriptors": t.get("descriptors_per_request"),
        "verified": check.get("verified_bytes") if check.get("ok") else (False if check else None),
        "ok": t.get("ok", True),
    }


def _flat_row(r: dict) -> dict:
    """The row of one entry of a flat ``{"rows": [...]}`` GPU result."""
    d2d = r.get("torch_d2d_gbps_same_bytes", r.get("d2d_gbps"))
    frac = r.get("fraction_of_d2d", r.get("ratio_vs_d2d"))
    case = r.get("case") or (f"{r['tokens']} tokens" if "tokens" in r else "?")
    if "progress" in r:
        case += f" ({r['progress']})"
    return {
        "case": case,
        "mode": r.get("mode", "?"),
        "ids": r.get("ids", "-"),
        "gbps": r["gbps"],
        "d2d_gbps": d2d,
        "fraction": frac if frac is not None else (r["gbps"] / d2d if d2d else None),
        "descriptors": r.get("descriptors_per_request"),
        "verified": None,
        "ok": r.get("ok", True),
    }
