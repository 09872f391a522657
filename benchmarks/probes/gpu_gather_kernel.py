"""GPU: the staging gather and scatter alone, in one process, on the regions a KvAgent registers.

Llama-3.1-8B scaled to a 1 GiB pool on cuda:0 (the demo's layout: its storages allocated as
KvAgent allocates them), a request of 4,084 random 64 KiB rows over every storage, a 256 MiB
bounce span. Times, with CUDA events (median of 20, after 3 untimed):

* ``Copier.gather`` / ``Copier.scatter`` (kvlc.runtime.staging.copy, as staging runs them, index
  upload included), once on the default stream and once on a side stream, and the host's time in
  each call alone (``host us``);
* the same rows by ``torch.index_select`` / ``index_copy_`` over a plain row view with int64 and
  16-byte (complex128) elements (no upload), and one ``copy_`` of 256 MiB (the ceiling);
* a Triton row kernel (int64 rows) for comparison;
* optionally the same with another process holding an idle CUDA context (``--idle-peer``);
  ``--profile`` instead prints a cProfile of 50 Copier gathers and scatters (host time).

Run (from the repository root):  python3 benchmarks/probes/gpu_gather_kernel.py [--idle-peer] [--profile] [--out OUT.json]
(``--device cpu``: a dry run on DRAM)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, the suite
sys.path.insert(0, str(Path(__file__).resolve().parent))  # probes/

MiB = 1 << 20
ROW = 64 << 10
ROWS = 4084


def _idle(ready, stop) -> None:  # pragma: no cover - child process
    import torch

    torch.zeros(1, device="cuda:0")
    torch.cuda.synchronize()
    ready.set()
    stop.wait(600)


def timed(fn, reps: int = 20) -> float:
    """Median µs of ``fn`` between CUDA events on the current stream (3 untimed calls first); on the
    CPU (``--device cpu``, a dry run) by the host clock."""
    import torch

    for _ in range(3):
        fn()
    out = []
    if not torch.cuda.is_available():
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e6)
        return float(np.median(out))
    torch.cuda.synchronize()
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    return float(np.median(out))


def host_time(fn, reps: int = 20) -> float:
    """Median µs the host spends in ``fn`` (the call only; the GPU is synchronized between calls)."""
    import torch

    out = []
    for _ in range(reps + 3):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return float(np.median(out[3:]))


def triton_rows(view, idx, out, scatter: bool = False):
    """A Triton kernel moving whole int64 rows: ``out[i] = view[idx[i]]`` (or the reverse), one
    program per (row, 8 KiB piece); built at first use (None without Triton)."""
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _rows(src, dst, rows, E: tl.constexpr, BLOCK: tl.constexpr, SCATTER: tl.constexpr):
            r = tl.program_id(0)
            c = tl.program_id(1)
            far = tl.load(rows + r).to(tl.int64) * E
            near = r.to(tl.int64) * E
            offs = c * BLOCK + tl.arange(0, BLOCK)
            if SCATTER:
                tl.store(src + far + offs, tl.load(dst + near + offs))
            else:
                tl.store(dst + near + offs, tl.load(src + far + offs))

        _KERNEL = _rows
    e = view.shape[1]
    _KERNEL[(len(idx), e // 1024)](view, out, idx, E=e, BLOCK=1024, SCATTER=scatter)


_KERNEL = None


def setup(gpu: bool):
    import torch

    from gpu_transfer import LLAMA, on_device
    from kvlc.runtime.binding import allocate
    from kvlc.runtime.staging.copy import Region, Regions, flat_bytes
    from kvlc.demo.run import scaled_plan

    import tempfile

    lp = on_device(LLAMA, 0, Path(tempfile.mkdtemp())) if gpu else LLAMA
    plan = scaled_plan(lp, (1 << 30) if gpu else (64 << 20), to_dram=not gpu)
    tensors = allocate(plan)
    regions = [Region(int(t.data_ptr()), t.numel() * t.element_size(), flat_bytes(t)) for t in tensors.values()]
    rng = np.random.default_rng(0)
    per = -(-ROWS // len(regions))
    rows = []
    for r in regions:
        slots = r.nbytes // ROW
        for k in rng.choice(slots, min(per, slots), replace=False):
            rows.append((r.base + int(k) * ROW, ROW))
    rows = np.array(rows[:ROWS], dtype=np.uint64)
    bounce = torch.empty(len(rows) * ROW, dtype=torch.uint8, device="cuda:0" if gpu else "cpu")
    return tensors, Regions(regions), rows, bounce


def cases(idle_peer: bool, gpu: bool) -> dict:
    import torch

    from kvlc.runtime.staging.copy import Copier

    tensors, regions, rows, bounce = setup(gpu)
    dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
    n = len(rows) * ROW
    res = {"rows": len(rows), "bytes": n, "regions": len(regions.regions), "idle_peer": idle_peer}
    for label, stream in (("default stream", None), ("side stream", torch.cuda.Stream() if gpu else None)):
        cp = Copier(regions, stream)
        cp.warm(dev)

        def run(f, stream=stream):
            if stream is None:
                return timed(f)
            with torch.cuda.stream(stream):
                return timed(f)
        res[f"Copier.gather us [{label}]"] = run(lambda: cp.gather(rows, bounce))
        res[f"Copier.gather host us [{label}]"] = host_time(lambda: cp.gather(rows, bounce))
        res[f"Copier.scatter host us [{label}]"] = host_time(lambda: cp.scatter(bounce, rows))
        res[f"Copier.scatter us [{label}]"] = run(lambda: cp.scatter(bounce, rows))
        calls = cp.calls
        cp.gather(rows, bounce)
        res[f"copy calls per gather [{label}]"] = cp.calls - calls
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors.values()])  # one region, same bytes
    idx = torch.from_numpy(np.random.default_rng(1).choice(flat.numel() // ROW, len(rows), replace=False)).to(dev)
    for name, dtype, w in (("int64", torch.int64, 8), ("complex128", torch.complex128, 16)):
        view = flat.view(dtype).view(-1, ROW // w)
        out = bounce.view(dtype).view(-1, ROW // w)
        res[f"index_select us [{name}]"] = timed(lambda: torch.index_select(view, 0, idx, out=out))
        res[f"index_copy_ us [{name}]"] = timed(lambda: view.index_copy_(0, idx, out))
    if gpu:
        view, out = flat.view(torch.int64).view(-1, ROW // 8), bounce.view(torch.int64).view(-1, ROW // 8)
        try:
            res["triton gather us [int64]"] = timed(lambda: triton_rows(view, idx, out))
            res["triton scatter us [int64]"] = timed(lambda: triton_rows(view, idx, out, scatter=True))
            check = torch.index_select(view, 0, idx)
            triton_rows(view, idx, out)
            res["triton gather equals index_select"] = bool(torch.equal(check, out[:len(idx)]))
        except Exception as exc:  # a Triton problem must not cost the other rows
            res["triton error"] = f"{type(exc).__name__}: {exc}"[:500]
    src = flat[:n]
    res["copy_ 256 MiB us"] = timed(lambda: bounce.copy_(src))
    for k in list(res):
        if isinstance(res[k], float) and (k.endswith(" us") or " us [" in k) and "host" not in k:
            res[k.replace(" us", " GB/s")] = n / (res[k] * 1e-6) / 1e9
    return res


def profile(gpu: bool) -> int:
    """Where the host time of Copier.gather / scatter goes (cProfile, 50 of each, on the default stream)."""
    import cProfile
    import pstats

    import torch

    from kvlc.runtime.staging.copy import Copier

    _, regions, rows, bounce = setup(gpu)
    cp = Copier(regions)
    cp.warm(torch.device("cuda", 0) if gpu else torch.device("cpu"))
    for _ in range(3):
        cp.gather(rows, bounce)
        cp.scatter(bounce, rows)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(50):
        cp.gather(rows, bounce)
        cp.scatter(bounce, rows)
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--idle-peer", action="store_true")
    ap.add_argument("--device", choices=("gpu", "cpu"), default="gpu", help="cpu: a dry run on DRAM")
    ap.add_argument("--out", default="")
    ap.add_argument("--profile", action="store_true", help="only: cProfile of 50 Copier gathers and scatters")
    args = ap.parse_args(argv)
    if args.profile:
        return profile(args.device == "gpu")
    out = []
    for idle in ((False, True) if args.idle_peer else (False,)):
        ctx = mp.get_context("spawn")
        ready, stop = ctx.Event(), ctx.Event()
        child = ctx.Process(target=_idle, args=(ready, stop)) if idle else None
        if child:
            child.start()
            ready.wait(60)
        try:
            t0 = time.time()
            row = cases(idle, args.device == "gpu")
            row["wall_s"] = round(time.time() - t0, 1)
        finally:
            if child:
                stop.set()
                child.join(10)
        out.append(row)
        print(json.dumps(row, indent=1), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
