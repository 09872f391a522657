"""GPU: why staging through KvAgent is slower than the staging pair — timelines, profiles, a latency probe.

    python3 benchmarks/probes/gpu_staging_diag.py --out <folder> [--spy <py-spy binary>]

1. **Latency probe** (two processes on one GPU): how long a tiny kernel + synchronize and a
   64 KiB device-to-host copy take in process B while process A is idle, and while A keeps the
   GPU busy with 256 MiB device-to-device copies. Staging needs GPU work in both processes for
   every chunk (gather and WRITE in the sender, range read and scatter in the receiver), so a
   large latency here bounds every staged chunk on a one-GPU machine.
2. **Timelines** (``KVLC_STAGING_TRACE``) of staged transfers through KvAgent (fragmented VRAM
   Llama-3.1-8B push, mixed DeepSeek-V3.2 -> HiSparse push) and through the staging pair, each
   summarized with benchmarks/staging_timeline.py; with ``--spy``, py-spy profiles of both
   engine processes of the KvAgent run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, the suite
sys.path.insert(0, str(Path(__file__).resolve().parent))  # probes/

MiB = 1 << 20


def _busy(conn, seconds: float, kind: str) -> None:
    """Keep the GPU busy from another process: 256 MiB ``copy_`` (kind "copies") or ``index_select``
    gathers of 4,096 x 64 KiB rows (kind "kernels"), four queued at a time."""
    import torch

    a = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    rows, ids = a.view(torch.int64).view(4096, -1), torch.randperm(4096, device="cuda")
    torch.cuda.synchronize()
    conn.send("ready")
    if conn.recv() == "go":  # until told to stop (or ``seconds`` at most)
        t_end = time.monotonic() + seconds
        n = 0
        while time.monotonic() < t_end and not conn.poll():
            for _ in range(4):
                if kind == "copies":
                    b.copy_(a)
                else:
                    torch.index_select(rows, 0, ids, out=b.view(torch.int64).view(4096, -1))
            torch.cuda.synchronize()
            n += 4
        conn.send(n)


def _steps(device: str) -> dict:
    """The probe's steps (``device="cpu"``: the same calls without CUDA, a dry run of this script)."""
    import torch

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    x = torch.zeros(1, device=device)
    y = torch.zeros(64 * 1024, dtype=torch.uint8, device=device)
    z = torch.empty_like(y)
    rows, src = (torch.zeros(64, 1024, dtype=torch.int64, device=device) for _ in range(2))
    idx = torch.arange(0, 64, 2, device=device)
    pinned = torch.zeros(64 * 1024, dtype=torch.uint8)
    pinned = pinned.pin_memory() if cuda else pinned
    side = torch.cuda.Stream() if cuda else None

    def side_kernel():
        with torch.cuda.stream(side):
            x.add_(1)
            ev = torch.cuda.Event()
            ev.record()
        while not ev.query():
            pass

    steps = {
        "kernel+sync": lambda: (x.add_(1), sync()),
        "d2h 64 KiB": lambda: y.cpu(),
        "d2d copy_ 64 KiB+sync": lambda: (z.copy_(y), sync()),
        "launch index_copy_ (call only)": lambda: rows.index_copy_(0, idx, src[:32]),
        "pinned h2d 64 KiB non_blocking (call only)": lambda: y.copy_(pinned, non_blocking=True),
    }
    if cuda:
        steps["side-stream kernel+event"] = side_kernel
        steps["event create+record (call only)"] = lambda: torch.cuda.Event().record()
    return steps


def _probe(n: int = 300, device: str = "cuda", batch: bool = True) -> dict:
    import torch

    out = {}
    for what, step in _steps(device).items():
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            step()
            ts.append((time.perf_counter() - t0) * 1e6)
        if device == "cuda":
            torch.cuda.synchronize()
        ts.sort()
        out[what] = {"median_us": round(ts[len(ts) // 2], 1), "p90_us": round(ts[int(len(ts) * 0.9)], 1),
                     "max_us": round(ts[-1], 1)}
    if device == "cuda" and batch:
        out["batched copy-engine gather"] = _in_child(_batch_gather)
    return out


def _child(conn, fn) -> None:
    try:
        conn.send(fn())
    except Exception as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})


def _in_child(fn, timeout: float = 60.0) -> dict:
    """``fn()`` in a spawned process (a crash there, e.g. a wrong C signature, is reported, not fatal)."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_child, args=(b, fn))
    p.start()
    got = a.recv() if a.poll(timeout) else {"error": f"no answer in {timeout} s"}
    p.join(5)
    if p.exitcode not in (0, None):
        got = {"error": f"child exited with {p.exitcode}", **(got if isinstance(got, dict) else {})}
    return got


def _cudart():
    """The CUDA runtime library torch loaded (ctypes), for cudaMemcpyBatchAsync (CUDA 12.8+)."""
    import ctypes

    with open("/proc/self/maps") as fh:
        paths = sorted({line.split()[-1] for line in fh if "libcudart.so" in line})
    return ctypes.CDLL(paths[0]) if paths else ctypes.CDLL("libcudart.so.13")


def _batch_gather(blocks: int = 4086, block: int = 64 << 10) -> dict:
    """4,086 x 64 KiB random blocks gathered by ONE cudaMemcpyBatchAsync (copy engines) vs index_select
    (a kernel): time per call and to completion, bytes checked against each other."""
    import ctypes

    import numpy as np
    import torch

    class Loc(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

    class Attr(ctypes.Structure):
        _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", Loc), ("dstLocHint", Loc), ("flags", ctypes.c_uint)]

    try:
        fn = _cudart().cudaMemcpyBatchAsync
    except (OSError, AttributeError) as exc:
        return {"error": f"no cudaMemcpyBatchAsync: {exc}"}
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(Attr),
                   ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    dev = torch.cuda.current_device()
    pool = torch.randint(0, 255, (blocks * 4 * block,), dtype=torch.uint8, device="cuda")
    ids = np.random.default_rng(0).permutation(blocks * 4)[:blocks]
    out_ce, out_k = torch.zeros(blocks * block, dtype=torch.uint8, device="cuda"), torch.zeros(blocks * block, dtype=torch.uint8, device="cuda")
    srcs = (np.uint64(pool.data_ptr()) + ids.astype(np.uint64) * np.uint64(block)).astype(np.uint64)
    dsts = (np.uint64(out_ce.data_ptr()) + np.arange(blocks, dtype=np.uint64) * np.uint64(block)).astype(np.uint64)
    sizes = np.full(blocks, block, dtype=np.uint64)
    attr = Attr(1, Loc(1, dev), Loc(1, dev), 0)  # source in stream order; locations: this device
    at = np.zeros(1, dtype=np.uint64)
    stream = torch.cuda.current_stream().cuda_stream
    view = pool.view(torch.int64).view(blocks * 4, block // 8)
    wide = pool.view(torch.complex128).view(blocks * 4, block // 16)
    tids = torch.from_numpy(ids).cuda()
    kernels = {  # the indexed copies kvlc.runtime.staging.copy issues, at both element widths it uses on a GPU
        "index_select": lambda: torch.index_select(view, 0, tids, out=out_k.view(torch.int64).view(blocks, block // 8)),
        "index_select complex128": lambda: torch.index_select(wide, 0, tids,
                                                              out=out_k.view(torch.complex128).view(blocks, block // 16)),
        "index_copy_ int64": lambda: view.index_copy_(0, tids, out_k.view(torch.int64).view(blocks, block // 8)),
        "index_copy_ complex128": lambda: wide.index_copy_(0, tids, out_k.view(torch.complex128).view(blocks, block // 16)),
    }
    res = {}
    for label in ("copy engines", *kernels):
        calls, totals = [], []
        for _ in range(20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if label == "copy engines":
                rc = fn(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, blocks, ctypes.byref(attr), at.ctypes.data,
                        1, stream)
                if rc:
                    res[label] = {"error": f"cudaMemcpyBatchAsync returned {rc}"}
                    break
            else:
                kernels[label]()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            calls.append((t1 - t0) * 1e6)
            totals.append((time.perf_counter() - t0) * 1e6)
        if label in res:
            continue
        calls.sort()
        totals.sort()
        res[label] = {"call_us": round(calls[10], 1), "total_us": round(totals[10], 1),
                      "gbps": round(blocks * block / (totals[10] / 1e6) / 1e9, 1)}
        if label == "index_select":
            res["same bytes"] = bool(torch.equal(out_ce, out_k))
    return res


def latency_probe() -> dict:
    import torch

    torch.zeros(1, device="cuda")
    _probe(20, batch=False)
    result = {"alone": _probe()}
    ctx = mp.get_context("spawn")
    for kind in ("copies", "kernels"):
        a, b = ctx.Pipe()
        p = ctx.Process(target=_busy, args=(b, 60.0, kind))
        p.start()
        assert a.recv() == "ready"
        if kind == "copies":
            result["other process idle (context open)"] = _probe()
        a.send("go")
        time.sleep(0.2)
        result[f"other process busy ({kind})"] = _probe()
        a.send("stop")
        result[f"busy {kind} done"] = a.recv()
        p.join()
    return result


def _spy(binary: str | None, out: Path, tag: str):
    """Start py-spy on every engine process the demo spawns from now on; returns (undo, procs)."""
    from kvlc.demo import procs

    spies: list = []
    if not binary:
        return (lambda: None), spies
    orig = procs.EngineProcess.__init__

    def init(self, *a, **k):
        orig(self, *a, **k)
        path = out / f"spy-{tag}-{len(spies)}.txt"
        spies.append(subprocess.Popen([binary, "record", "-r", "500", "-p", str(self.process.pid), "-o", str(path),
                                       "-f", "raw", "--threads", "--idle", "--nonblocking"],
                                      stdout=subprocess.DEVNULL, stderr=open(str(path) + ".err", "w")))
    procs.EngineProcess.__init__ = init

    def undo():
        procs.EngineProcess.__init__ = orig
        for s in spies:
            try:
                s.wait(timeout=60)
            except subprocess.TimeoutExpired:
                s.kill()
    return undo, spies


def timeline(out: Path, tag: str, run, spy: str | None = None) -> dict:
    from staging_timeline import load, summarize

    folder = out / f"trace-{tag}"
    os.environ["KVLC_STAGING_TRACE"] = str(folder)
    undo, _ = _spy(spy, out, tag)
    try:
        res = run()
    finally:
        os.environ.pop("KVLC_STAGING_TRACE", None)
        undo()
    summary = summarize(load(folder)) if folder.exists() else {}
    row = {"case": tag, **res, "timeline": summary}
    print(json.dumps(row), flush=True)
    return row


def _demo(**kw) -> dict:
    from kvlc.demo.run import run_demo

    r = run_demo(**kw)
    return {"ok": r.ok, "gbps": round(r.gbps, 2), "requests": r.requests, "seconds": r.seconds,
            "descriptors_per_request": r.descriptors_per_request, "failed": dict(list(r.failed.items())[:3])}


def _pair() -> dict:
    from gpu_staging import BLOCK, FRAG, LAYERS, _staged
    from testkit.staging_pair import Pair, Side, fragmented

    pool = (LAYERS * 32 * MiB,)
    reqs = [fragmented(1, 1, FRAG, BLOCK, pool[0] // BLOCK, seed=s) for s in range(8)]
    pair = Pair(Side(pool, ("VRAM",), 0, 128 * MiB, 4, fill=False), Side(pool, ("VRAM",), 0, 128 * MiB, 4, fill=False))
    try:
        pair.staged(reqs[:1])
        return _staged(pair, reqs)
    finally:
        pair.stop()


def _slot_settings(spec: str) -> list[tuple[str, dict]]:
    """``default,4x128,8x64``: the policy's own slots, then slots x MiB each (KVLC_STAGING_SLOTS/_SLOT_BYTES)."""
    out = []
    for item in spec.split(","):
        if item == "default":
            out.append(("default", {}))
        else:
            n, mib = item.split("x")
            out.append((item, {"KVLC_STAGING_SLOTS": n, "KVLC_STAGING_SLOT_BYTES": str(int(mib) * MiB)}))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--spy", default=None, help="py-spy binary: profile the KvAgent run's engine processes")
    ap.add_argument("--skip-probe", action="store_true")
    ap.add_argument("--slots", default="default", help="bounce slot settings to time, e.g. default,4x128,8x64")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    if not args.skip_probe:
        rows.append({"case": "latency probe", **latency_probe()})
        print(json.dumps(rows[-1]), flush=True)
    llama, mixed = "layouts/llama-3.1-8b.yaml", ("layouts/deepseek-v3.2-tp8.yaml", "layouts/deepseek-v3.2-hisparse-tp8.yaml")
    for label, env in _slot_settings(args.slots):
        os.environ.update({"KVLC_STAGING": "auto", **env})
        first = label == "default"
        rows.append(timeline(args.out, f"kvagent-llama-random-push-{label}", lambda: _demo(
            layout=llama, consumer_layout=llama, mode="push", requests=16, tokens=2048, max_bytes=1 << 30,
            device="gpu", check="none", fill="zeros", ids="random", timeout=300.0), args.spy if first else None))
        rows.append(timeline(args.out, f"kvagent-mixed-push-{label}", lambda: _demo(
            layout=mixed[0], consumer_layout=mixed[1], mode="push", requests=4, tokens=512, max_bytes=256 << 20,
            device="gpu", check="none", fill="zeros", ids="contiguous", timeout=300.0), args.spy if first else None))
        for k in env:
            os.environ.pop(k, None)
    rows.append(timeline(args.out, "pair-fragmented-4x128MiB", _pair))
    (args.out / "diag.json").write_text(json.dumps(rows, indent=1))
    with tarfile.open(args.out / "traces.tar.gz", "w:gz") as tar:
        for p in sorted(args.out.iterdir()):
            if p.name.startswith(("trace-", "spy-")):
                tar.add(p, arcname=p.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
