"""GPU: staged fragmented push through KvAgent with UCX's thread pool off and on, alternated.

Llama-3.1-8B in VRAM on cuda:0 (two processes), 1 GiB pools, 16 push requests of 2048 tokens with
random block ids (4,084 descriptors of 64 KiB: the automatic gate stages them), 4 in flight, no
byte check (benchmarks/probes/gpu_content_check.py checks bytes); ``KVLC_UCX_NUM_THREADS`` 0, 4, 0, 4.
Prints one JSON row per run (GB/s, each round's seconds); writes them to OUT if given.

Run (from the repository root):  python3 benchmarks/probes/gpu_staged_pool.py [gpu|cpu] [OUT.json]
"""

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, the suite
sys.path.insert(0, str(Path(__file__).resolve().parent))  # probes/
from gpu_transfer import LLAMA, on_device  # noqa: E402
from kvlc.demo.run import run_demo  # noqa: E402

def main():
    dev = sys.argv[1] if len(sys.argv) > 1 else "gpu"
    lp = on_device(LLAMA, 0, Path(tempfile.mkdtemp())) if dev == "gpu" else LLAMA
    out = []
    for threads in ("0", "4", "0", "4"):
        os.environ["KVLC_UCX_NUM_THREADS"] = threads
        r = run_demo(lp, lp, mode="push", requests=16, tokens=2048 if dev == "gpu" else 64,
                     max_bytes=(1 << 30) if dev == "gpu" else (64 << 20), device=dev, check="none",
                     fill="zeros", ids="random")
        row = {"threads": threads, "ok": r.ok, "gbps": r.gbps, "rounds": r.rounds, "round_seconds": r.round_seconds,
               "descriptors_per_request": r.descriptors_per_request, "failed": dict(list(r.failed.items())[:2])}
        out.append(row)
        print(json.dumps(row), flush=True)
    if len(sys.argv) > 2:
        Path(sys.argv[2]).write_text(json.dumps(out, indent=1))

if __name__ == "__main__":
    main()
