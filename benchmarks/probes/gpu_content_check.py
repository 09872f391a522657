"""Content-coded check of kvlc's defaults on one GPU: push, pull, pull via push and a staged push.

Llama-3.1-8B scaled to a 64 MiB pool per rank on cuda:0 (both engines, two processes), 8 requests of
256 tokens with random block ids per mode; every destination byte is compared with what the content
oracle says and every other byte must be unchanged (``run_demo(check="all")``). The staged row sets
``KVLC_STAGING=always`` for the engine processes. ``--device cpu`` runs the same on DRAM.

Run (from the repository root):  python3 benchmarks/probes/gpu_content_check.py [--device cpu]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, the suite
sys.path.insert(0, str(Path(__file__).resolve().parent))  # probes/

from gpu_transfer import LLAMA, on_device  # noqa: E402

from kvlc.demo.run import run_demo  # noqa: E402

CASES = (("push", "auto"), ("pull", "auto"), ("pull_via_push", "auto"), ("push", "always"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    args = ap.parse_args(argv)
    layout = on_device(LLAMA, 0, Path(tempfile.mkdtemp())) if args.device == "gpu" else LLAMA
    bad = 0
    for mode, staging in CASES:
        os.environ["KVLC_STAGING"] = staging  # read by the engine processes' agents
        r = run_demo(layout, layout, mode=mode, requests=8, tokens=256, max_bytes=64 << 20, device=args.device,
                     check="all", fill="content", ids="random")
        bad += not r.ok
        print(f"{mode:14s} staging={staging:6s} ipc={os.environ.get('KVLC_IPC', 'auto')} ok={r.ok} "
              f"copied={r.copied_requests}/{r.requests} checked={r.checked_bytes} "
              f"mismatches={r.mismatches[:2]} failed={dict(list(r.failed.items())[:2])}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
