"""KvlcConnector next to vLLM's own NixlConnector: same machine, model, prompts, one run.

For each connector a prefill and a decode engine (vLLM single-process mode, CPU, one core each)
serve the same prompts. Measured per request on the decode side: time from request arrival to
the first token (``generate(max_tokens=1)`` with the prefill's params, wall time inside the decode
process); for kvlc also the transfer time (load start to received), bytes and descriptors (the
agent's counters). Every decode is checked against the decode engine's own tokens. Then the
block-size pairs 128/32 and 32/64 are tried with both connectors (tokens compared, refusals kept).

    PYTHONPATH=. python3 benchmarks/probes/vllm_pd.py --out benchmarks/results/vllm_pd.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from testkit.vllm_engines import EngineProcess, EngineSpec, tiny_llama  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SECRET = "vllm-pd-benchmark-secret-0123456789"


def kvlc_conn(role):
    return dict(kv_connector="KvlcConnector", kv_connector_module_path="kvlc.engines.vllm", kv_role=role,
                kv_connector_extra_config={"port": 0, "timeout": 60.0}, kv_load_failure_policy="recompute")


def nixl_conn(role):
    return dict(kv_connector="NixlConnector", kv_role=role, kv_buffer_device="cpu",
                kv_load_failure_policy="recompute")


def env(core, port):
    return {"PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": str(core),
            "KVLC_SECRET": SECRET, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}


def prompts(n, length):
    return [[(i * 37 + 11 + s * 101) % 1000 for i in range(length + 7 * s)] for s in range(n)]


def start_pair(model, conn, bp, bd, port, logs, tag):
    p = EngineProcess(EngineSpec(model, bp, connector=conn("kv_producer"), env=env(0, port)),
                      logs / f"{tag}-p.log").start()
    d = EngineProcess(EngineSpec(model, bd, connector=conn("kv_consumer"), env=env(1, port + 50)),
                      logs / f"{tag}-d.log").start()
    return p, d


def run_pair(p, d, ps, kvlc: bool) -> dict:
    p.wait_ready()
    d.wait_ready()
    rows = []
    for prompt in ps:
        ref = d.generate([prompt], 8)[0].tokens
        before = d.stats() if kvlc else {}
        pre = p.generate([prompt], 1, [{"do_remote_decode": True}])[0]
        params = {k: v for k, v in pre.kv_transfer_params.items() if k != "remote_prefill_cached_tokens"}
        first = d.generate([prompt], 1, [params])[0]
        after = d.stats() if kvlc else {}
        pre2 = p.generate([prompt], 1, [{"do_remote_decode": True}])[0]
        params2 = {k: v for k, v in pre2.kv_transfer_params.items() if k != "remote_prefill_cached_tokens"}
        full = d.generate([prompt], 8, [params2])[0]
        row = {"prompt_tokens": len(prompt), "ttft_s": first.seconds, "cached_tokens": first.num_cached_tokens,
               "tokens_match": full.tokens == ref}
        if kvlc:
            row["bytes"] = after["bytes"] - before["bytes"]
            row["descriptors"] = after["descriptors"] - before["descriptors"]
            row["transfer_s"] = after["load_seconds"][-1] if after["load_seconds"] else None
        rows.append(row)
    return summarize(rows)


def summarize(rows):
    out = {"requests": rows, "all_tokens_match": all(r["tokens_match"] for r in rows),
           "median_ttft_s": statistics.median(r["ttft_s"] for r in rows),
           "median_cached_tokens": statistics.median(r["cached_tokens"] for r in rows)}
    for k in ("bytes", "descriptors", "transfer_s"):
        vals = [r[k] for r in rows if r.get(k) is not None]
        if vals:
            out[f"median_{k}"] = statistics.median(vals)
    return out


def attempt(fn):
    try:
        return fn()
    except Exception as exc:  # a refusal is a result here
        return {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/vllm_pd.json")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--skip-geometries", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvlc-vllm-pd-"))
    model = str(tiny_llama(work / "model"))
    logs = work / "logs"
    logs.mkdir()
    ps = prompts(args.requests, args.tokens)
    result = {"command": " ".join(["python3"] + sys.argv), "machine": f"{platform.machine()}, "
              f"{os.cpu_count()} cores, {platform.platform()}", "model": "tiny Llama (2 layers, 2 KV heads x 64, bf16)",
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for name, conn, kv in (("kvlc", kvlc_conn, True), ("nixl", nixl_conn, False)):
        p, d = start_pair(model, conn, 32, 32, 15600 if kv else 15700, logs, f"{name}-32-32")
        try:
            result[f"{name}_32_32"] = attempt(lambda: run_pair(p, d, ps, kv))
        finally:
            p.close()
            d.close()
        print(name, json.dumps(result[f"{name}_32_32"])[:300], flush=True)
    k, n = result["kvlc_32_32"], result["nixl_32_32"]
    if "median_ttft_s" in k and "median_ttft_s" in n:
        result["ttft_ratio_kvlc_over_nixl"] = k["median_ttft_s"] / n["median_ttft_s"]
    if not args.skip_geometries:
        for bp, bd in ((128, 32), (32, 64)):
            for name, conn, kv in (("kvlc", kvlc_conn, True), ("nixl", nixl_conn, False)):
                p, d = start_pair(model, conn, bp, bd, 15800 + bp + bd + (0 if kv else 7), logs,
                                  f"{name}-{bp}-{bd}")
                try:
                    result[f"{name}_{bp}_{bd}"] = attempt(lambda: run_pair(p, d, ps[:2], kv))
                finally:
                    p.close()
                    d.close()
                print(name, bp, bd, json.dumps(result[f"{name}_{bp}_{bd}"])[:300], flush=True)
    result["logs"] = str(logs)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
