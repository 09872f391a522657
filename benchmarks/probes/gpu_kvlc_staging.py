"""GPU: staging through KvAgent (the real runtime), beside direct KvAgent transfers of the same bytes.

Rows (``kvlc staging ...``), two processes, ``kvlc.demo.run.run_demo``:

* content-coded checks (every destination byte) of VRAM Llama-3.1-8B with random block ids
  (fragmented: 64 KiB descriptors) and of mixed DRAM/VRAM DeepSeek-V3.2 -> HiSparse, in push, pull
  and pull-via-push, with ``KVLC_STAGING=always`` (every WRITE part staged) and the default
  automatic gate;
* timed: the same shapes with the automatic gate (staged), ``KVLC_STAGING=never`` (direct), and
  bounce slots of 32 / 128 / 256 MiB (``KVLC_STAGING_SLOT_BYTES``) and 8 slots of 64 MiB.

Pull (READ) is never staged (docs/runtime.md); its rows show the direct path for comparison.
Called by benchmarks/probes/gpu_transfer.py (``--only kvlc-staging``).
"""

from __future__ import annotations

import json
import os
import time
import traceback

MiB = 1 << 20


def _run(rows: list, case: str, env: dict, **kw) -> None:
    """One run_demo with ``env`` set for the engine processes it spawns; its row goes to ``rows``."""
    from gpu_transfer import _steady

    from kvlc.demo.run import run_demo

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the engine processes (spawned now) build their policy from these
    t0 = time.time()
    try:
        res = run_demo(**kw)
        row = {"case": case, "ok": res.ok, "env": env, "bytes": res.nbytes, "seconds": res.seconds,
               "gbps": res.gbps if kw.get("check") == "none" else None, "requests": res.requests,
               "bytes_per_request": res.nbytes // max(1, res.requests),
               "descriptors_per_request": res.descriptors_per_request,
               "staged_chunks": res.staged_chunks, "direct_chunks": res.direct_chunks,
               "verified_bytes": res.checked_bytes, "mismatches": res.mismatches[:5],
               "failed": dict(list(res.failed.items())[:3]), **_steady(res)}
    except Exception as exc:
        row = {"case": case, "ok": False, "env": env, "error": f"{type(exc).__name__}: {exc}",
               "traceback": traceback.format_exc()[-2000:]}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    row["wall_s"] = round(time.time() - t0, 1)
    rows.append(row)
    print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)


def cases(llama: tuple[str, str], mixed: tuple[str, str], quick: bool, device: str = "gpu",
          scale: int = 1) -> list[dict]:
    """Every row (see the module doc). ``quick``: checks with ``always`` only and fewer timed variants;
    ``device="cpu"`` / ``scale`` > 1 (pools divided by it): a dry run of this script without a GPU."""
    rows: list[dict] = []
    modes = ("push", "pull_via_push", "pull")
    for name, (p, c), check_bytes in (("VRAM llama-3.1-8b random ids", llama, 64 << 20),
                                      ("mixed deepseek-v3.2 -> hisparse", mixed, 16 << 20)):
        for mode in modes:
            for policy in ("always",) if quick else ("always", "auto"):
                _run(rows, f"kvlc staging {name} {mode} [{policy}] check", {"KVLC_STAGING": policy},
                     layout=p, consumer_layout=c, mode=mode, requests=4, tokens=128,
                     max_bytes=check_bytes // scale, device=device, check="all", timeout=120.0,
                     ids="random" if "llama" in name else "contiguous")
    n = 8 if quick else 16
    timed = [("auto", {"KVLC_STAGING": "auto"}), ("never", {"KVLC_STAGING": "never"}),
             ("slot 128 MiB", {"KVLC_STAGING": "auto", "KVLC_STAGING_SLOT_BYTES": str(128 * MiB)}),
             ("slot 256 MiB", {"KVLC_STAGING": "auto", "KVLC_STAGING_SLOT_BYTES": str(256 * MiB)}),
             ("8 slots of 64 MiB", {"KVLC_STAGING": "auto", "KVLC_STAGING_SLOT_BYTES": str(64 * MiB),
                                    "KVLC_STAGING_SLOTS": "8"})]
    for mode in ("push", "pull_via_push"):
        for label, env in (timed[:3] + timed[4:] if mode == "push" else timed[:1] + timed[2:3]) if quick else timed:
            kind = "direct" if label == "never" else "staging"
            _run(rows, f"kvlc {kind} VRAM llama-3.1-8b {mode} 256 MiB random ids [{label}]", env,
                 layout=llama[0], consumer_layout=llama[1], mode=mode, requests=n, tokens=2048 // scale,
                 max_bytes=(1 << 30) // scale, device=device, check="none", fill="zeros", ids="random",
                 timeout=300.0)
        for label, env in timed[:1] + (timed[2:3] if quick else timed[2:]):
            _run(rows, f"kvlc staging mixed deepseek-v3.2 -> hisparse {mode} contiguous [{label}]", env,
                 layout=mixed[0], consumer_layout=mixed[1], mode=mode, requests=4, tokens=512 // scale,
                 max_bytes=(256 << 20) // scale, device=device, check="none", fill="zeros", ids="contiguous",
                 timeout=300.0)
    if not quick:
        _run(rows, "kvlc staging VRAM llama-3.1-8b pull 256 MiB random ids [direct: READ is not staged]",
             {"KVLC_STAGING": "auto"}, layout=llama[0], consumer_layout=llama[1], mode="pull", requests=n,
             tokens=2048, max_bytes=1 << 30, device=device, check="none", fill="zeros", ids="random",
             timeout=300.0)
    return rows


def fix_cases(llama: tuple[str, str], mixed: tuple[str, str]) -> list[dict]:
    """A short set after a change: checks (always) in push and pull via push, then the timed staged rows."""
    rows: list[dict] = []
    for name, (p, c), check_bytes in (("VRAM llama-3.1-8b random ids", llama, 64 << 20),
                                      ("mixed deepseek-v3.2 -> hisparse", mixed, 16 << 20)):
        for mode in ("push", "pull_via_push") if "llama" in name else ("push",):
            _run(rows, f"kvlc staging {name} {mode} [always] check", {"KVLC_STAGING": "always"},
                 layout=p, consumer_layout=c, mode=mode, requests=4, tokens=128, max_bytes=check_bytes,
                 device="gpu", check="all", timeout=120.0, ids="random" if "llama" in name else "contiguous")
    for mode, label, env in (("push", "auto", {"KVLC_STAGING": "auto"}),
                             ("push", "8 slots of 64 MiB", {"KVLC_STAGING": "auto", "KVLC_STAGING_SLOTS": "8",
                                                            "KVLC_STAGING_SLOT_BYTES": str(64 * MiB)}),
                             ("pull_via_push", "auto", {"KVLC_STAGING": "auto"})):
        _run(rows, f"kvlc staging VRAM llama-3.1-8b {mode} 256 MiB random ids [{label}]", env,
             layout=llama[0], consumer_layout=llama[1], mode=mode, requests=8, tokens=2048,
             max_bytes=1 << 30, device="gpu", check="none", fill="zeros", ids="random", timeout=300.0)
    for mode in ("push", "pull_via_push"):
        _run(rows, f"kvlc staging mixed deepseek-v3.2 -> hisparse {mode} contiguous [auto]", {"KVLC_STAGING": "auto"},
             layout=mixed[0], consumer_layout=mixed[1], mode=mode, requests=4, tokens=512,
             max_bytes=256 << 20, device="gpu", check="none", fill="zeros", ids="contiguous", timeout=300.0)
    return rows


if __name__ == "__main__":  # a dry run on a CPU machine (DRAM versions of the layouts, small pools)
    import sys

    sys.path.insert(0, ".")
    got = cases(("layouts/llama-3.1-8b.yaml",) * 2,
                ("layouts/deepseek-v3.2-tp8.yaml", "layouts/deepseek-v3.2-hisparse-tp8.yaml"),
                quick=True, device="cpu", scale=16)
    print(sum(1 for r in got if r.get("ok")), "of", len(got), "ok")
