"""Benchmark plots: one PNG per benchmark from its results (matplotlib, headless)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_data import gpu_docs, gpu_rows, pct as _pct  # noqa: E402

COMPILE_TARGET_S = 0.050  # compile at 1M blocks per region (drawn as a line)
INSTANTIATE_TARGET_S = 0.002  # 128 regions x 512 blocks (drawn as a line)


# ----------------------------------------------------------------------------- plots
def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _plt().close(fig)
    return path


def plot_compile(doc: dict, out: Path) -> Path:
    plt = _plt()
    rows = sorted(doc["compile"], key=lambda r: r["num_blocks"])
    n = [r["num_blocks"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(n, [r["compile_s"]["median"] * 1e3 for r in rows], "o-", label="compile (passes)")
    a.plot(n, [r["load_and_compile_s"]["median"] * 1e3 for r in rows], "s-", label="load + compile")
    a.axhline(
        COMPILE_TARGET_S * 1e3, color="red", ls="--", lw=1, label=f"target {COMPILE_TARGET_S * 1e3:.0f} ms"
    )
    a.set(
        xscale="log",
        yscale="log",
        ylim=(1, 100),
        xlabel="num_blocks per region",
        ylabel="ms (median)",
        title=f"compile time, {doc.get('layout', '')} ({doc.get('layout_regions', '?')} regions)",
    )
    a.set_yticks([1, 2, 5, 10, 20, 50, 100], ["1", "2", "5", "10", "20", "50", "100"])
    a.minorticks_off()
    a.legend(fontsize=8)
    b.plot(n, [r["tracemalloc_peak_bytes"] / 1024 for r in rows], "o-", label="tracemalloc peak")
    b.plot(n, [r["plan_json_bytes"] / 1024 for r in rows], "s-", label="plan JSON")
    b.set(xscale="log", xlabel="num_blocks per region", ylabel="KiB", title="compile memory and plan size")
    b.set_ylim(0, max(r["tracemalloc_peak_bytes"] for r in rows) / 1024 * 1.3)
    b.legend(fontsize=8)
    return _save(fig, out / "compile.png")


def _case_labels(reqs: list[dict]) -> list[str]:
    return [f"{r['case']}\n{r['ids']}" for r in reqs]


def _per_request_axes(reqs: list[dict]):
    """A figure with one pair of bars a request case: (figure, axes, bar positions, bar width)."""
    plt = _plt()
    import numpy as np

    x = np.arange(len(reqs))
    fig, ax = plt.subplots(figsize=(max(8, len(reqs) * 0.8), 4.8))
    return fig, ax, x, 0.4


def plot_instantiate(doc: dict, out: Path) -> Path:
    reqs = doc["requests"]
    fig, ax, x, w = _per_request_axes(reqs)
    ax.bar(x - w / 2, [r["instantiate_bound_s"] * 1e3 for r in reqs], w, label="kvlc (bound program)")
    ax.bar(x + w / 2, [r["per_block_baseline_s"] * 1e3 for r in reqs], w, label="per-block scheme (numpy)")
    ax.axhline(
        INSTANTIATE_TARGET_S * 1e3,
        color="red",
        ls="--",
        lw=1,
        label=f"target {INSTANTIATE_TARGET_S * 1e3:.0f} ms",
    )
    ax.set_yscale("log")
    ax.set_ylabel("ms per request (median)")
    ax.set_title(f"request instantiation, {reqs[0]['regions']} regions x {reqs[0]['blocks']} blocks")
    ax.set_xticks(x, _case_labels(reqs), rotation=60, ha="right", fontsize=7)
    ax.legend(fontsize=8)
    return _save(fig, out / "instantiate.png")


def plot_descriptors(doc: dict, out: Path) -> Path:
    reqs = doc["requests"]
    fig, ax, x, w = _per_request_axes(reqs)
    ax.bar(x - w / 2, [r["descriptors_kvlc"] for r in reqs], w, label="kvlc")
    valid = [r.get("per_block_valid", True) for r in reqs]
    bars = ax.bar(x + w / 2, [r["descriptors_per_block"] for r in reqs], w, label="per-block scheme")
    for bar, ok in zip(bars, valid):
        if not ok:
            bar.set_hatch("//")
            bar.set_alpha(0.45)
    if not all(valid):
        ax.bar(
            [0],
            [0],
            0,
            color=bars[0].get_facecolor(),
            hatch="//",
            alpha=0.45,
            label="per-block: would move wrong bytes (token-major, hetero TP)",
        )
    for i, r in enumerate(reqs):
        ax.text(
            i,
            max(r["descriptors_kvlc"], r["descriptors_per_block"]) * 1.3,
            f"{r['descriptor_ratio_kvlc_over_baseline']:.3g}x",
            ha="center",
            fontsize=7,
        )
    ax.set_yscale("log")
    ax.set_ylim(10, max(max(r["descriptors_kvlc"], r["descriptors_per_block"]) for r in reqs) * 30)
    ax.set_ylabel("descriptors per request")
    ax.set_title(f"descriptors per request, {reqs[0]['regions']} regions x {reqs[0]['blocks']} blocks "
                 "(labels: kvlc / per-block)")
    ax.set_xticks(x, _case_labels(reqs), rotation=60, ha="right", fontsize=7)
    ax.legend(fontsize=8, loc="upper left")
    return _save(fig, out / "descriptors.png")


def plot_prep(doc: dict, out: Path) -> Path:
    plt = _plt()
    rows = sorted(doc["rows"], key=lambda r: r["descriptors"])
    n = [r["descriptors"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.plot(n, [r["prep_nx3_s"] * 1e3 for r in rows], "o-", label="prep (N, 3): one row per descriptor")
    ax.plot(
        n,
        [r["prep_nx5_s"] * 1e3 for r in rows],
        "s-",
        label=f"prep strided (N, 5): {rows[0]['strided_rows']} rows",
    )
    ax.plot(n, [r["build_nx3_s"] * 1e3 for r in rows], "^:", label="numpy build of the (N, 3) rows")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="descriptors in the list (N)",
        ylabel="ms",
        title="NIXL prep_xfer_dlist time vs N",
    )
    ax.legend(fontsize=8)
    return _save(fig, out / "nixl_prep.png")


def plot_transfer(doc: dict, out: Path) -> Path:
    plt = _plt()

    cases = doc["cases"]
    ids_kinds = list(dict.fromkeys(m["ids"] for c in cases for m in c["runs"])) or ["random"]
    modes = list(dict.fromkeys(m["mode"] for c in cases for m in c["runs"]))
    fig, axes = plt.subplots(
        1, len(ids_kinds), figsize=(6.8 * len(ids_kinds), 5.4), squeeze=False, sharey=True
    )
    colors = {"pull": "C0", "push": "C1", "pull_via_push": "C2"}
    bars = [(f"kvlc {m}", colors.get(m, f"C{3 + i}")) for i, m in enumerate(modes)]
    bars += [
        ("(a) one descriptor, READ", "0.72"),
        ("(a) one descriptor, WRITE", "0.55"),
        ("(b) numpy memcpy", "0.25"),
    ]
    for ax, kind in zip(axes[0], ids_kinds):
        _transfer_axes(ax, cases, modes, kind, bars)
    fig.suptitle(
        "loopback transfer between two processes, DRAM, UCX (same run, interleaved rounds)", fontsize=11
    )
    handles, labels_ = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels_, loc="lower center", ncol=len(bars), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(out / "transfer.png", dpi=120)
    plt.close(fig)
    return out / "transfer.png"


def _transfer_axes(ax, cases: list, modes: list, kind: str, bars: list) -> None:
    """One panel of ``transfer.png``: the bars of every case for producer ids ``kind``."""
    import numpy as np

    w = 0.84 / len(bars)
    x = np.arange(len(cases))
    for i, ((label, color), vals) in enumerate(zip(bars, _transfer_columns(cases, modes, kind))):
        ax.bar(x + (i - (len(bars) - 1) / 2) * w, vals, w, label=label, color=color)
    for c_i, c in enumerate(cases):
        _ratio_labels(ax, c_i, c, modes, kind, (len(bars) - 1) / 2, w)
    labels = []
    for c in cases:
        desc = [m["descriptors_per_request"] for m in c["runs"] if m["ids"] == kind]
        labels.append(
            f"{c['case']}\n{c['bytes_per_request'] / 2**20:,.0f} MiB, {_median(desc):,.0f} desc/req"
        )
    ax.set_xticks(x, labels, fontsize=7.5)
    ax.set_ylabel("GB/s (median of rounds)")
    ax.set_title(
        f"{kind} producer block ids (labels over kvlc bars: kvlc / one-descriptor READ)", fontsize=9.5
    )


def _transfer_columns(cases: list, modes: list, kind: str) -> list[list[float]]:
    """GB/s per case of each bar: every kvlc mode, one-descriptor READ and WRITE, numpy memcpy."""
    cols = [[(_run(c, m, kind) or {"gbps": {"median": 0}})["gbps"]["median"] for c in cases] for m in modes]
    for key in ("single_read_gbps", "single_write_gbps"):
        cols.append([_median([m[key]["median"] for m in c["runs"] if m["ids"] == kind]) for c in cases])
    cols.append([c["memcpy"]["gbps"] for c in cases])
    return cols


def _ratio_labels(ax, c_i: int, case: dict, modes: list, kind: str, middle: float, w: float) -> None:
    """Over each kvlc bar of case ``c_i``: its throughput as a share of the one-descriptor READ."""
    for i, m in enumerate(modes):
        r = _run(case, m, kind)
        if r:
            ax.text(
                c_i + (i - middle) * w,
                r["gbps"]["median"] + 0.2,
                f"{r['ratio_vs_single_read']:.0%}",
                ha="center",
                fontsize=6.5,
                rotation=90,
            )


def _run(case: dict, mode: str, ids: str) -> dict | None:
    return next((m for m in case["runs"] if m["mode"] == mode and m["ids"] == ids), None)


def _median(values: list[float]) -> float:
    import statistics

    return statistics.median(values) if values else 0.0


def plot_transfer_descriptors(doc: dict, out: Path) -> Path | None:
    """GB/s vs bytes per descriptor: NIXL alone (sweep) and every kvlc run."""
    sweep = doc.get("nixl_sweep")
    if not sweep:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for op, style, shade in (("READ", "o-", "0.80"), ("WRITE", "s--", "0.90")):
        _sweep_curve(ax, sweep, op, style, shade)
    markers = {"pull": "v", "push": "^", "pull_via_push": "D"}
    for i, c in enumerate(doc["cases"]):
        for m in c["runs"]:
            size = c["bytes_per_request"] / max(1.0, m["descriptors_per_request"])
            ax.scatter(
                [size],
                [m["gbps"]["median"]],
                marker=markers.get(m["mode"], "o"),
                color=f"C{i}",
                s=36,
                zorder=3,
                label=f"kvlc {c['case']}" if m is c["runs"][0] else None,
            )
    ax.scatter([], [], marker="v", color="k", label="pull")
    ax.scatter([], [], marker="^", color="k", label="push")
    ax.scatter([], [], marker="D", color="k", label="pull via push")
    ax.set(
        xscale="log",
        xlabel="bytes per descriptor (request bytes / descriptors)",
        ylabel="GB/s",
        title="loopback GB/s vs descriptor size: kvlc runs on NIXL's own curve",
    )
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, out / "transfer_descriptors.png")


def _sweep_curve(ax, sweep: dict, op: str, style: str, shade: str) -> None:
    """NIXL alone for ``op``: the median GB/s per descriptor size, and the rounds' spread when recorded."""
    rows = sorted((r for r in sweep["rows"] if r["op"] == op), key=lambda r: r["descriptor_bytes"])
    size = [r["descriptor_bytes"] for r in rows]
    ax.plot(
        size,
        [r["gbps"] for r in rows],
        style,
        color="0.4",
        label=f"NIXL alone, {op}, median ({sweep['bytes'] / 2**20:.0f} MiB)",
    )
    if all("seconds" in r for r in rows):  # spread of the rounds: slowest .. fastest
        ax.fill_between(
            size,
            [sweep["bytes"] / r["seconds"]["max"] / 1e9 for r in rows],
            [sweep["bytes"] / r["seconds"]["min"] / 1e9 for r in rows],
            color=shade,
            alpha=0.5,
            lw=0,
            label=f"NIXL alone, {op}, slowest..fastest round",
        )


def plot_gpu(name: str, doc: dict, out: Path) -> Path | None:  # GPU HOOK
    rows = gpu_rows(doc)
    if not rows:
        return None
    plt = _plt()
    import numpy as np

    labels = [f"{r['case']}\n{r['mode']} {r['ids'] if r['ids'] != '-' else ''}".strip() for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(7, len(rows) * 0.75), 5))
    ax.bar(x - 0.2, [r["gbps"] for r in rows], 0.4, label="kvlc")
    ax.bar(
        x + 0.2,
        [r["d2d_gbps"] or 0 for r in rows],
        0.4,
        label="torch device-to-device copy, same bytes",
        color="0.6",
    )
    for i, r in enumerate(rows):
        if r["fraction"] is not None:
            ax.text(i - 0.2, r["gbps"] * 1.15, _pct(r["fraction"]), ha="center", fontsize=6, rotation=90)
    ax.set_yscale("log")
    ax.set_ylabel("GB/s")
    gpu = doc.get("machine", {}).get("gpu", "GPU")
    ax.set_title(f"{name}: {gpu}, kvlc vs device-to-device copy (labels: fraction of the copy)")
    ax.set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylim(top=max(max(r["gbps"], r["d2d_gbps"] or 0) for r in rows) * 8)
    ax.legend(fontsize=8, loc="upper right", ncol=2)
    return _save(fig, out / f"{name}.png")


def plot_all(results: dict[str, dict], out_dir: Path) -> list[Path]:
    """Every plot the results allow, as PNG files in ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    made: list[Path | None] = []
    if results.get("compile", {}).get("compile"):
        made.append(plot_compile(results["compile"], out_dir))
    if results.get("pair", {}).get("requests"):
        made.append(plot_instantiate(results["pair"], out_dir))
        made.append(plot_descriptors(results["pair"], out_dir))
    if results.get("nixl_prep", {}).get("rows"):
        made.append(plot_prep(results["nixl_prep"], out_dir))
    if results.get("transfer", {}).get("cases"):
        made.append(plot_transfer(results["transfer"], out_dir))
        made.append(plot_transfer_descriptors(results["transfer"], out_dir))
    for name, doc in gpu_docs(results):  # GPU HOOK
        made.append(plot_gpu(name, doc, out_dir))
    return [p for p in made if p is not None]
