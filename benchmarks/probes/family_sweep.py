"""Probe: tiny random-weight models of families kvlc's engine tests do not start, through KvlcConnector.

For each family named on the command line: write a tiny model of it (transformers' own config class,
random weights), start a prefill engine of block PB and a decode engine of block DB (vLLM 0.32 CPU,
KvlcConnector, the hybrid KV-cache manager as vLLM decides), and per prompt length compare the decode
engine's greedy tokens after the transfer with the decode engine alone; then derive each engine's live plan
and compare its digest with ``kvlc init --engine vllm``'s for the model's config.json. One JSON line per
result on stdout; an engine that fails to start prints its log's last lines.

    python benchmarks/probes/family_sweep.py --dtype bfloat16 --blocks 32,64 qwen2 qwen3 mistral phi3 gemma2
    python benchmarks/probes/family_sweep.py --dtype float32 --prefix-control gpt_neox   # vLLM alone, cached KV

Families: ``testkit.vllm_engines.FAMILIES`` (model_type, or model_type+variant: the config fields that make
it tiny and exercise its kind of cache).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PROMPTS = (33, 64, 97, 150)
MAX_TOKENS = 10


def run(family: str, dtype: str, pb: int, db: int, root: Path) -> None:
    from kvlc.engines.vllm.derive.spec import derive_plan
    from testkit.vllm_engines import EngineSpec, tiny_family
    from tests.engines.conftest import Engines, engine_env, init_plan_like, kvlc_config, prefill, prompt

    model = tiny_family(root / family, family, dtype)
    e = Engines(root / f"{family}-{pb}-{db}")
    (root / f"{family}-{pb}-{db}").mkdir(exist_ok=True)
    base = dict(family=family, dtype=dtype, pb=pb, db=db)
    t0 = time.time()
    e.start("p", EngineSpec(str(model), pb, dtype=dtype, connector=kvlc_config("kv_producer"), env=engine_env(0)))
    e.start("d", EngineSpec(str(model), db, dtype=dtype, connector=kvlc_config("kv_consumer"), env=engine_env(1)))
    try:
        try:
            e["p"], e["d"]
        except Exception as exc:  # noqa: BLE001 - a probe reports every failure
            for side in "pd":
                tail = e.log(side).splitlines()[-12:]
                print(json.dumps({**base, "side": side, "start_error": str(exc)[-300:], "log": tail}))
            return
        kv = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
        for side, block in (("p", pb), ("d", db)):
            view = e[side].view()
            live = derive_plan(view)
            try:
                same = live.digest == init_plan_like(live, model, kv, block).digest
            except Exception as exc:  # noqa: BLE001
                same = f"init failed: {exc}"[:300]
            print(json.dumps({**base, "side": side, "groups": [g.name for g in live.groups],
                              "isa": view.cpu_isa, "digest_equal": same, "up_s": round(time.time() - t0, 1)}))
        for i, n in enumerate(PROMPTS):
            p = prompt(n, seed=i)
            ref = e["d"].generate([p], MAX_TOKENS)[0].tokens
            params = prefill(e["p"], p)
            (out,) = e["d"].generate([p], MAX_TOKENS, [params])
            print(json.dumps({**base, "n": n, "equal": out.tokens == ref, "cached": out.num_cached_tokens,
                              "remote_num_tokens": params.get("remote_num_tokens")}))
    finally:
        e.close()


def prefix_control(family: str, dtype: str, block: int, root: Path) -> None:
    """The engine alone, no connector, prefix caching on: each prompt twice, the second after its blocks were
    cached. Tokens that change say vLLM computes a token after cached KV otherwise than in one pass (a
    transfer then changes them too, through no fault of its own)."""
    from testkit.vllm_engines import EngineSpec, tiny_family
    from tests.engines.conftest import Engines, engine_env, prompt

    model = tiny_family(root / family, family, dtype)
    (root / f"{family}-control").mkdir(exist_ok=True)
    e = Engines(root / f"{family}-control")
    e.start("a", EngineSpec(str(model), block, dtype=dtype, prefix_caching=True, env=engine_env(0)))
    try:
        for i, n in enumerate(PROMPTS):
            p = prompt(n, seed=i)
            first = e["a"].generate([p], MAX_TOKENS)[0]
            again = e["a"].generate([p], MAX_TOKENS)[0]
            print(json.dumps({"family": family, "dtype": dtype, "control": "prefix cache", "n": n,
                              "cached": again.num_cached_tokens, "equal": first.tokens == again.tokens}))
    finally:
        e.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from testkit.vllm_engines import FAMILIES

    ap.add_argument("families", nargs="+", choices=sorted(FAMILIES))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--blocks", default="32,32", help="prefill,decode block sizes")
    ap.add_argument("--prefix-control", action="store_true",
                    help="instead: the engine alone with prefix caching, each prompt twice (a negative control)")
    args = ap.parse_args()
    pb, db = map(int, args.blocks.split(","))
    root = Path(tempfile.mkdtemp(prefix="kvlc-sweep-"))
    for family in args.families:
        try:
            if args.prefix_control:
                prefix_control(family, args.dtype, pb, root)
            else:
                run(family, args.dtype, pb, db, root)
        except Exception:  # noqa: BLE001
            print(json.dumps({"family": family, "error": traceback.format_exc()[-1500:]}))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
