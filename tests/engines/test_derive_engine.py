"""The derived spec of a real vLLM engine on CPU (tiny Llama, random weights written at set-up).

One test, two engines at once in their own processes:

* a TP 1 engine (single-process mode) that prefills a 69-token prompt; its worker derives
  the view from its live tensors, checks the derived plan against them and binds them,
  finds the prompt's real K and V (computed by transformers from the same weights) at the
  addresses of ``exact_plan`` (K stored transposed), and — after writing a pattern through
  the CPU kernels' own K/V views — reads every block back at the derived plan's addresses;
* ``kvlc from-vllm --from-engine`` on a TP 2 engine (vLLM's multi-process executor).

Both live specs equal what ``kvlc from-vllm`` derives from config.json without an
engine; across the two block sizes the specs refuse to pair and the exact plans pair both ways.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kvlc
from kvlc.compiler import compile_spec
from kvlc.engines.vllm.derive.cpu import ISA_LAYOUTS
from kvlc.engines.vllm.derive.spec import exact_plan, spec_yaml
from kvlc.engines.vllm.derive.view import EngineView
from kvlc.engines.vllm.derive.view import ViewError

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.engine

WORKER_CHECK = textwrap.dedent('''
    import json, os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    PROMPT = [(7 * i + 3) % 1000 + 1 for i in range(69)]   # 69 tokens: two full 32-token blocks and a tail

    def field_array(plan, region, field, flat):
        # every block of one bf16 field as float32 [blocks, *dims], read at the plan's byte strides only
        import numpy as np
        r = plan.region(region)
        f = r.field(field)
        words = flat.view(np.uint16)[(r.offset + f.offset) // 2:]
        a = np.lib.stride_tricks.as_strided(words, shape=(r.num_blocks,) + tuple(d.size for d in f.dims),
                                            strides=(r.block_stride,) + tuple(d.stride for d in f.dims))
        order = [0] + [1 + [d.name for d in f.dims].index(n) for n in ("head", "token", "head_dim")]
        return (a.astype(np.uint32) << 16).view(np.float32).transpose(order)   # [B, H, N, D]

    def real_content(plan, flat, model):
        # the prefill's K and V, computed by transformers from the same weights, found at the plan's addresses
        import numpy as np, torch
        from transformers import LlamaForCausalLM
        hf = LlamaForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
        with torch.no_grad():
            cache = hf(torch.tensor([PROMPT]), use_cache=True).past_key_values
        out = []
        for i, layer in enumerate(cache.layers):
            for name, ref in (("k", layer.keys[0]), ("v", layer.values[0])):
                ref = ref.float().numpy()                          # [H, S, D]
                arr = field_array(plan, f"layer.{i}", name, flat)  # [B, H, N, D]
                N = arr.shape[2]
                for c in range(-(-len(PROMPT) // N)):
                    want = ref[:, c * N:(c + 1) * N]
                    n = want.shape[1]
                    err = np.abs(arr[:, :, :n] - want[None]).reshape(arr.shape[0], -1).max(axis=1)
                    best = np.argsort(err)[:2]
                    out.append([i, name, c, int(best[0]), float(err[best[0]]), float(err[best[1]]),
                                float(np.abs(want).max())])
        return out

    def check(worker):
        import numpy as np, torch
        from kvlc.engines.vllm.derive.cpu import ISA_LAYOUTS
        from kvlc.engines.vllm.derive.spec import check_spec, derive_plan, engine_view, exact_plan
        from kvlc.engines.vllm.derive.storages import storage_tensors
        from kvlc.engines.vllm.derive.engine import worker_kv_caches
        from kvlc.runtime.binding import bind
        config, kv_cache_config, kv = worker_kv_caches(worker)
        view = engine_view(config, kv_cache_config, kv)
        plan = derive_plan(view)
        check_spec(plan, view)
        tensors = storage_tensors(plan, view, kv)
        bound = bind(plan, tensors)
        flat = tensors["kv"].numpy()
        result = {"view": view.to_dict(), "nbytes": bound["kv"].nbytes, "layers": len(kv),
                  "same_allocation": len({t.untyped_storage().data_ptr() for t in kv.values()})}
        if view.cpu_isa in ISA_LAYOUTS:
            result["exact"] = real_content(exact_plan(view), flat, MODEL)
            # negative control: the K half read in the view's own [token][head_dim] order is not the K
            naive = _as_view_order(exact_plan(view))
            result["naive_k"] = [row for row in real_content(naive, flat, MODEL) if row[1] == "k"]
        gen = torch.Generator().manual_seed(11)
        for t in kv.values():   # the CPU kernels' view: [B, H, 2N, D] split in halves along dim 2
            B, H, N, C = t.shape
            for half in t.view(B, H, 2 * N, C // 2).chunk(2, dim=2):
                half.view(torch.int16).copy_(torch.randint(-2**15, 2**15, half.shape, generator=gen,
                                                           dtype=torch.int16))
        base = bound["kv"].addr
        rows = plan.local_descriptors({"kv": base})
        checked, start = 0, 0
        for r in plan.regions:
            t = kv[next(n for n in kv if f".{r.name.split('.')[1]}." in f".{n}.")]
            B, H, N, C = t.shape
            k, v = t.view(B, H, 2 * N, C // 2).chunk(2, dim=2)
            for b in range(r.num_blocks):
                addr, length, _ = rows[start + b].tolist()
                want = torch.stack([k[b], v[b]], dim=1).contiguous().view(torch.uint8).numpy().ravel()
                if not np.array_equal(flat[addr - base:addr - base + length], want):
                    raise AssertionError(f"{r.name} block {b}: bytes differ")
                checked += length
            start += r.num_blocks
        result["checked"] = checked
        return result

    def _as_view_order(plan):
        # the k field with V's dim order: what a reader who trusts the [B, H, N, D] view would assume
        regions = []
        for r in plan.regions:
            k, v = r.fields
            regions.append(r.model_copy(update={"fields": (k.model_copy(update={"dims": v.dims}), v)}))
        return plan.model_copy(update={"regions": tuple(regions)})

    if __name__ == "__main__":
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        MODEL = sys.argv[1]
        llm = LLM(model=MODEL, load_format="safetensors", enforce_eager=True, skip_tokenizer_init=True,
                  dtype="bfloat16", max_model_len=512, seed=0, max_num_seqs=4, max_num_batched_tokens=512,
                  kv_cache_memory_bytes=8 << 20, block_size=32)
        out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)],
                           SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, detokenize=False))
        result = llm.collective_rpc(check)[0]
        result["tokens"] = list(out[0].outputs[0].token_ids)
        open(sys.argv[2], "w").write(json.dumps(result))
''')


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A 2-layer Llama (2 KV heads x 64, bf16) with random weights, as safetensors."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("vllm")
    path = tmp_path_factory.mktemp("tiny-llama")
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=512,
                                   initializer_range=0.2, torch_dtype="bfloat16")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path


def _env(bind_cores: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               VLLM_CPU_OMP_THREADS_BIND=bind_cores)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    return env


def test_live_engine_spec_is_derived_checked_bound_and_pairs(tiny_llama, tmp_path):
    """A live CPU engine's derived plan passes check_spec and binds its one allocation; the prefill's
    real K and V lie at exact_plan's addresses; every block the kernel's K/V views hold is at the
    derived plan's address; `from-vllm --from-engine` (TP 2) and the engine-free derivation give
    the same specs; TP 2 / TP 1 exact plans of other block sizes pair both ways."""
    script, result = tmp_path / "check.py", tmp_path / "result.json"
    script.write_text(WORKER_CHECK)
    tp2_yaml, tp2_view = tmp_path / "tp2.yaml", tmp_path / "tp2.json"
    checker = subprocess.Popen([sys.executable, str(script), str(tiny_llama), str(result)], cwd=tmp_path,
                               env=_env("0"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cli = subprocess.run([sys.executable, "-m", "kvlc.cli", "from-vllm", str(tiny_llama), "--from-engine",
                          "--tp-size", "2", "--block-size", "64", "--kv-cache-mib", "8", "-o", str(tp2_yaml),
                          "--save-view", str(tp2_view)], cwd=tmp_path, env=_env("0|1"), capture_output=True,
                         text=True, timeout=540)
    log, _ = checker.communicate(timeout=540)
    assert checker.returncode == 0, log[-4000:]
    assert cli.returncode == 0, (cli.stdout + cli.stderr)[-4000:]

    live = json.loads(result.read_text())
    tp1 = EngineView.from_dict(live["view"])
    if tp1.cpu_isa in ISA_LAYOUTS:  # the real prefill's K and V are where exact_plan says, each chunk once
        blocks = {}
        for layer, field, chunk, block, err, second, scale in live["exact"]:
            tol = 0.02 if layer == 0 else 0.1  # layer 1's inputs already differ by bf16 rounding
            assert err <= tol * scale and second >= 0.5 * scale, (layer, field, chunk, err, second, scale)
            blocks.setdefault((layer, chunk), set()).add(block)
        assert all(len(b) == 1 for b in blocks.values()) and len(blocks) == 2 * 3
        assert len({b.pop() for b in blocks.values()}) == 3  # 3 chunks in 3 blocks, the same in both layers
        assert all(err > 0.2 * scale for *_, err, _, scale in live["naive_k"])  # K is not in the view's order
    else:
        with pytest.raises(ViewError, match="not measured"):
            exact_plan(tp1)
    assert live["layers"] == 2 and live["same_allocation"] == 1 and len(live["tokens"]) == 4
    assert live["checked"] == 2 * tp1.num_blocks * 2 * 32 * 2 * 64 * 2  # every block of both layers
    assert (tp1.backend, tp1.kv_cache_layout, tp1.parallel.tp_size) == ("CPU_ATTN", "LBHNC", 1)

    tp2 = EngineView.from_dict(json.loads(tp2_view.read_text()))
    assert (tp2.parallel.tp_size, tp2.layers[0].shape[1], tp2.block_size) == (2, 1, 64)
    assert tp2_yaml.read_text() == spec_yaml(tp2)

    for v, extra in ((tp1, ["--block-size", "32"]), (tp2, ["--block-size", "64", "--tp-size", "2"])):
        offline = subprocess.run([sys.executable, "-m", "kvlc.cli", "from-vllm", str(tiny_llama),
                                  "--num-blocks", str(v.num_blocks), *extra], cwd=tmp_path, env=_env("0"),
                                 capture_output=True, text=True, timeout=120)
        assert offline.returncode == 0, offline.stderr
        assert compile_spec(offline.stdout).text() == compile_spec(spec_yaml(v)).text()

    # TP 2 / 64-token blocks against TP 1 / 32-token blocks: the specs refuse (K/V halves are opaque
    # cells), the exact plans pair both ways, from every rank
    a, b = compile_spec(tp2_yaml.read_text()), compile_spec(spec_yaml(tp1))
    assert "token-tiling" in kvlc.check_pair(a, b, local_rank=0, direction="READ").codes()
    if tp1.cpu_isa in ISA_LAYOUTS:
        a, b = exact_plan(tp2), exact_plan(tp1)
        for local, remote in ((a, b), (b, a)):
            for rank in range(local.parallel.tp_size):
                assert kvlc.pair(local, remote, local_rank=rank, direction="READ").report.ok
