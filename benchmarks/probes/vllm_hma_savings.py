"""What vLLM's hybrid KV-cache manager saves, and that KvlcConnector keeps it on.

A tiny Gemma-3 (layers sliding, sliding, sliding, full; 64-token window; random bf16 weights) serves
one long prompt in a vLLM CPU engine (single process, one core) with KvlcConnector as the prefill
side, once with the hybrid manager as vLLM leaves it (on: KvlcConnector implements SupportsHMA) and
once with ``disable_hybrid_kv_cache_manager=True`` (what vLLM does for a connector without
SupportsHMA). After the prefill and one decode step, still running, the probe reads from the
engine's own scheduler: the request's block ids per KV-cache group (null blocks, which a sliding
group leaves where its window has passed, not counted), the pool's blocks in use, and the pool's
size; "fits" is how many such requests the same KV memory holds.

    PYTHONPATH=. python3 benchmarks/probes/vllm_hma_savings.py --out benchmarks/results/vllm_hma_savings.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

ONE = r'''
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
from vllm.inputs import TokensPrompt

model, block, hma, tokens, mib = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "on", int(sys.argv[4]), int(sys.argv[5])
conn = KVTransferConfig(kv_connector="KvlcConnector", kv_connector_module_path="kvlc.engines.vllm",
                        kv_role="kv_producer", kv_connector_extra_config={"host": "127.0.0.1", "port": 0})
llm = LLM(model=model, load_format="dummy", enforce_eager=True, skip_tokenizer_init=True, dtype="bfloat16",
          max_model_len=tokens + 64, seed=0, max_num_seqs=1, max_num_batched_tokens=tokens + 64,
          kv_cache_memory_bytes=mib << 20, block_size=block, kv_transfer_config=conn,
          disable_hybrid_kv_cache_manager=not hma)
engine = llm.llm_engine
core = engine.engine_core.engine_core
sched = core.scheduler
manager, pool = sched.kv_cache_manager, sched.kv_cache_manager.block_pool
prompt = TokensPrompt(prompt_token_ids=[(7 * i) % 200 + 10 for i in range(tokens)])
engine.add_request("long", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
engine.step()
engine.step()   # one decode step: a sliding group frees the blocks its window has passed
groups = sched.kv_cache_config.kv_cache_groups
(rid,) = list(sched.requests)   # vLLM adds a suffix to the request id
ids = manager.get_block_ids(rid)
null = pool.null_block.block_id
held = [sum(1 for b in g if b != null) for g in ids]
total = pool.num_gpu_blocks - 1
used = total - pool.get_num_free_blocks()
print("RESULT " + json.dumps({
    "hma": hma, "tokens": tokens, "block_size": block, "groups": len(groups),
    "group_kinds": [type(g.kv_cache_spec).__name__ for g in groups],
    "layers_per_group": [len(g.layer_names) for g in groups],
    "blocks_held_per_group": held, "blocks_in_use": used, "pool_blocks": total,
    "fits": total // max(used, 1),
    "kv_bytes_per_block": int(sched.kv_cache_config.kv_cache_tensors[0].size // pool.num_gpu_blocks)
    if sched.kv_cache_config.kv_cache_tensors else None}))
'''


def run_one(model: str, block: int, hma: str, tokens: int, mib: int, folder: Path) -> dict:
    script = folder / "one.py"
    script.write_text(ONE)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "VLLM_CPU_OMP_THREADS_BIND": "0", "KVLC_SECRET": "hma-savings-probe-secret-0123456789"}
    out = subprocess.run([sys.executable, str(script), model, str(block), hma, str(tokens), str(mib)],
                         env=env, capture_output=True, text=True, timeout=900)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"engine (hma {hma}, {tokens} tokens) gave no result:\n{out.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--kv-cache-mib", type=int, default=64)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from testkit.vllm_engines import tiny_gemma3

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = str(tiny_gemma3(Path(tmp) / "tiny-gemma3", window=64,
                                 max_position_embeddings=max(args.tokens) + 64))
        for tokens in args.tokens:
            for hma in ("on", "off"):
                r = run_one(model, args.block_size, hma, tokens, args.kv_cache_mib, Path(tmp))
                rows.append(r)
                print(f"{tokens:>6} tokens  HMA {hma:<3}  groups {r['groups']}  held per group "
                      f"{r['blocks_held_per_group']}  in use {r['blocks_in_use']} of {r['pool_blocks']}  "
                      f"fits {r['fits']}", flush=True)
    doc = {"command": "PYTHONPATH=. python3 benchmarks/probes/vllm_hma_savings.py " + " ".join(sys.argv[1:]),
           "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
           "model": "tiny Gemma-3, layers S,S,S,F, window 64, bf16, random weights", "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
