"""One GPU suite: kvlc next to raw NIXL and torch copies, every case in every mode, in one run (issue 28).

Modes, side by side for each case (``--modes``):

* ``d2d``: torch ceilings in this process: one contiguous copy of a request's bytes (device to
  device; pinned host to device for the mixed case), and, for VRAM, the same scattered rows
  gathered and scattered (``index_select`` + ``index_copy_`` on int64 row views);
* ``raw``, ``raw_sgl``: raw NIXL WRITEs of exactly the rows kvlc posts, between two fresh
  processes with default UCX settings, then with ``NIXL_UCX_SGL_ENABLE=1`` in both;
* ``kvlc_nixl``, ``kvlc_ipc``: kvlc (this process's KvAgent initiates, a spawned engine process is
  the other side) with ``KVLC_IPC=off``, then ``KVLC_IPC=auto`` (same-host copies where both sides
  can; ``ipc`` counts ``agent.stats["ipc_requests"]``, "not available" where kvlc has no such counter).

Cases (``--only``: handover, deepseek, bulk, mixed, flight, or 1-5): (1) Llama-3.1-8B handover of 1k, 2k and
4k tokens, contiguous and random block ids, and of a prompt's 2k - 1 tokens (last block partial), random ids,
one request at a time: latency p50/p99 and GB/s at p50;
(2) DeepSeek-V3 MLA handover, 4k tokens, random ids; (3) push and pull via push of 256 MiB and 2 GiB
contiguous, rounds in flight: median GB/s; (4) DeepSeek-V3.2 HiSparse (latent in host memory) pushing
into DeepSeek-V3.2 on the GPU, one request per round, every round counted (first round and overall);
(5) the random-id handovers of (1) and (2) four at a time, as an engine hands several over: each
``write()`` issued as soon as the one before returned, then all four in one ``write_many``; median
round GB/s (kvlc's host work for one request overlaps the copies of the others).
Every mode of every group first moves one request of content-coded bytes on small pools and checks
every destination byte and every byte around them (pass/FAIL in the table and the JSON).
Other sizes and block patterns: ``--tokens`` (the Llama handovers', e.g. ``512,8192``), ``--dsv3-tokens``, and
``--ids scattered`` (the random-id cases and the content check draw both sides' ids at random, a decode pool
as fragmented as the prefill's, instead of the producer's only); the pools grow to hold what is in flight.

Writes the JSON (``--out``) and a plot next to it, prints a table and the targets (met/missed).
Exits 1 when kvlc failed (a kvlc mode's error or failed row, or any content check that failed), 0
otherwise: a baseline that cannot run here (raw NIXL's error on a case) is printed and recorded,
not counted against kvlc (:func:`exit_status`).
``--device cpu`` is a dry run on DRAM with tiny pools (every mode and check, a few minutes on 2 cores).

    python3 benchmarks/gpu_suite.py --out benchmarks/results/gpu-suite.json [--quick] [--only 1,3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import gpu_suite_cases as cases  # noqa: E402
import gpu_suite_modes as modes  # noqa: E402

MODES = {  # name: (row label, runner(group, gpu))
    "d2d": ("d2d", lambda g, gpu: modes.ceiling_rows(g, gpu)),
    "raw": ("raw nixl", lambda g, gpu: modes.raw_rows(g, gpu, {}, "raw nixl")),
    "raw_sgl": ("raw nixl sgl",
                lambda g, gpu: modes.raw_rows(g, gpu, {"NIXL_UCX_SGL_ENABLE": "1"}, "raw nixl sgl")),
    "kvlc_nixl": ("kvlc nixl", lambda g, gpu: modes.kvlc_rows(g, gpu, "off", "kvlc nixl")),
    "kvlc_ipc": ("kvlc ipc", lambda g, gpu: modes.kvlc_rows(g, gpu, "auto", "kvlc ipc")),
}
SELECT = {"1": "handover", "2": "deepseek", "3": "bulk", "4": "mixed", "5": "flight"}
CEILINGS = ("d2d copy", "d2d gather+scatter", "h2d copy")


def machine(args) -> dict:
    import torch

    from kvlc.compiler.request import native

    info = {"python": platform.python_version(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if args.device == "gpu" else "none (cpu dry run)",
            "native_rows": native.status(),
            "env": {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_", "KVLC_"))}}
    try:
        from importlib.metadata import version

        info["nixl"] = version("nixl-cu13") if args.device == "gpu" else version("nixl")
    except Exception as exc:
        info["nixl"] = f"unknown: {exc}"
    return info


def run_group(doc: dict, g, sc, selected: list[str], save) -> None:
    """Every selected mode on one group; a mode's failure is recorded and the next one runs."""
    t_group = time.time()
    print(f"== {g.name} ({len(g.cases)} cases)", flush=True)
    try:
        cases.prepare(g, sc)
    except Exception as exc:
        doc["errors"].append({"group": g.name, "mode": "prepare", "error": f"{type(exc).__name__}: {exc}",
                              "traceback": traceback.format_exc()[-2000:]})
        print(f"  prepare failed: {exc}", flush=True)
        return
    for name in selected:
        label, runner = MODES[name]
        t0 = time.time()
        try:
            rows, checks = runner(g, sc.gpu)
        except Exception as exc:
            rows, checks = [], []
            doc["errors"].append({"group": g.name, "mode": label, "traceback": traceback.format_exc()[-2000:],
                                  "error": f"{type(exc).__name__}: {exc}"[:600]})
            print(f"  [{label}] failed: {exc}", flush=True)
        for r in rows:
            r["group"] = g.name
        doc["rows"] += rows
        doc["checks"] += checks
        doc["elapsed_s"][f"{g.name} / {label}"] = round(time.time() - t0, 1)
        _free_gpu_memory(sc.gpu)
        print(f"  [{label}] {g.name}: {time.time() - t0:.1f} s", flush=True)
        save()
    doc["elapsed_s"][g.name] = round(time.time() - t_group, 1)
    print(f"== {g.name}: {time.time() - t_group:.1f} s", flush=True)


def _free_gpu_memory(gpu: bool) -> None:
    """What the mode left cached goes back to the device (the next mode's processes allocate theirs)."""
    if gpu:
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()


def annotate(doc: dict, expect_ipc: dict) -> None:
    """Each timed row gets its case's contiguous-copy ceiling (``d2d_gbps``, the fraction of it) and,
    for kvlc, whether same-host copies ran as the mode says (``ipc_ok``); ``ok`` is False on an error,
    a failed check or a wrong ipc count."""
    def key(r):  # pull via push moves the bytes of the push case of its size
        return r["group"], r["kind"], r["tokens"], r["ids"]
    ceiling = {key(r): r["gbps"] for r in doc["rows"]
               if r["mode"] in ("d2d copy", "h2d copy") and "gbps" in r}
    for r in doc["rows"]:
        if r["mode"] not in CEILINGS and r.get("gbps") and ceiling.get(key(r)):
            r["d2d_gbps"] = ceiling[key(r)]
            r["fraction_of_d2d"] = r["gbps"] / r["d2d_gbps"]
        if r["mode"].startswith("kvlc") and "error" not in r:
            want = expect_ipc.get(r["group"], False)  # True, False, or the fewest rows a copied request has
            if not isinstance(want, bool):
                want = r.get("descriptors_per_request", want) >= want
            r["ipc_ok"] = _ipc_ok(r, want)
        r["ok"] = "error" not in r and r.get("check", "pass") in ("pass", "-") and r.get("ipc_ok", True)


def _ipc_ok(r: dict, expected: bool) -> bool:
    n = r.get("ipc")
    if not isinstance(n, int):  # "not available": this kvlc has no same-host copies yet
        return True
    return n == 0 if r["mode"] == "kvlc nixl" else (n > 0 or not expected)


# ----------------------------------------------------------------------------- targets
def _find(rows: list, group: str, mode: str, **match) -> dict | None:
    for r in rows:
        if r["group"] == group and r["mode"] == mode and all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def _verdict(target: str, ok: bool | None, detail: str) -> dict:
    return {"target": target, "verdict": "not measured" if ok is None else ("met" if ok else "missed"),
            "detail": detail}


def _measured(*rows) -> bool:
    return all(r is not None and "error" not in r for r in rows)


def targets(doc: dict, sc) -> list[dict]:
    rows = doc["rows"]
    return [*_t_latency(rows, sc), *_t_pull_via_push(rows, sc), *_t_ipc(rows, sc), *_t_flight(rows, sc),
            *_t_mixed(rows, sc)]


def _t_latency(rows, sc) -> list[dict]:
    """kvlc against raw NIXL on the same rows, one contiguous handover at a time: with ``KVLC_IPC=off``
    (every notification through NIXL), and as kvlc runs by default (``KVLC_IPC=auto``: these requests' few
    rows still go through NIXL, below ``ipc_min_rows``, and ``done`` is rung on the peer's doorbell); a
    default-mode row whose bytes the same-host copy moved compares nothing with NIXL and is not judged."""
    out = []
    for t in sc.handover_tokens:
        raw = _find(rows, "llama-3.1-8b", "raw nixl", kind="handover", tokens=t, ids="contiguous")
        for mode, how in (("kvlc nixl", "KVLC_IPC=off"), ("kvlc ipc", "default: bytes through NIXL, done on the doorbell")):
            k = _find(rows, "llama-3.1-8b", mode, kind="handover", tokens=t, ids="contiguous")
            name = f"kvlc <= 1.1x raw NIXL p50 and p99, Llama-3.1-8B {t} tokens contiguous, one at a time [{how}]"
            if not _measured(k, raw):
                out.append(_verdict(name, None, f"{mode} or raw nixl row missing or failed"))
                continue
            if mode == "kvlc ipc" and k.get("ipc") != 0:
                out.append(_verdict(name, None, f"the same-host copy moved these requests (ipc {k.get('ipc')})"))
                continue
            r50, r99 = k["p50_us"] / raw["p50_us"], k["p99_us"] / raw["p99_us"]
            out.append(_verdict(name, r50 <= 1.1 and r99 <= 1.1,
                                f"p50 {k['p50_us']:.0f} / {raw['p50_us']:.0f} us = {r50:.2f}x, "
                                f"p99 {k['p99_us']:.0f} / {raw['p99_us']:.0f} us = {r99:.2f}x"))
    return out


def _t_pull_via_push(rows, sc) -> list[dict]:
    out = []
    for t, _ in sc.bulk:
        for mode in ("kvlc nixl", "kvlc ipc"):
            push = _find(rows, "llama-3.1-8b", mode, kind="bulk", tokens=t, direction="push")
            pv = _find(rows, "llama-3.1-8b", mode, kind="bulk", tokens=t, direction="pull_via_push")
            name = f"pull_via_push >= 0.9x push, {cases._mib(sc, t)} contiguous [{mode}]"
            if not _measured(push, pv):
                out.append(_verdict(name, None, "a row missing or failed"))
                continue
            ratio = pv["gbps"] / push["gbps"]
            out.append(_verdict(name, ratio >= 0.9,
                                f"{pv['gbps']:.1f} / {push['gbps']:.1f} GB/s = {ratio:.2f}"))
    return out


def _of_ceiling(name: str, k: dict | None, floor: float, missing: str, note) -> dict:
    """The verdict "kvlc's GB/s >= ``floor`` x the copy ceiling measured beside it" for row ``k``;
    ``note(k)`` adds the row's own detail."""
    if not _measured(k) or not k.get("d2d_gbps"):
        return _verdict(name, None, missing)
    f = k["gbps"] / k["d2d_gbps"]
    return _verdict(name, f >= floor, f"{k['gbps']:.1f} / {k['d2d_gbps']:.1f} GB/s = {f:.2f}{note(k)}")


def _t_ipc(rows, sc) -> list[dict]:
    wanted = [("llama-3.1-8b", t) for t in sc.handover_tokens] + [("deepseek-v3 mla", sc.dsv3_tokens)]
    return [_of_ceiling(f"same-host path >= 0.7x d2d copy, {group} {t} tokens {sc.ids} ids (GB/s at p50)",
                        _find(rows, group, "kvlc ipc", kind="handover", tokens=t, ids=sc.ids), 0.7,
                        "kvlc ipc row or d2d copy missing or failed",
                        lambda k: f" (ipc requests: {k.get('ipc')})")
            for group, t in wanted]


def _t_flight(rows, sc) -> list[dict]:
    """The same-host target on the random-id handovers with ``sc.flight`` requests at once (case 5)."""
    wanted = [("llama-3.1-8b", t) for t in sc.handover_tokens] + [("deepseek-v3 mla", sc.dsv3_tokens)]
    out = []
    for group, t in wanted:
        for batched, how in ((False, "in flight, one write() each"), (True, "per write_many")):
            k = _find(rows, group, "kvlc ipc", kind="bulk", tokens=t, ids=sc.ids, batched=batched)
            if k is None:  # case 5 not selected
                continue
            out.append(_of_ceiling(f"same-host path >= 0.7x d2d copy, {group} {t} tokens {sc.ids} ids, {sc.flight} "
                                   f"{how} (median round GB/s)", k, 0.7, "kvlc ipc row or d2d copy missing or failed",
                                   lambda k: f" (ipc requests: {k.get('ipc')})"))
    return out


def _t_mixed(rows, sc) -> list[dict]:
    return [_of_ceiling(f"mixed DRAM->VRAM >= 0.8x pinned host->device copy, all rounds [{mode}]",
                        _find(rows, "mixed dram->vram", mode, kind="rounds"), 0.8,
                        "kvlc row or h2d copy missing or failed",
                        lambda k: f" overall; first round {k['gbps_first_round']:.1f} GB/s")
            for mode in ("kvlc nixl", "kvlc ipc")]


# ----------------------------------------------------------------------------- output
def _cell(v, fmt: str = "{:,.1f}") -> str:
    return "-" if v is None else (fmt.format(v) if isinstance(v, (int, float)) else str(v))


def print_table(doc: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=f"gpu suite: {doc['machine']['gpu']}", show_lines=False)
    for col in ("case", "mode", "p50 us", "p99 us", "GB/s", "x d2d", "desc/req", "check", "ipc", "note"):
        t.add_column(col, justify="left" if col in ("case", "mode", "note") else "right")
    for r in doc["rows"]:
        first = f"first round {r['gbps_first_round']:,.1f} GB/s" if "gbps_first_round" in r else ""
        note = r.get("error") or first
        check = r.get("check", "-")
        t.add_row(escape(r["case"]), escape(r["mode"]), _cell(r.get("p50_us"), "{:,.0f}"),
                  _cell(r.get("p99_us"), "{:,.0f}"),
                  _cell(r.get("gbps")), _cell(r.get("fraction_of_d2d"), "{:.2f}"),
                  _cell(r.get("descriptors_per_request"), "{:,.0f}"),
                  f"[red]{check}[/red]" if check == "FAIL" else check,
                  _cell(r.get("ipc")) if r.get("ipc_ok", True) else f"[red]{r.get('ipc')}[/red]",
                  f"[red]{escape(note[:80])}[/red]" if "error" in r else escape(note))
    console = Console(width=200)
    console.print(t)
    for c in doc["checks"]:
        mark = "[green]pass[/green]" if c["verdict"] == "pass" else "[red]FAIL[/red]"
        problems = escape("; " + str(c["problems"][:1])) if c["problems"] else ""
        console.print(f"check {escape(c['group'])} {escape('[' + c['mode'] + ']')} {c['direction']}: {mark} "
                      f"({c['checked_bytes']:,} bytes{problems}; ipc {c.get('ipc', '-')})")
    for e in doc["errors"]:
        where = escape(f"{e['group']} [{e['mode']}]")
        console.print(f"[red]error[/red] {where}: {escape(e['error'])}")
    for v in doc["targets"]:
        color = {"met": "green", "missed": "red"}.get(v["verdict"], "yellow")
        console.print(f"[{color}]{v['verdict']}[/{color}]: {escape(v['target'])} ({escape(v['detail'])})")


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"d2d copy": "#d62728", "d2d gather+scatter": "#ff9896", "h2d copy": "#ff7f0e",
              "raw nixl": "#7f7f7f", "raw nixl sgl": "#c7c7c7", "kvlc nixl": "#1f77b4", "kvlc ipc": "#2ca02c"}
    order = {m: i for i, m in enumerate(colors)}
    names = list(dict.fromkeys(r["case"] for r in doc["rows"]))
    rows = sorted((r for r in doc["rows"] if r.get("gbps")), key=lambda r: (names.index(r["case"]),
                                                                            order.get(r["mode"], 99)))
    lat = [r for r in rows if r.get("p50_us")]
    labels = {"p50_us": "latency per request, µs (bar p50, whisker p99; log)",
              "gbps": "GB/s (bytes once; log): at p50, median round, all rounds (mixed)"}
    panels = [(sel, key) for sel, key in ((lat, "p50_us"), (rows, "gbps")) if sel]  # (only bulk cases: no latency)
    if not panels:
        raise ValueError("no row has a rate to plot")
    fig, axes = plt.subplots(1, len(panels), figsize=(8 * len(panels), max(5, 0.22 * len(rows) + 2)), squeeze=False)
    for ax, (sel, key) in zip(axes[0], panels):
        whisker = None if key != "p50_us" else [[0] * len(sel), [max(0.0, r["p99_us"] - r["p50_us"])
                                                               for r in sel]]
        ax.barh(range(len(sel)), [r[key] for r in sel], color=[colors.get(r["mode"], "#9467bd") for r in sel],
                xerr=whisker)
        ax.set_yticks(range(len(sel)), [f"{r['case'][:60]} [{r['mode']}]" for r in sel], fontsize=6)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel(labels[key])
    fig.suptitle(f"gpu suite: {doc['machine']['gpu']}, {doc['when']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _expect_ipc(groups: list, gpu: bool) -> dict:
    """Groups where KVLC_IPC=auto must copy: on a GPU every group (VRAM through CUDA IPC; the mixed
    group's pinned DRAM read in place by the initiator's kernel), on the CPU one memory type on both
    sides in DRAM the engines share (kvlc's shared-memory DRAM, when this kvlc has it). On a GPU, a
    VRAM-to-VRAM request of fewer rows than ``AgentSettings.ipc_min_rows`` goes through NIXL: for
    those groups the value is that row count (requests from it up must copy)."""
    import dataclasses

    from kvlc.demo.procs import EngineConfig
    from kvlc.runtime.settings import AgentSettings

    shared = "shared" in {f.name for f in dataclasses.fields(EngineConfig)}
    floor = getattr(AgentSettings.model_fields.get("ipc_min_rows"), "default", 0) or 0
    out = {}
    for g in groups:
        want = bool(g.plans) and (gpu or (g.same_memory and shared))
        out[g.name] = floor if want and gpu and g.same_memory and floor else want
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(HERE / "results" / "gpu-suite.json"))
    ap.add_argument("--device", choices=("gpu", "cpu"), default="gpu",
                    help="cpu: a dry run on DRAM, tiny pools")
    ap.add_argument("--only", default="",
                    help="comma-separated cases: handover, deepseek, bulk, mixed, flight (or 1-5)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of: {', '.join(MODES)}")
    ap.add_argument("--quick", action="store_true", help="fewer requests and rounds")
    ap.add_argument("--tokens", default="",
                    help="the Llama handovers' tokens, comma-separated (default 1024,2048,4096)")
    ap.add_argument("--dsv3-tokens", type=int, default=0, help="the DeepSeek-V3 MLA handovers' tokens (default 4096)")
    ap.add_argument("--ids", choices=("random", "scattered"), default="random",
                    help="the scattered cases' block ids: the producer's at random (into runs of the consumer's), "
                         "or both sides' at random")
    args = ap.parse_args(argv)
    only = {SELECT.get(w, w) for w in args.only.split(",") if w}
    selected = [m for m in args.modes.split(",") if m]
    bad = (only - set(SELECT.values())) | (set(selected) - set(MODES))
    if bad:
        ap.error(f"unknown case or mode: {', '.join(sorted(bad))}")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    t_start = time.time()
    try:
        tokens = tuple(int(t) for t in args.tokens.split(",") if t)
    except ValueError:
        ap.error(f"--tokens {args.tokens!r}: give whole numbers of tokens, comma-separated (e.g. 1024,8192)")
    if any(t < 1 for t in tokens) or args.dsv3_tokens < 0:
        ap.error("--tokens and --dsv3-tokens: give at least one token per request")
    sc = cases.scale(args.device == "gpu", args.quick, tokens, args.dsv3_tokens, args.ids)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python3", "benchmarks/gpu_suite.py", *sys.argv[1:]])
    doc = {"benchmark": "gpu_suite", "command": command,
           "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": args.device, "quick": args.quick,
           "machine": machine(args), "scale": sc.__dict__, "rows": [], "checks": [], "errors": [],
           "elapsed_s": {}, "targets": []}

    def save():
        out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"native rows: {doc['machine']['native_rows']}; nixl {doc['machine']['nixl']}", flush=True)
    groups = cases.groups(sc, only)
    for g in groups:
        run_group(doc, g, sc, selected, save)
    annotate(doc, _expect_ipc(groups, sc.gpu))
    doc["targets"] = targets(doc, sc)
    doc["elapsed_s"]["total"] = round(time.time() - t_start, 1)
    save()
    print_table(doc)
    try:
        plot(doc, out.with_suffix(".png"))
    except Exception as exc:  # the JSON is what counts
        print(f"plot failed: {exc}")
    print(f"wrote {out} and {out.with_suffix('.png').name}; total {doc['elapsed_s']['total']} s", flush=True)
    return exit_status(doc)


def exit_status(doc: dict) -> int:
    """1 when kvlc failed: a kvlc mode's error (or a group that could not be prepared), a kvlc row not ok,
    or a content check that failed in any mode; else 0. A baseline's error (d2d, raw NIXL) is reported
    (the table, the JSON's ``errors``), not counted: the suite measures kvlc beside what runs here."""
    kvlc_error = [e for e in doc["errors"] if e["mode"] == "prepare" or e["mode"].startswith("kvlc")]
    bad_rows = [r for r in doc["rows"] if r["mode"].startswith("kvlc") and not r["ok"]]
    bad_checks = [c for c in doc["checks"] if c["verdict"] != "pass"]
    baseline = len(doc["errors"]) - len(kvlc_error)
    if baseline:
        print(f"{baseline} baseline error(s) above (not kvlc's): not counted in the exit status", flush=True)
    return 1 if kvlc_error or bad_rows or bad_checks else 0


if __name__ == "__main__":
    sys.exit(main())
