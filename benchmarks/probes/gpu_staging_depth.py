"""GPU: staged fragmented push by slot geometry, through KvAgent and through the bare staging pair.

The same shape both ways: 256 MiB requests of 4,084-4,086 scattered 64 KiB blocks, VRAM -> VRAM,
two processes on one GPU. KvAgent rows are the demo's Llama-3.1-8B push with random block ids
(1 GiB pools: 4 requests in flight per round, 16 requests), the automatic gate staging them; the
pair rows (``testkit.staging_pair``, no KvAgent: both processes spin on their endpoint) send
8 requests at once. Each geometry (slots x slot bytes: ``KVLC_STAGING_SLOTS`` /
``KVLC_STAGING_SLOT_BYTES`` for KvAgent) runs on both, so a gap between the two is the agent's,
not the GPU's. Then mixed DRAM/VRAM with one rank per side: DeepSeek-V3.2 -> HiSparse at TP1
(the TP8 layouts with ``tp_size: 1``, as with data-parallel attention: MLA's latent is the same on
every rank), push and pull via push, beside the pinned host<->device copy ceiling.

Run (from the repository root):  python3 benchmarks/probes/gpu_staging_depth.py [--device cpu] [--out OUT.json]
                                 python3 benchmarks/probes/gpu_staging_depth.py --mixed 4x32,8x32,16x16 (mixed rows only)
                                 python3 benchmarks/probes/gpu_staging_depth.py --direct-ab (direct chunks on / off)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, the suite
sys.path.insert(0, str(Path(__file__).resolve().parent))  # probes/

MiB = 1 << 20
GEOMETRIES = ((4, 32 * MiB), (1, 256 * MiB), (2, 128 * MiB), (8, 32 * MiB))


def tp1(layout: str, tmp: Path) -> str:
    """``layout`` (a path) with ``parallel.tp_size`` 1."""
    data = yaml.safe_load(Path(layout).read_text())
    data["parallel"]["tp_size"] = 1
    data["name"] = data["name"] + "-as-tp1"
    out = tmp / (Path(layout).stem + "-tp1.yaml")
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(out)


def agent_row(name: str, env: dict, **kw) -> dict:
    """One timed KvAgent run (no byte check) with ``env`` in the engines' environment (gpu_kvlc_staging._run)."""
    from gpu_kvlc_staging import _run

    rows: list[dict] = []
    _run(rows, name, env, check="none", fill="zeros", timeout=300.0, **kw)
    return rows[0]


def pair_rows(device: int | None, scale: int) -> list[dict]:
    import gpu_staging

    from testkit.staging_pair import Pair, Side, fragmented

    rows: list[dict] = []
    block = 64 << 10
    pool = ((1 << 30) // scale,)
    n = 4086 // scale
    reqs = [fragmented(1, 1, n, block, pool[0] // block, seed=s) for s in range(8)]
    for slots, size in GEOMETRIES:
        size //= scale
        pair = Pair(Side(pool, (), device, size, slots, fill=False), Side(pool, (), device, size, slots, fill=False))
        try:
            pair.staged(reqs[:1])  # warm
            gpu_staging._guard(rows, f"pair staged VRAM -> VRAM fragmented [{slots} x {size // MiB} MiB]",
                               lambda: gpu_staging._staged(pair, reqs))
        finally:
            pair.stop()
    return rows


def pair_name(layouts: tuple[str, str]) -> str:
    """``"deepseek-v3.2 -> hisparse"`` or, reversed, ``"hisparse -> deepseek-v3.2"``."""
    return "hisparse -> deepseek-v3.2" if "hisparse" in Path(layouts[0]).name else "deepseek-v3.2 -> hisparse"


def _geometries(text: str) -> list[tuple[int, int]]:
    """``"4x32,8x32"`` -> [(4, 32 MiB), (8, 32 MiB)]."""
    out = []
    for item in text.split(","):
        slots, _, mib = item.strip().partition("x")
        if not (slots.isdigit() and mib.isdigit() and int(slots) > 0 and int(mib) > 0):
            raise SystemExit(f"--mixed: {item!r} is not SLOTSxMIB (e.g. 8x32)")
        out.append((int(slots), int(mib) * MiB))
    return out


def mixed_rows(device: str, scale: int, layouts: tuple[str, str], geometries, extra: dict | None = None,
               label: str = "") -> list[dict]:
    """Mixed DRAM/VRAM at TP1 through KvAgent (DeepSeek-V3.2 -> HiSparse), push and pull via push, per geometry."""
    rows = []
    for mode in ("push", "pull_via_push"):
        for slots, size in geometries:
            env = {"KVLC_STAGING": "auto", "KVLC_STAGING_SLOTS": str(slots), "KVLC_STAGING_SLOT_BYTES": str(size // scale),
                   **(extra or {})}
            tag = f", {label}" if label else ""
            rows.append(agent_row(f"kvlc staged mixed {pair_name(layouts)} TP1 {mode} [{slots} x {size // scale // MiB} MiB{tag}]",
                                  env, layout=layouts[0], consumer_layout=layouts[1], mode=mode, requests=8,
                                  tokens=4096 // scale, max_bytes=(1 << 30) // scale, device=device, ids="contiguous"))
    return rows


def direct_ab(device: str, scale: int, layouts: tuple[str, str], what: str = "all") -> list[dict]:
    """Mixed TP1 with chunks written from their sources (default) against gathered (``KVLC_STAGING_DIRECT_BYTES=0``):
    content-coded checks (every chunk direct: ``KVLC_STAGING_DIRECT_BYTES=1``, as the checked requests'
    ranges are short; contiguous and random ids), then timed rows."""
    from gpu_kvlc_staging import _run

    rows: list[dict] = []
    for mode in ("push", "pull_via_push") if what in ("all", "checks") else ():
        for ids in ("contiguous", "random"):
            _run(rows, f"kvlc staged mixed {pair_name(layouts)} TP1 {mode} {ids} ids [every chunk direct] check",
                 {"KVLC_STAGING": "auto", "KVLC_STAGING_DIRECT_BYTES": "1"}, layout=layouts[0],
                 consumer_layout=layouts[1], mode=mode, requests=4, tokens=512 // scale,
                 max_bytes=(64 << 20) // scale, device=device, check="all", timeout=120.0, ids=ids)
    for _ in range(2 if what in ("all", "timed") else 0):
        for label, env in (("direct on", {}), ("direct off", {"KVLC_STAGING_DIRECT_BYTES": "0"})):
            rows += mixed_rows(device, scale, layouts, GEOMETRIES[:1], env, label)
    return rows


def traced(device: str, folder: Path, scale: int, llama: str, mixed: tuple[str, str]) -> list[dict]:
    """Traced KvAgent runs (``KVLC_STAGING_TRACE``): fragmented push at 1 x 256 MiB, mixed TP1 push at 4 x 32 MiB."""
    rows = []
    slots, size = GEOMETRIES[1]
    env = {"KVLC_STAGING": "auto" if device == "gpu" else "always", "KVLC_STAGING_SLOTS": str(slots),
           "KVLC_STAGING_SLOT_BYTES": str(size // scale), "KVLC_STAGING_TRACE": str(folder / "fragmented")}
    rows.append(agent_row(f"kvlc staged VRAM llama-3.1-8b push random ids [{slots} x {size // scale // MiB} MiB, traced]",
                          env, layout=llama, consumer_layout=llama, mode="push", requests=16, tokens=2048 // scale,
                          max_bytes=(1 << 30) // scale, device=device, ids="random"))
    env = {"KVLC_STAGING": "auto", "KVLC_STAGING_TRACE": str(folder / "mixed")}
    rows.append(agent_row("kvlc staged mixed deepseek-v3.2 -> hisparse TP1 push [default, traced]", env,
                          layout=mixed[0], consumer_layout=mixed[1], mode="push", requests=8, tokens=4096 // scale,
                          max_bytes=(1 << 30) // scale, device=device, ids="contiguous"))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("gpu", "cpu"), default="gpu", help="cpu: a small dry run on DRAM")
    ap.add_argument("--out", default="")
    ap.add_argument("--trace", default="", help="also one traced KvAgent run (default geometry) into this folder "
                    "(KVLC_STAGING_TRACE; read it with benchmarks/staging_timeline.py)")
    ap.add_argument("--mixed", default="", metavar="SxM,...",
                    help="only the mixed TP1 rows (push and pull via push), at these geometries: slots x slot MiB, "
                    "e.g. 4x32,8x32,16x16")
    ap.add_argument("--direct-ab", choices=("all", "checks", "timed"), default=None,
                    help="only mixed TP1: content checks with direct chunks on (checks), then push / pull via push "
                    "timed with direct chunks on and off (KVLC_STAGING_DIRECT_BYTES=0), alternated twice (timed)")
    ap.add_argument("--reverse", action="store_true",
                    help="with --mixed / --direct-ab: the other direction, HiSparse (host latent) -> DeepSeek-V3.2 (VRAM)")
    ap.add_argument("--traced-only", action="store_true", help="only traced KvAgent runs, one folder each under "
                    "--trace: fragmented push at 1 x 256 MiB, mixed TP1 push at the default geometry")
    args = ap.parse_args(argv)
    from gpu_transfer import DSV32, LLAMA, on_device

    gpu = args.device == "gpu"
    scale = 1 if gpu else 16
    doc: dict = {"benchmark": "gpu_staging_depth", "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                 "command": " ".join(["python3", "benchmarks/probes/gpu_staging_depth.py", *sys.argv[1:]]), "rows": []}
    if gpu:
        from gpu_transfer import ceilings

        doc["torch_copy_gbps"] = ceilings(0, 0)

    def save():
        if args.out:
            Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        llama = on_device(LLAMA, 0, t) if gpu else LLAMA
        dp, dc = (tp1(str(ROOT / x), t) for x in (DSV32[::-1] if args.reverse else DSV32))
        if gpu:
            dp, dc = on_device(dp, 0, t), on_device(dc, 0, t)
        if args.direct_ab:
            doc["rows"] += direct_ab(args.device, scale, (dp, dc), args.direct_ab)
            save()
            return 0 if all(r.get("ok", True) and "error" not in r for r in doc["rows"]) else 1
        if args.mixed:
            doc["rows"] += mixed_rows(args.device, scale, (dp, dc), _geometries(args.mixed))
            save()
            return 0 if all(r.get("ok", True) and "error" not in r for r in doc["rows"]) else 1
        if args.traced_only:
            doc["rows"] += traced(args.device, Path(args.trace), scale, llama, (dp, dc))
            save()
            return 0 if all(r.get("ok") for r in doc["rows"]) else 1
        for slots, size in GEOMETRIES:
            env = {"KVLC_STAGING": "auto" if gpu else "always", "KVLC_STAGING_SLOTS": str(slots),
                   "KVLC_STAGING_SLOT_BYTES": str(size // scale)}
            doc["rows"].append(agent_row(f"kvlc staged VRAM llama-3.1-8b push random ids [{slots} x {size // scale // MiB} MiB]",
                                         env, layout=llama, consumer_layout=llama, mode="push", requests=16,
                                         tokens=2048 // scale, max_bytes=(1 << 30) // scale, device=args.device,
                                         ids="random"))
            save()
        if args.trace:
            slots, size = GEOMETRIES[0]
            env = {"KVLC_STAGING": "auto" if gpu else "always", "KVLC_STAGING_TRACE": args.trace}
            doc["rows"].append(agent_row(f"kvlc staged VRAM llama-3.1-8b push random ids [{slots} x {size // scale // MiB} MiB, traced]",
                                         env, layout=llama, consumer_layout=llama, mode="push", requests=16,
                                         tokens=2048 // scale, max_bytes=(1 << 30) // scale, device=args.device,
                                         ids="random"))
        doc["rows"] += pair_rows(0 if gpu else None, scale)
        save()
        doc["rows"] += mixed_rows(args.device, scale, (dp, dc), GEOMETRIES[:2])
        save()
    return 0 if all(r.get("ok", True) and "error" not in r for r in doc["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
