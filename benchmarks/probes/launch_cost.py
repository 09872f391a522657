"""What each host call of a same-host copy's start costs on a GPU host (``GpuCopy``: kvlc/runtime/ipc/copy.py).

One process, one GPU, a scratch buffer of its own (no peer): the calls a request's ``post`` makes on the
copy path, each timed alone as the median of ``--calls`` calls (the GPU drained between batches, so no
queue fills), beside a torch op's launch on the same stream for scale:

* ``event``: ``torch.cuda.Event()``; ``record``: ``Event.record(stream)``; ``wait_event``: ``Stream.wait_event``;
  ``query``: ``Event.query()`` of a recorded event;
* ``caller_stream``: ``GpuCopy._caller_stream()`` (the caller's current stream, kept while it stays);
* ``ring``: ``_Ring.take`` and ``used`` of a 64-word span; ``upload``: ``GpuCopy._upload`` of 96 words;
* ``launch``: the kept compiled kernel's direct launch of ``copy_rows`` (one 64-byte row);
* ``start_rows``: all of it (``GpuCopy.start_rows`` of one 64-byte row: record, wait, upload, launch, event);
* ``start_blocks``: ``GpuCopy.start_blocks`` of a Llama-3.1-8B-like part (32 entries of 32 KiB, 64 random ids a
  side: 64 MiB a launch; the entries on the device already, as the route keeps them);
* ``torch_add``: ``x.add_(1)`` of a one-element tensor (a torch op's launch, for scale);
* ``events``: the event calls GpuCopy chose (``KeptEvents``: the CUDA driver's, the GIL kept; ``TorchEvents``);
  ``kept_record``, ``kept_query``: the driver's event record (a new event) and query; ``kept_launch``: whether the
  kernel is launched through the driver (``cuLaunchKernel``, the GIL kept) after warm-up, ``kept_direct_launch``
  that launch's cost;
* ``one_call``: whether a start is one C call (``table.c``'s ``kvlc_ipc_start``, after warm-up); where it is,
  ``start_rows_one_call_<r>`` / ``start_blocks_one_call_<r>`` and ``..._several_calls_<r>`` (the same start made
  call by call from Python), alternated, ``r`` 1 and 2;
* ``start_rows_<kind>``, with ``kind`` torch (torch's events, Triton's launcher) or kept (the driver's events and
  launch): ``start_rows`` with those calls; ``_beside_waking``:
  with a Python thread beside that wakes every 50 µs and runs a few µs of Python (what kvlc's progress thread does
  while a copy is in flight), also ``start_blocks``; ``_beside_busy``: beside a thread that never blocks (an
  engine's spinning loop), 40 calls, and ``query_<kind>_beside_busy`` (a start and one ask whether it ended): each
  call that lets the GIL go (torch's event and stream calls, Triton's launch) may wait for that thread up to the
  switch interval (5 ms).

Run (a GPU host):  python3 benchmarks/probes/launch_cost.py [--calls 2000] [--out launch-cost.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _median_us(fn, calls: int, sync, batch: int = 50) -> float:
    """Median µs of one ``fn()`` over ``calls`` calls, timed in batches of ``batch`` with ``sync()`` between."""
    for _ in range(batch):
        fn()
    sync()
    per = []
    for _ in range(max(1, calls // batch)):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        per.append((time.perf_counter() - t0) / batch)
        sync()
    return statistics.median(per) * 1e6


def _block_launch(base: int, size: int):
    """A part in block form over the scratch buffer: 32 entries of 32 KiB rows, 64 ids a side (a permutation), the
    local side in the first half, the peer's in the second."""
    from kvlc.runtime.ipc.copy import BlockLaunch

    entries, length, nb = 32, 32 << 10, 64
    half = size // 2
    assert entries * nb * length <= half
    rng = np.random.default_rng(0)
    rows = [(base + e * nb * length, length, base + half + e * nb * length, length, length, 0, 1, 0, 1, 0)
            for e in range(entries)]
    ids = np.concatenate([[3, 3 + nb, nb], rng.permutation(nb), rng.permutation(nb)]).astype(np.int64)
    return BlockLaunch(np.array(rows, dtype=np.int64).reshape(-1), ids, nb, 1, True, True, True)


class _Beside:
    """A Python thread that wakes every 50 µs (``Event.wait``, as kvlc's progress thread while a copy is in flight)
    and runs a few µs of Python each time: every call of the copy's start that lets the GIL go may hand it over."""

    def __init__(self, every: float | None = 50e-6):
        import threading

        self.every, self.stop = every, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.turns = 0

    def _run(self) -> None:
        if self.every is None:  # busy: never blocks (an engine's loop that spins)
            while not self.stop.is_set():
                self.turns += 1
            return
        while not self.stop.wait(self.every):
            self.turns += sum(1 for _ in range(100)) // 100

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def measure(calls: int) -> dict:
    import torch

    from kvlc.runtime.ipc.copy import GpuCopy, row_table
    from kvlc.runtime.ipc.driver import TorchEvents

    gpu = GpuCopy(0, calls="driver")  # (torch's calls are timed beside them below)
    gpu.warm()
    sync = torch.cuda.synchronize
    buf = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda:0")
    base = buf.data_ptr()
    g = row_table(np.array([base], np.uint64), np.array([base + 4096], np.uint64), np.array([64], np.uint64))
    consts = {"BLOCK": gpu.block_words, "WIDE": g.wide, "VEC": gpu.vec and g.vec}
    gpu.start_rows(g)  # the compiled kernel kept
    sync()
    key = ("copy_rows", *consts.values(), gpu.num_warps)
    compiled = gpu._compiled.get(key)
    table = torch.from_numpy(g.table.copy()).to("cuda:0")
    ev = torch.cuda.Event()
    ev.record(gpu.stream)
    words = np.arange(96, dtype=np.int64)
    x = torch.zeros(1, device="cuda:0")

    def ring():
        at = gpu.ring.take(64)
        gpu.ring.used(at, 64, ev)

    def upload():
        at, _, _ = gpu._upload(words)
        if at is not None:
            gpu.ring.used(at, len(words), ev)

    blocks = _block_launch(base, buf.numel())
    gpu.start_blocks(blocks)
    sync()
    out = {
        "event": _median_us(torch.cuda.Event, calls, sync),
        "record": _median_us(lambda: ev.record(gpu.stream), calls, sync),
        "wait_event": _median_us(lambda: gpu.stream.wait_event(ev), calls, sync),
        "query": _median_us(ev.query, calls, sync),
        "caller_stream": _median_us(gpu._caller_stream, calls, sync),
        "ring": _median_us(ring, calls, sync),
        "upload": _median_us(upload, calls, sync),
        "launch": (_median_us(lambda: compiled[(1, 1, 1)](table, 1, *consts.values(), stream=gpu.stream.cuda_stream),
                              calls, sync) if compiled is not None else None),
        "start_rows": _median_us(lambda: gpu.start_rows(g), calls, sync),
        "start_blocks": _median_us(lambda: gpu.start_blocks(blocks), calls // 4, sync, batch=10),
        "torch_add": _median_us(lambda: x.add_(1), calls, sync),
    }
    out["events"] = type(gpu.events).__name__
    out["one_call"] = gpu.one_call_on
    if out["one_call"]:  # the same starts, alternated twice: in one C call, then its calls one by one from Python
        for r in (1, 2):
            for gpu.one_call, tag in ((True, "one_call"), (False, "several_calls")):
                out[f"start_rows_{tag}_{r}"] = _median_us(lambda: gpu.start_rows(g), calls, sync)
                out[f"start_blocks_{tag}_{r}"] = _median_us(lambda: gpu.start_blocks(blocks), calls // 4, sync,
                                                            batch=10)
        gpu.one_call = True
    kinds = {"torch": TorchEvents(torch, gpu._caller_stream)}
    kept = gpu._kept.get(key)
    out["kept_launch"] = gpu.kept_launch and kept is not None
    if gpu.events.kept_gil:
        kinds["kept"] = gpu.events
        out["kept_record"] = _median_us(lambda: gpu.events.recorded(gpu.stream), calls, sync)
        out["kept_query"] = _median_us(lambda: gpu.events._waited.query(), calls, sync)
    if out["kept_launch"]:
        out["kept_direct_launch"] = _median_us(lambda: kept.launch((1, 1, 1), (table.data_ptr(), 1), gpu.stream.cuda_stream),
                                               calls, sync)
    for name, events in kinds.items():  # a copy's start with each kind of event call, alone and beside a thread
        gpu.events = events
        gpu.kept_launch = out["kept_launch"] and name == "kept"  # (torch's events: Triton's launcher too)
        out[f"start_rows_{name}"] = _median_us(lambda: gpu.start_rows(g), calls, sync)
        with _Beside():
            out[f"start_rows_{name}_beside_waking"] = _median_us(lambda: gpu.start_rows(g), calls, sync)
            out[f"start_blocks_{name}_beside_waking"] = _median_us(lambda: gpu.start_blocks(blocks), calls // 4, sync,
                                                                  batch=10)
        with _Beside(every=None):
            out[f"start_rows_{name}_beside_busy"] = _median_us(lambda: gpu.start_rows(g), 40, sync, batch=4)
            out[f"query_{name}_beside_busy"] = _median_us(lambda: gpu.start_rows(g).done(), 40, sync, batch=4)
    gpu.events = kinds.get("kept", kinds["torch"])
    gpu.kept_launch = out["kept_launch"]
    sync()
    out["direct"] = gpu.direct
    out["gpu"] = torch.cuda.get_device_name(0)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    doc = {"command": "launch_cost.py " + " ".join(sys.argv[1:]), "when": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                                           time.gmtime()),
           "us": measure(args.calls)}
    print(json.dumps(doc, indent=1))
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
