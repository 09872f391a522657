"""Verdicts against the GPU targets and the plot of a gpu_transfer.py result (JSON document)."""

from __future__ import annotations

from pathlib import Path


def _find(rows, *words, best: bool = True):
    got = [r for r in rows if r["case"].startswith(words[0]) and all(w in r["case"] for w in words[1:])
           and r.get("gbps")]
    if not got:
        return None
    return max(got, key=lambda r: r["gbps"]) if best else got[0]


def _ratio(target: str, num, den, need: float, what: str) -> dict:
    if num is None or den is None or not den:
        return {"target": target, "verdict": "not measured", "detail": what}
    ratio = num / den
    return {"target": target, "verdict": "met" if ratio >= need else "missed",
            "detail": f"{what}: {num:.1f} / {den:.1f} GB/s = {ratio:.2f} (need >= {need})", "ratio": ratio}


def _g(row):
    return None if row is None else row["gbps"]


def verdicts(doc: dict) -> list[dict]:
    rows, ceil = doc["rows"], doc["torch_copy_gbps"]
    return [_checks_verdict(rows), *_speed_verdicts(rows, ceil), *_staged_verdicts(rows, ceil)]


def _checks_verdict(rows: list[dict]) -> dict:
    """Every content-coded check row ok."""
    checks = [r for r in rows if r["case"].endswith("check") or r["case"].startswith("check")]
    bad = [r["case"] for r in checks if not r.get("ok")]
    return {"target": "content-coded bytes right in every mode", "verdict": "met" if checks and not bad else
            "missed", "detail": f"{len(checks) - len(bad)} of {len(checks)} checks ok" + (f"; failed: {bad}" if bad else "")}


def _speed_verdicts(rows: list[dict], ceil: dict) -> list[dict]:
    """VRAM to VRAM: pull vs push, READ vs WRITE, kvlc vs raw NIXL and vs a device-to-device copy."""
    push = _find(rows, "kvlc VRAM", " push 256 MiB contiguous")
    pull = _find(rows, "kvlc VRAM", " pull 256 MiB contiguous")
    out = [_ratio("pull at push speed (kvlc pull / push, 256 MiB)", _g(pull), _g(push), 0.9, "pull vs push")]
    raw_pull = _find(rows, "raw READ 1 desc 256 MiB [no thread pool")
    raw_push = _find(rows, "raw WRITE 1 desc 256 MiB [no thread pool")
    out.append(_ratio("raw READ at WRITE speed (1 descriptor, 256 MiB)", _g(raw_pull), _g(raw_push), 0.9, "READ vs WRITE"))
    for size, shape in (("256 MiB", "32 x 8 MiB"), ("2 GiB", "32 x 64 MiB")):
        k = _find(rows, "kvlc VRAM", f" push {size} contiguous")
        raw = _find(rows, f"raw WRITE {shape} rows")  # the best UCX setting measured
        out.append(_ratio(f"kvlc push >= 90% of raw NIXL, same shape ({size}, 32 descriptors)", _g(k), _g(raw), 0.9,
                          f"best kvlc vs best raw {shape}"))
        d2d = ceil.get(f"d2d {256 if size == '256 MiB' else 2048} MiB")
        out.append(_ratio(f"kvlc push >= 0.8 of D2D ({size})", _g(k), d2d, 0.8, "kvlc push vs torch d2d"))
    return out


def _staged_verdicts(rows: list[dict], ceil: dict) -> list[dict]:
    """Staged transfers: fragmented VRAM to VRAM, and DRAM <-> VRAM, against torch copies."""
    frag = _find(rows, "staged VRAM -> VRAM fragmented")
    out = [_ratio("4,086 x 64 KiB >= 0.3 of D2D (staged)", _g(frag), ceil.get("d2d 256 MiB"), 0.3, "staged vs d2d")]
    for name, ceiling in (("DRAM -> VRAM", "h2d 256 MiB"), ("VRAM -> DRAM", "d2h 256 MiB")):
        for ids in ("contiguous", "fragmented"):
            r = _find(rows, f"staged {name} {ids}")
            out.append(_ratio(f"mixed {name} {ids} >= 80% of pinned copy (staged)", _g(r), ceil.get(ceiling), 0.8,
                              f"staged vs torch {ceiling}"))
    for mode in ("push", "pull_via_push"):  # staging through KvAgent (benchmarks/probes/gpu_kvlc_staging.py)
        k = _find(rows, f"kvlc staging VRAM llama-3.1-8b {mode} 256 MiB random ids [")
        out.append(_ratio(f"KvAgent {mode} 4,086 x 64 KiB >= 0.3 of D2D (staged)", _g(k), ceil.get("d2d 256 MiB"),
                          0.3, "best staged KvAgent vs d2d"))
        k = _find(rows, f"kvlc staging mixed deepseek-v3.2 -> hisparse {mode} contiguous [")
        out.append(_ratio(f"KvAgent {mode} mixed DRAM/VRAM >= 80% of pinned copy (staged)", _g(k),
                          ceil.get("d2h 256 MiB"), 0.8, "best staged KvAgent vs torch d2h"))
    return out


def annotate(doc: dict) -> dict:
    """Give every timed row its ceiling (torch copy of the same kind) and the fraction of it; VRAM rows
    also get ``torch_d2d_gbps_same_bytes`` (what ``benchmarks/run.py`` summarizes). ``machine.gpu`` names the GPU."""
    ceil = doc["torch_copy_gbps"]
    doc["machine"].setdefault("gpu", (doc["machine"].get("gpus") or ["?"])[0])
    for r in doc["rows"]:
        if not r.get("gbps") or r["case"].startswith("diag notification"):
            continue
        case = r["case"]
        if "DRAM -> VRAM" in case:
            kind = "h2d 256 MiB"
        elif "VRAM -> DRAM" in case or "mixed" in case:
            kind = "d2h 256 MiB"
        else:
            kind = "d2d 2048 MiB" if r.get("bytes_per_request", 0) >= 1 << 31 else "d2d 256 MiB"
        r["ceiling"], r["ceiling_gbps"] = kind, ceil.get(kind)
        if r["ceiling_gbps"]:
            r["fraction_of_ceiling"] = r["gbps"] / r["ceiling_gbps"]
            if kind.startswith("d2d"):
                r["torch_d2d_gbps_same_bytes"] = r["ceiling_gbps"]
                r["fraction_of_d2d"] = r["fraction_of_ceiling"]
    return doc


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc["rows"] if r.get("gbps")]
    colors = {"kvlc": "#1f77b4", "raw": "#7f7f7f", "staged": "#2ca02c"}
    fig, ax = plt.subplots(figsize=(11, 0.28 * len(rows) + 2))
    names = [r["case"][:90] for r in rows]
    ax.barh(range(len(rows)), [r["gbps"] for r in rows],
            color=[colors.get(r["case"].split()[0], "#d62728") for r in rows])
    ax.set_yticks(range(len(rows)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    for k, v in doc["torch_copy_gbps"].items():
        ax.axvline(v, ls="--", lw=0.8, color="#d62728" if "d2d" in k else "#ff7f0e")
        ax.text(v, -0.8, k, fontsize=6, rotation=90, va="top")
    ax.set_xlabel("GB/s (bytes counted once; log scale). Dashed: torch copies (d2d red, pinned host<->device orange)")
    m = doc["machine"]
    ax.set_title(f"{', '.join(sorted(set(m['gpus'])))}: producer cuda:{m['producer_device']}, consumer "
                 f"cuda:{m['consumer_device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
