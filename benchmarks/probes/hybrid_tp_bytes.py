"""Qwen3-Next at TP 2 through KvlcConnector, proven by bytes (real vLLM 0.32 CPU engines, bfloat16).

vLLM's CPU Gated DeltaNet runs in bfloat16 only, and there a TP 2 engine alone and a TP 1 engine alone
already decode the same prompt differently, so tokens cannot judge a transfer (docs/vllm.md, "Mamba-2 and
Gated-DeltaNet hybrids"). This probe compares bytes instead: after the decode engine's scheduler took the
load as finished and before it computed the request (``EngineProcess.load_and_read``: the engine stepped by
hand, every rank read through ``collective_rpc``), each rank's blocks of the request must hold exactly the
prefill engine's bytes, read right after its prefill (``rank_blocks``):

* attention layers (CPU_ATTN blocks ``[heads][2 * block][head_dim]``): every loaded block, whole; across TP
  sizes a TP 2 rank's block is its head's half of the TP 1 block (2 KV heads);
* Gated DeltaNet layers: the running state (the last block of the prefill engine's list for the group) must
  equal exactly one of the decode engine's blocks of the request, the last of its list; across TP sizes a
  rank holds its share of each conv section (q | k | v channels, vLLM's sharded ``mixed_qkv``) and half
  of the recurrent state's value heads, sliced here from the TP 1 bytes by those rules, not by kvlc's plan.

Engines of other block sizes (both TP 1) are compared token by token: each attention layer's K and V of the
tokens the producer computed, read out of each side's blocks in the CPU_ATTN order (per head a K half
``[head_dim][block]``, a V half ``[block][head_dim]``), must be equal; the states as above.

A negative control per pair: the decode engine's bytes against another prompt's prefill bytes must
differ (attention blocks and states). Four engines (two TP 2, two TP 1; all ``kv_both``, prefix caching on,
``--block-size`` 32, which vLLM raises to 160 so a page holds a state, and 192 for ``t1b``, which it keeps) give
TP 2 -> TP 2, TP 1 -> TP 2, TP 2 -> TP 1, and 160 -> 192 and 192 -> 160 tokens per block at TP 1.

Run:  python3 benchmarks/probes/hybrid_tp_bytes.py [--prompts 2] [--tokens 400] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT,):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

PAIRS = (("t2a", "t2b"), ("t1", "t2b"), ("t2a", "t1"), ("t1", "t1b"), ("t1b", "t1"))  # (prefill, decode)
TP = {"t2a": 2, "t2b": 2, "t1": 1, "t1b": 1}
BLOCK = {"t1b": 192}  # --block-size asked (vLLM raises 32 to 160 so a page holds a state; 192 it keeps)


def _array(part) -> np.ndarray:
    """One block part ``(bytes, shape, dtype)`` as an array of 2- or 4-byte words in its shape."""
    raw, shape, dtype = part
    word = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.uint32}[dtype]
    return np.frombuffer(raw, dtype=word).reshape(shape)


def _channel_axis(conv: np.ndarray) -> int:
    """The channel axis of a conv state: ``(taps, channels)``, or transposed (taps are always the fewer)."""
    return 1 if conv.shape[0] < conv.shape[1] else 0


def _conv_share(full: np.ndarray, rank: int, tp: int, sections: tuple[int, ...]) -> np.ndarray:
    """Rank ``rank`` of ``tp``'s conv state from the TP 1 one: each section of the channel axis split ``tp``
    ways, the rank's slices joined in section order."""
    axis = _channel_axis(full)
    pieces, at = [], 0
    for size in sections:
        step = size // tp
        pieces.append(np.take(full, range(at + rank * step, at + (rank + 1) * step), axis=axis))
        at += size
    return np.concatenate(pieces, axis=axis)


def _head_share(full: np.ndarray, rank: int, tp: int) -> np.ndarray:
    """Rank ``rank`` of ``tp``'s share of an array whose first axis is heads."""
    step = full.shape[0] // tp
    return full[rank * step:(rank + 1) * step]


def _expected(prod: list[dict], layer: str, j: int, tp_to: int, rank: int, sections) -> list[np.ndarray]:
    """What decode rank ``rank`` (of ``tp_to``) must hold for block ``j`` of ``layer``: the producer rank's parts
    (same TP), or the share of the TP 1 producer's, or (a TP 1 decode engine) the producer ranks' joined."""
    tp_from = len(prod)
    if tp_from == tp_to:
        return [_array(p) for p in prod[rank][layer][j]]
    if tp_from == 1:
        parts = [_array(p) for p in prod[0][layer][j]]
        if len(parts) == 1:
            return [_head_share(parts[0], rank, tp_to)]
        conv, ssm = parts
        return [_conv_share(conv, rank, tp_to, sections), _head_share(ssm, rank, tp_to)]
    ranks = [[_array(p) for p in prod[r][layer][j]] for r in range(tp_from)]
    if len(ranks[0]) == 1:
        return [np.concatenate([r[0] for r in ranks], axis=0)]
    convs = [r[0] for r in ranks]
    axis = _channel_axis(convs[0])
    joined = []
    for k, size in enumerate(sections):  # section k of every rank, in rank order
        step = size // tp_from
        start = sum(s // tp_from for s in sections[:k])
        joined += [np.take(c, range(start, start + step), axis=axis) for c in convs]
    return [np.concatenate(joined, axis=axis), np.concatenate([r[1] for r in ranks], axis=0)]


def _where(layer: str, j: int, rank: int, got: list, want: list) -> dict:
    """Where a block differs: its layer, index in the list, rank, and the differing words (count, first index
    in the block's shape, shapes)."""
    a, w = got[0], want[0]
    if a.shape != w.shape:
        return {"layer": layer, "block": j, "rank": rank, "shapes": [list(a.shape), list(w.shape)]}
    bad = np.argwhere(a != w)
    return {"layer": layer, "block": j, "rank": rank, "words": int(len(bad)), "first": bad[0].tolist(),
            "last": bad[-1].tolist(), "shape": list(a.shape)}


def _tokens(blocks: list, ids, upto: int) -> np.ndarray:
    """One attention layer's K and V of tokens ``[0, upto)`` on a TP 1 engine, from its blocks in list order, as
    ``[token, head, K or V, head_dim]`` words. CPU_ATTN blocks ``[heads][block][2 * head_dim]`` hold per head a K half
    ``[head_dim][block]`` then a V half ``[block][head_dim]`` (ISA vec / vec16: docs/vllm.md, proven with vLLM's
    own cache op by tests/engines/test_cpu_layout.py)."""
    out = []
    for j, _ in enumerate(ids):
        a = _array(blocks[j][0])
        heads, n, d = a.shape[0], a.shape[1], a.shape[2] // 2
        halves = a.reshape(heads, 2, n * d)
        k = halves[:, 0].reshape(heads, d, n).transpose(2, 0, 1)
        v = halves[:, 1].reshape(heads, n, d).transpose(1, 0, 2)
        out.append(np.stack([k, v], axis=2))
    return np.concatenate(out)[:upto]


def compare(prod: list[dict], cons: list[dict], p_ids, d_ids, state_groups: set[int], layers_of: dict,
            sections, tokens: int | None = None) -> dict:
    """Per layer kind: blocks compared and blocks equal (``tokens``: engines of other block sizes, TP 1 both:
    each attention layer's K and V of the first ``tokens`` tokens instead); the state blocks' positions in the
    decode list."""
    report = {"attention_blocks": 0, "attention_equal": 0, "states": 0, "states_equal": 0, "state_at_last": 0}
    tp_to = len(cons)
    for g, layers in layers_of.items():
        if g in state_groups:
            running = max(j for j, b in enumerate(p_ids[g]) if b)  # the last real block of the producer's list
            last = max(j for j, b in enumerate(d_ids[g]) if b)
            for layer in layers:
                for r in range(tp_to):
                    want = _expected(prod, layer, running, tp_to, r, sections)
                    hits = [j for j, b in enumerate(d_ids[g]) if b and all(
                        np.array_equal(_array(p), w) for p, w in zip(cons[r][layer][j], want))]
                    report["states"] += 1
                    report["states_equal"] += len(hits) == 1
                    report["state_at_last"] += hits == [last]
            continue
        if tokens is not None:
            for layer in layers:
                want, got = _tokens(prod[0][layer], p_ids[g], tokens), _tokens(cons[0][layer], d_ids[g], tokens)
                report["attention_blocks"] += 1  # (a layer's tokens, compared as one)
                report["attention_equal"] += bool(want.shape == got.shape == (tokens, *want.shape[1:]) and
                                                  np.array_equal(want, got))
            continue
        for layer in layers:
            for j, b in enumerate(p_ids[g]):
                if not b:
                    continue
                for r in range(tp_to):
                    want = _expected(prod, layer, j, tp_to, r, sections)
                    got = [_array(p) for p in cons[r][layer][j]]
                    report["attention_blocks"] += 1
                    same = all(np.array_equal(a, w) for a, w in zip(got, want))
                    report["attention_equal"] += same
                    if not same:
                        report.setdefault("differ", []).append(_where(layer, j, r, got, want))
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--pairs", default=",".join(f"{a}:{b}" for a, b in PAIRS), help="prefill:decode engines")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    from testkit.vllm_engines import EngineSpec, tiny_qwen3_next
    from tests.engines.conftest import Engines, engine_env, kvlc_config, prefill, prompt

    root = Path(tempfile.mkdtemp(prefix="kvlc-hybrid-tp-bytes-"))
    model = tiny_qwen3_next(root / "qwen3-next")
    cfg = json.loads((model / "config.json").read_text())
    key = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    sections = (key, key, cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"])  # q | k | v channels
    e = Engines(root)
    t0 = time.monotonic()
    names = {n for pair in args.pairs.split(",") for n in pair.split(":")}
    for i, name in enumerate(n for n in TP if n in names):
        env = {**engine_env("0|1" if TP[name] == 2 else i % 2, single_process=TP[name] == 1),
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        e.start(name, EngineSpec(str(model), BLOCK.get(name, 32), dtype="bfloat16", tp=TP[name], env=env, prefix_caching=True,
                                 connector=kvlc_config("kv_both"), blocks_extension=True))
    doc = {"command": " ".join(["hybrid_tp_bytes.py", *(argv or sys.argv[1:])]), "tokens": args.tokens, "pairs": []}
    try:
        for name in names:
            e[name]
        print(f"engines up in {time.monotonic() - t0:.0f} s", flush=True)
        view = e[sorted(names)[0]].view()
        state_groups = {i for i, g in enumerate(view.groups) if g.kind.value == "mamba"}
        layers_of = {i: list(g.layer_names) for i, g in enumerate(view.groups)}
        a = next(i for i in layers_of if i not in state_groups)  # an attention group
        for n, (src, dst) in enumerate(pair.split(":") for pair in args.pairs.split(",")):
            runs = []
            for seed in range(20 + 10 * n, 20 + 10 * n + args.prompts):  # prompts no engine has seen: a decode
                p = prompt(args.tokens, seed=seed)                      # engine's own prefix hit would keep its bytes
                params = prefill(e[src], p)
                prod = e[src].rank_blocks(params["remote_block_ids"])  # before the load: then the producer frees them
                out, d_ids, cons = e[dst].load_and_read(p, params)
                if cons is None:
                    raise RuntimeError(f"{src} -> {dst}: the load never finished (recomputed): {out}")
                blocks = {_array(prod[0][layers_of[a][0]][0][0]).shape[1], _array(cons[0][layers_of[a][0]][0][0]).shape[1]}
                upto = params["remote_num_tokens"] if len(blocks) > 1 else None  # other block sizes: by token
                runs.append((params["remote_block_ids"], prod, d_ids, cons, upto))
                rep = compare(prod, cons, params["remote_block_ids"], d_ids, state_groups, layers_of, sections, upto)
                rep["attention_blocks_of"] = sorted(blocks)
                rep.update(src=src, dst=dst, seed=seed, num_cached_tokens=out.num_cached_tokens if out else None)
                doc["pairs"].append(rep)
            for k, rep in enumerate(doc["pairs"][-len(runs):]):  # control: another prompt's producer bytes
                p_ids, prod, _, _, _ = runs[(k + 1) % len(runs)]
                neg = compare(prod, runs[k][3], p_ids, runs[k][2], state_groups, layers_of, sections, runs[k][4])
                rep["control_attention_equal"] = neg["attention_equal"] if len(runs) > 1 else None
                rep["control_states_equal"] = neg["states_equal"] if len(runs) > 1 else None
                print(json.dumps(rep), flush=True)
    finally:
        e.close()
    ok = all(r["attention_equal"] == r["attention_blocks"] > 0 and r["states_equal"] == r["states"] ==
             r["state_at_last"] > 0 and r["control_attention_equal"] in (0, None) and
             r["control_states_equal"] in (0, None) for r in doc["pairs"])
    doc["verdict"] = "every byte equal" if ok else "MISMATCH"
    print(doc["verdict"])
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
