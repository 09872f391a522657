"""`kvlc init --engine vllm` on a Mamba-2 hybrid equals what a real vLLM 0.32 CPU engine allocates.

A tiny Nemotron-H (layers M * M M * M: four Mamba-2 layers, two attention layers; dummy weights)
is started in single-process mode. In its worker: the KV-cache groups, block size, page size and
every layer's placement are read from vLLM's own ``KVCacheConfig``; then, one layer at a time,
content-coded bytes are written through the layer's own views (conv and SSM state tensors, the
attention ``[B, H, N, 2D]`` view) and read back at the addresses of the spec ``kvlc init`` wrote
offline: every block of every region, each state field (x, B, C sections per tap, SSM) where its
plan field says. The engine's one allocation binds to the plan's one storage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.engine

PATTERN = "M*MM*M"
WORKER = textwrap.dedent('''
    import json, os, re, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    def check(worker):
        import numpy as np, torch
        from kvlc.compiler import compile_spec
        from kvlc.init import EngineOptions, init_yaml
        from kvlc.runtime.binding import bind
        kc = worker.model_runner.kv_cache_config
        ctx = worker.vllm_config.compilation_config.static_forward_context
        cfg = json.load(open(sys.argv[3]))
        idx = lambda n: int(re.search(r"layers\\.(\\d+)", n).group(1))
        plan = compile_spec(init_yaml(cfg, EngineOptions(engine="vllm", backend="CPU_ATTN", mem="DRAM",
                                                         block_size=32, num_blocks=kc.num_blocks)))
        out = {"live_groups": [[idx(n) for n in g.layer_names] for g in kc.kv_cache_groups],
               "kvlc_groups": [[int(r.name.split(".")[1]) for r in plan.regions if r.groups == (g.name,)]
                               for g in plan.groups],
               "live_block": worker.vllm_config.cache_config.block_size,
               "kvlc_block": next(g.block_size for g in plan.groups if g.kind == "full_attention"),
               "live_place": {idx(n): [t.offset + k * t.layer_stride, t.block_stride]
                              for t in kc.kv_cache_tensors for k, n in enumerate(t.layers)},
               "kvlc_place": {int(r.name.split(".")[1]): [r.offset, r.block_stride] for r in plan.regions}}
        first = ctx[kc.kv_cache_groups[0].layer_names[0]].kv_cache[0]
        raw = torch.empty(0, dtype=torch.uint8).set_(first.untyped_storage())
        bound = bind(plan, {"kv": raw})
        out["bound_bytes"] = bound["kv"].nbytes
        flat = raw.numpy()
        base = raw.data_ptr()
        gen = torch.Generator().manual_seed(3)
        checked = fields = 0
        for g in kc.kv_cache_groups:
            for name in g.layer_names:
                views = ctx[name].kv_cache
                views = list(views) if isinstance(views, (list, tuple)) else [views]
                for v in views:   # content-coded: random words through vLLM's own view of this layer
                    v.view(torch.uint8).copy_(torch.randint(0, 256, v.view(torch.uint8).shape, generator=gen,
                                                            dtype=torch.uint8))
                r = plan.region(f"layer.{idx(name)}")
                for b in range(r.num_blocks):
                    start = r.offset + b * r.block_stride
                    want = b"".join(v[b].contiguous().view(torch.uint8).numpy().tobytes() for v in views)
                    if flat[start:start + len(want)].tobytes() != want:
                        raise AssertionError(f"{r.name} block {b}: bytes differ")
                    checked += len(want)
                if len(views) == 2:   # Mamba: conv [taps, x|B|C], ssm [heads, head_dim, state]
                    conv, ssm = (v.float().numpy() for v in views)
                    sections = {"conv.x": (0, 256), "conv.B": (256, 288), "conv.C": (288, 320)}
                    for f in r.fields:
                        item = 4 if f.dtype == "fp32" else 2
                        arr = np.lib.stride_tricks.as_strided(
                            flat[r.offset + f.offset:].view(np.float32 if item == 4 else np.uint16),
                            shape=(r.num_blocks,) + tuple(d.size for d in f.dims),
                            strides=(r.block_stride,) + tuple(d.stride for d in f.dims))
                        got = arr if item == 4 else (arr.astype(np.uint32) << 16).view(np.float32)
                        want = ssm if f.name == "ssm" else conv[:, :, slice(*sections[f.name])]
                        if not np.array_equal(got, want, equal_nan=True):
                            raise AssertionError(f"{r.name} field {f.name} differs")
                        fields += 1
        out.update(checked=checked, fields=fields, num_blocks=kc.num_blocks)
        return out

    if __name__ == "__main__":
        from vllm import LLM
        llm = LLM(model=sys.argv[1], load_format="dummy", enforce_eager=True, skip_tokenizer_init=True,
                  dtype="bfloat16", max_model_len=256, seed=0, max_num_seqs=2, max_num_batched_tokens=256,
                  kv_cache_memory_bytes=4 << 20, block_size=32)
        open(sys.argv[2], "w").write(json.dumps(llm.collective_rpc(check)[0]))
''')


@pytest.fixture(scope="module")
def tiny_nemotron_h(tmp_path_factory):
    """A 6-layer Nemotron-H config (8 Mamba heads x 32, 2 groups x 16 states; 2 KV heads x 64)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("vllm")
    path = tmp_path_factory.mktemp("tiny-nemotron-h")
    cfg = transformers.NemotronHConfig(vocab_size=1024, hidden_size=256, num_hidden_layers=len(PATTERN),
                                       hybrid_override_pattern=PATTERN, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=64, mamba_num_heads=8, mamba_head_dim=32, n_groups=2,
                                       ssm_state_size=16, conv_kernel=4, intermediate_size=512,
                                       max_position_embeddings=512, torch_dtype="bfloat16")
    cfg.save_pretrained(path)
    data = json.loads((path / "config.json").read_text())
    data.pop("layers_block_type", None)   # keep the pattern kvlc init and vLLM both read
    data.update(architectures=["NemotronHForCausalLM"], hybrid_override_pattern=PATTERN,
                num_hidden_layers=len(PATTERN), attention_head_dim=64)
    (path / "config.json").write_text(json.dumps(data))
    return path


def test_init_spec_is_what_vllm_allocates_for_a_mamba_hybrid(tiny_nemotron_h, tmp_path):
    """Groups, block size, placement and every byte of every layer's blocks agree with the live engine."""
    script, result = tmp_path / "check.py", tmp_path / "result.json"
    script.write_text(WORKER)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               VLLM_CPU_OMP_THREADS_BIND="0")
    run = subprocess.run([sys.executable, str(script), str(tiny_nemotron_h), str(result),
                          str(tiny_nemotron_h / "config.json")], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=540)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    live = json.loads(result.read_text())
    assert live["live_groups"] == live["kvlc_groups"] == [[0, 3], [2, 5], [1, 4]]
    assert live["live_block"] == live["kvlc_block"] == 64
    assert live["live_place"] == live["kvlc_place"]
    page = 64 * 2 * 2 * 64 * 2
    assert sorted({tuple(p) for p in live["kvlc_place"].values()}) == [(0, page), (page * live["num_blocks"], page)]
    assert live["bound_bytes"] == 2 * page * live["num_blocks"]
    state, attn = 3 * 320 * 2 + 8 * 32 * 16 * 4, page
    assert live["checked"] == live["num_blocks"] * (4 * state + 2 * attn)
    assert live["fields"] == 4 * 4
