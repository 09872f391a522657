"""Prefill and decode vLLM engines with kvlc, in two commands.

    # terminal 1: a prefill engine; its HTTP endpoint turns a prompt into kv_transfer_params
    KVLC_SECRET=... python3 examples/vllm_prefill_decode.py prefill --model DIR --api-port 8100 --kv-port 7100

    # terminal 2: a decode engine that sends each prompt to the prefill engine and decodes it
    KVLC_SECRET=... python3 examples/vllm_prefill_decode.py decode --model DIR \\
        --prefill http://127.0.0.1:8100 --prompt-tokens 200 --max-tokens 16 --check

The prefill endpoint (``POST /prefill`` with ``{"prompt_token_ids": [...]}``) runs the prompt with
``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}`` and answers with the
engine's ``RequestOutput.kv_transfer_params``; the decode command passes that dict unchanged.
``--check`` also decodes the prompt without a transfer and reports whether the tokens match; the
decode engine's log line "kvlc: rank 0 loads request ... (tokens [0, N) ...)" shows the load. Prompts are token ids
(the engines run without a tokenizer, as the test model has none): ``--prompt 11,48,...``, or
``--prompt-tokens N`` for N deterministic ids below 1000 (longer than a few blocks, so whole blocks
move, not just the last partial one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer


def _llm(args, role: str):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(
        kv_connector="KvlcConnector", kv_connector_module_path="kvlc.engines.vllm", kv_role=role,
        kv_connector_extra_config={"host": args.host, "port": args.kv_port, "mode": args.mode},
        kv_load_failure_policy=args.failure_policy)
    return LLM(model=args.model, load_format="safetensors", enforce_eager=True, skip_tokenizer_init=True,
               dtype=args.dtype, max_model_len=args.max_model_len, block_size=args.block_size, seed=0,
               kv_cache_memory_bytes=args.kv_cache_mib << 20, enable_prefix_caching=False,
               kv_transfer_config=ktc)


def _sampling(max_tokens: int, params: dict | None):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False,
                          extra_args={"kv_transfer_params": params} if params else None)


def run_prefill(args) -> None:
    from vllm.inputs import TokensPrompt

    llm = _llm(args, "kv_producer")
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            if self.path != "/prefill":
                self.send_error(404, "POST /prefill")
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                ids = [int(t) for t in body["prompt_token_ids"]]
            except (ValueError, KeyError, TypeError) as exc:
                self.send_error(400, f"expected {{\"prompt_token_ids\": [int, ...]}}: {exc}")
                return
            with lock:
                out = llm.generate([TokensPrompt(prompt_token_ids=ids)],
                                   [_sampling(1, {"do_remote_decode": True})], use_tqdm=False)[0]
            data = json.dumps({"kv_transfer_params": out.kv_transfer_params,
                               "first_token": out.outputs[0].token_ids[0]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt, *a):
            return

    server = HTTPServer((args.host, args.api_port), Handler)
    print(f"kvlc prefill engine ready: POST http://{args.host}:{server.server_port}/prefill", flush=True)
    server.serve_forever()


def run_decode(args) -> int:
    from vllm.inputs import TokensPrompt

    ids = ([int(t) for t in args.prompt.split(",") if t.strip()] if args.prompt
           else [(i * 37 + 11) % 1000 for i in range(args.prompt_tokens)])
    llm = _llm(args, "kv_consumer")
    req = urllib.request.Request(args.prefill.rstrip("/") + "/prefill",
                                 data=json.dumps({"prompt_token_ids": ids}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as r:
            params = json.loads(r.read())["kv_transfer_params"]
    except (OSError, ValueError, KeyError) as exc:  # URLError and timeouts are OSErrors
        print(f"error: the prefill engine at {args.prefill} did not answer with kv_transfer_params within "
              f"{args.timeout:g}s ({exc}); is it running (its log says 'kvlc prefill engine ready')? "
              "On a slow machine raise --timeout", file=sys.stderr)
        return 1
    prompt = TokensPrompt(prompt_token_ids=ids)
    out = llm.generate([prompt], [_sampling(args.max_tokens, params)], use_tqdm=False)[0]
    result = {"tokens": list(out.outputs[0].token_ids), "kv_transfer_params": params, "prompt_tokens": len(ids)}
    if args.check:
        own = llm.generate([prompt], [_sampling(args.max_tokens, None)], use_tqdm=False)[0]
        result["own_tokens"] = list(own.outputs[0].token_ids)
        result["match"] = result["own_tokens"] == result["tokens"]
    print(json.dumps(result), flush=True)
    return 0 if result.get("match", True) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 examples/vllm_prefill_decode.py",
                                 description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="role", required=True)
    for name in ("prefill", "decode"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=True, help="a local model folder (safetensors)")
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--kv-port", type=int, default=0, help="kvlc side channel of TP rank 0 (0: any)")
        p.add_argument("--mode", default="pull", choices=["pull", "push", "pull_via_push"])
        p.add_argument("--block-size", type=int, default=32)
        p.add_argument("--dtype", default="bfloat16")
        p.add_argument("--max-model-len", type=int, default=512)
        p.add_argument("--kv-cache-mib", type=int, default=64)
        p.add_argument("--failure-policy", default="recompute", choices=["recompute", "fail"])
    sub.choices["prefill"].add_argument("--api-port", type=int, default=8100)
    d = sub.choices["decode"]
    d.add_argument("--prefill", required=True, help="the prefill engine's URL, e.g. http://127.0.0.1:8100")
    which = d.add_mutually_exclusive_group(required=True)
    which.add_argument("--prompt", help="comma-separated token ids")
    which.add_argument("--prompt-tokens", type=int, help="a deterministic prompt of this many token ids")
    d.add_argument("--timeout", type=float, default=300.0,
                   help="seconds to wait for the prefill engine's answer (default 300)")
    d.add_argument("--max-tokens", type=int, default=16)
    d.add_argument("--check", action="store_true", help="also decode without a transfer and compare")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.role == "prefill":
        run_prefill(args)
        return 0
    return run_decode(args)


if __name__ == "__main__":
    sys.exit(main())
