"""Probe: Llama-4 chunked local attention and Jamba (Mamba-1) in real vLLM 0.32 CPU engines with KvlcConnector.

One question per run, one engine pair at a time (2 cores), results as JSON lines on stdout (recorded in
docs/vllm.md, "Chunked local attention (Llama-4)" and "Mamba-1 (Jamba)"):

* ``llama4 DTYPE CHUNK PB DB``: a tiny Llama-4 text model (testkit.vllm_engines.tiny_llama4: three
  chunked-local layers of CHUNK tokens, one full layer) P/D from a block-PB prefill engine to a block-DB decode
  engine in DTYPE, over prompts at and around chunk boundaries: tokens against the decode engine alone,
  cached tokens, bytes moved against what the chunked rule gives, the live plan's digest against kvlc init's;
* ``jamba``: a tiny Jamba (tiny_jamba) in an engine without a connector: the first request's error.

    python benchmarks/probes/live_families.py llama4 float32 32 32 32
    python benchmarks/probes/live_families.py jamba
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PROMPTS = (33, 96, 97, 128, 129, 150, 160, 200)
MAX_TOKENS = 12


def _chunk_tokens(stop: int, chunk: int, block: int) -> int:
    return stop - stop // chunk * chunk // block * block


def llama4(dtype: str, chunk: int, pb: int, db: int) -> None:
    from kvlc.compiler import compile_spec
    from kvlc.engines.vllm.derive.spec import derive_plan
    from kvlc.init import EngineOptions, init_yaml
    from testkit.vllm_engines import EngineSpec, tiny_llama4
    from tests.engines.conftest import Engines, engine_env, kvlc_config, prefill, prompt

    root = Path(tempfile.mkdtemp(prefix="kvlc-llama4-"))
    model = tiny_llama4(root / "model", chunk=chunk)
    e = Engines(root)
    t0 = time.time()
    e.start("p", EngineSpec(str(model), pb, dtype=dtype, connector=kvlc_config("kv_producer"), env=engine_env(0)))
    e.start("d", EngineSpec(str(model), db, dtype=dtype, connector=kvlc_config("kv_consumer"), env=engine_env(1)))
    try:
        config = json.loads((model / "config.json").read_text())
        kv = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
        for side, block in (("p", pb), ("d", db)):
            view = e[side].view()
            live = derive_plan(view)
            init = compile_spec(init_yaml(config, EngineOptions(
                engine="vllm", backend="CPU_ATTN", mem="DRAM", block_size=block, num_blocks=view.num_blocks,
                kv_dtype=kv, name=live.name, model_name=view.model.name)))
            print(json.dumps({"side": side, "block": block, "digest_equal": live.digest == init.digest,
                              "groups": [g.name for g in live.groups], "up_s": round(time.time() - t0, 1)}))
        token = 2 * 2 * 64 * {"float32": 4, "bfloat16": 2}[dtype]
        for i, n in enumerate(PROMPTS):
            p = prompt(n, seed=i)
            ref = e["d"].generate([p], MAX_TOKENS)[0].tokens
            params = prefill(e["p"], p)
            before = e["d"].stats()["bytes"]
            (out,) = e["d"].generate([p], MAX_TOKENS, [params])
            moved = e["d"].stats()["bytes"] - before
            m = params["remote_num_tokens"]
            want = token * (m + 3 * _chunk_tokens(m, chunk, db))
            print(json.dumps({"n": n, "equal": out.tokens == ref, "cached": out.num_cached_tokens,
                              "remote_num_tokens": m, "bytes": moved, "bytes_rule": want,
                              "bytes_all_tokens": token * 4 * m}))
    finally:
        e.close()


def jamba() -> None:
    from testkit.vllm_engines import EngineProcess, EngineSpec, tiny_jamba
    from tests.engines.conftest import engine_env, prompt

    root = Path(tempfile.mkdtemp(prefix="kvlc-jamba-"))
    model = tiny_jamba(root / "model")
    for dtype in ("float32", "bfloat16"):
        e = EngineProcess(EngineSpec(str(model), 32, dtype=dtype, env=engine_env(0)), root / f"{dtype}.log").start()
        try:
            e.wait_ready(300)
            try:
                out = e.generate([prompt(40)], 4)
                print(json.dumps({"dtype": dtype, "started": True, "tokens": list(out[0].tokens)}))
            except RuntimeError as exc:
                print(json.dumps({"dtype": dtype, "started": True, "first_request": str(exc)}))
        except RuntimeError as exc:
            print(json.dumps({"dtype": dtype, "started": False, "error": str(exc)}))
        finally:
            e.close()


if __name__ == "__main__":
    if sys.argv[1] == "llama4":
        llama4(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        jamba()
