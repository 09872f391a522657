"""Decode time to first token under concurrency: KvlcConnector against vLLM's NixlConnector, alternated in one run.

Real vLLM OpenAI servers (``python -m vllm.entrypoints.openai.api_server``, single-process engines,
CPU, float32, the tiny random-weight Llama with a word tokenizer), one prefill server and two decode
servers per connector, all up at once. Each round sends ``--requests`` requests (prompts of 22 to
591 tokens) at once, as a P/D proxy does: prefill with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true}``, then decode (streamed) with the returned params.
Measured per request at the client: decode time to first token (decode request sent to its first
streamed token) and the end-to-end time to first token (prefill sent to that token). Layouts 1P:1D
(every decode to server A) and 1P:2D (round-robin A, B); kvlc and NIXL alternate, the first of each
round switching. Every decode's tokens are compared with the other connector's for the same prompt. The kvlc
servers log vLLM's "KV Transfer metrics" (the connector's stats) every second; their lines are kept.

    PYTHONPATH=. python3 benchmarks/probes/vllm_pd_concurrency.py --out benchmarks/results/vllm_pd_concurrency.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from testkit.openai_servers import (Server, free_port, kvlc_transfer_config, tiny_llama_with_words,  # noqa: E402
                                    vllm_server_args, wait_all, words)

ROOT = Path(__file__).resolve().parents[2]
SECRET = "vllm-pd-concurrency-secret-0123456789"
SERVER_EXTRA = ["--max-model-len", "1024", "--max-num-seqs", "32", "--max-num-batched-tokens", "1024"]


def nixl_transfer_config(role: str) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
                       "kv_load_failure_policy": "recompute"})


def start_servers(model: str, tmp: Path, decodes: int, args) -> dict[str, Server]:
    """Per connector: prefill (core 0), decode A (core 1), decode B (core 0); started in parallel."""
    servers: dict[str, Server] = {}
    base = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "KVLC_SECRET": SECRET}
    if not args.multiprocess:
        base["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    extra = SERVER_EXTRA + ["--block-size", str(args.block_size)]
    if args.prefix_caching:
        extra.append("--enable-prefix-caching")
    roles = (("p", "kv_producer", 0), ("da", "kv_consumer", 1), ("db", "kv_consumer", 0))[:1 + decodes]
    for conn, config in (("kvlc", kvlc_transfer_config), ("nixl", nixl_transfer_config)):
        for name, role, core in roles:
            port = free_port()
            env = {**base, "VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                   "VLLM_LOG_STATS_INTERVAL": "1"}
            cmd = vllm_server_args(model, port, config(role), dtype="float32") + extra
            servers[f"{conn}-{name}"] = Server(f"{conn}-{name}", cmd, port, tmp / f"{conn}-{name}.log", env)
    wait_all(servers.values())
    return servers


async def one(http, model: str, prompt: str, prefill: str, decode: str, max_tokens: int) -> dict:
    """One request as a P/D proxy sends it; the client-side times and the decode's tokens."""
    t0 = time.perf_counter()
    async with http.post(prefill + "/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": False,
            "kv_transfer_params": {"do_remote_decode": True}}) as r:
        pre = await r.json()
    params = pre.get("kv_transfer_params")
    t1 = time.perf_counter()
    first, tokens = None, []
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True, "kv_transfer_params": params}
    async with http.post(decode + "/v1/completions", json=body) as r:
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices", ()):
                if first is None and (c.get("text") or c.get("token_ids")):
                    first = time.perf_counter()
                tokens += c.get("token_ids") or []
    return {"prompt_tokens": len(prompt.split()), "decode_ttft_s": (first or time.perf_counter()) - t1,
            "e2e_ttft_s": (first or time.perf_counter()) - t0, "prefill_s": t1 - t0, "tokens": tokens,
            "params": params is not None}


async def round_of(model: str, prompts: list[str], prefill: str, decodes: list[str], max_tokens: int
                   ) -> list[dict]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
        return await asyncio.gather(*(one(http, model, p, prefill, decodes[i % len(decodes)], max_tokens)
                                      for i, p in enumerate(prompts)))


def lengths(n: int) -> list[int]:
    """``n`` prompt lengths from 22 to 591 tokens, spread evenly, in a shuffled order."""
    out = [22 + (569 * i) // max(n - 1, 1) for i in range(n)]
    return [out[(i * 7) % n] for i in range(n)] if n % 7 else out


def summary(rows: list[dict]) -> dict:
    d = sorted(r["decode_ttft_s"] for r in rows)
    return {"decode_ttft_median_s": statistics.median(d), "decode_ttft_p90_s": d[int(0.9 * (len(d) - 1))],
            "decode_ttft_max_s": d[-1], "e2e_ttft_median_s": statistics.median(r["e2e_ttft_s"] for r in rows),
            "all_params": all(r["params"] for r in rows)}


def run(args, servers: dict[str, Server], model: str) -> dict:
    layouts = {"1P1D": ["da"], "1P2D": ["da", "db"]}
    layouts = {k: v for k, v in layouts.items() if k in args.layouts.split(",")}
    rounds = []
    for r in range(args.rounds):
        seeds = [i if args.repeat_prompts else 100 * r + i for i in range(args.requests)]  # 101*s mod 1000 differ
        prompts = [words(n, seed=s) for s, n in zip(seeds, lengths(args.requests))]
        order = ("kvlc", "nixl") if r % 2 == 0 else ("nixl", "kvlc")
        for layout, decodes in layouts.items():
            rows = {}
            for conn in order:
                urls = [servers[f"{conn}-{d}"].url for d in decodes]
                rows[conn] = asyncio.run(round_of(model, prompts, servers[f"{conn}-p"].url, urls, args.max_tokens))
            same = [a["tokens"] == b["tokens"] for a, b in zip(rows["kvlc"], rows["nixl"])]
            entry = {"round": r, "layout": layout, "first": order[0], "tokens_equal": sum(same),
                     **{c: summary(v) for c, v in rows.items()},
                     "requests": {c: [{k: v for k, v in x.items() if k != "tokens"} for x in v] for c, v in rows.items()}}
            rounds.append(entry)
            print(f"round {r} {layout}: kvlc {entry['kvlc']['decode_ttft_median_s']:.3f} s, nixl "
                  f"{entry['nixl']['decode_ttft_median_s']:.3f} s (decode TTFT median), tokens equal "
                  f"{sum(same)}/{len(same)}", flush=True)
    return {"rounds": rounds, "overall": overall(rounds)}


def overall(rounds: list[dict]) -> dict:
    out = {}
    for layout in sorted({r["layout"] for r in rounds}):
        mine = [r for r in rounds if r["layout"] == layout and r["round"] > 0]  # round 0: first contact
        for conn in ("kvlc", "nixl"):
            vals = [x["decode_ttft_s"] for r in mine for x in r["requests"][conn]]
            out[f"{layout}_{conn}_decode_ttft_median_s"] = statistics.median(vals) if vals else None
            out[f"{layout}_{conn}_round_medians_s"] = [r[conn]["decode_ttft_median_s"] for r in
                                                       (x for x in rounds if x["layout"] == layout)]
        out[f"{layout}_tokens_equal"] = f"{sum(r['tokens_equal'] for r in rounds if r['layout'] == layout)}/" \
                                        f"{sum(len(r['requests']['kvlc']) for r in rounds if r['layout'] == layout)}"
    return out


def connector_metrics(servers: dict[str, Server]) -> dict:
    """The kvlc decode servers' "KV Transfer metrics" lines (vLLM's log of the connector stats, one per
    second with loads), parsed; and the medians over those lines of their per-second p50s."""
    lines = []
    for name in ("kvlc-da", "kvlc-db"):
        if name not in servers:
            continue
        for line in servers[name].log().splitlines():
            if "KV Transfer metrics:" in line:
                kv = dict(x.split("=") for x in line.split("KV Transfer metrics: ")[1].split(", "))
                lines.append({"server": name, **{k: float(v) for k, v in kv.items()}})
    out = {"lines": lines}
    for k in ("loads", "bytes", "descriptors", "failures", "recomputes"):
        out[k] = sum(x.get(k, 0) for x in lines)
    for k in ("transfer_ms_p50", "overhead_ms_p50"):
        vals = [x[k] for x in lines if x.get("loads")]
        out[f"median_of_{k}"] = statistics.median(vals) if vals else None
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/vllm_pd_concurrency.json")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--layouts", default="1P1D,1P2D")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeat-prompts", action="store_true", help="the same prompts every round (prefix-cache "
                    "hits on both engines from the second round on); default: new prompts each round")
    ap.add_argument("--multiprocess", action="store_true", help="vLLM's default engine processes "
                    "(API server, engine core, worker) instead of one process per server")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvlc-pd-concurrency-"))
    model = str(tiny_llama_with_words(tmp / "tiny-words"))
    result = {"command": " ".join(["python3"] + sys.argv),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
              "model": "tiny Llama (2 layers, 2 KV heads x 64), float32, word tokenizer",
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "logs": str(tmp)}
    servers = start_servers(model, tmp, 2 if "1P2D" in args.layouts else 1, args)
    try:
        result.update(run(args, servers, model))
        time.sleep(2)  # the last second's metrics line
        result["kvlc_connector_metrics"] = connector_metrics(servers)
        Path(args.out).write_text(json.dumps(result, indent=1))  # before the servers stop (slow when loaded)
    finally:
        for s in servers.values():
            s.proc.terminate()
        for s in servers.values():
            try:
                s.stop()
            except subprocess.TimeoutExpired:
                print(f"{s.name} (pid {s.proc.pid}) did not stop in time", file=sys.stderr)
    m = result["kvlc_connector_metrics"]
    print(json.dumps({**result["overall"], **{k: v for k, v in m.items() if k != "lines"}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
