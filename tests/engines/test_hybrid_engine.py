"""`kvlc init --engine vllm` on hybrids equals what a real vLLM 0.32 CPU engine allocates.

Two tiny hybrids (dummy weights), started at once in single-process mode, one per core: a
Nemotron-H (layers M * M M * M: four Mamba-2 layers, two attention layers) and a Qwen3-Next
(six Gated-DeltaNet layers, full attention every fourth; its recurrent state is fp32 or bf16 by the
host's CPU, as kvlc init states). In each worker: the KV-cache groups, block size, page size and
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
                if len(views) == 2:   # conv [taps, sections], then ssm / recurrent [heads, ...]
                    out["live_state_dtypes"] = [str(v.dtype).removeprefix("torch.") for v in views]
                    conv, ssm = (v.float().numpy() for v in views)
                    sections = json.loads(sys.argv[4])
                    for f in r.fields:
                        item = 4 if f.dtype == "fp32" else 2
                        arr = np.lib.stride_tricks.as_strided(
                            flat[r.offset + f.offset:].view(np.float32 if item == 4 else np.uint16),
                            shape=(r.num_blocks,) + tuple(d.size for d in f.dims),
                            strides=(r.block_stride,) + tuple(d.stride for d in f.dims))
                        got = arr if item == 4 else (arr.astype(np.uint32) << 16).view(np.float32)
                        want = conv[:, :, slice(*sections[f.name])] if f.name in sections else ssm
                        if not np.array_equal(got, want, equal_nan=True):
                            raise AssertionError(f"{r.name} field {f.name} differs")
                        fields += 1
        out.update(checked=checked, fields=fields, num_blocks=kc.num_blocks)
        out.update(live_derivation(worker, cfg, kc.num_blocks))
        return out

    def live_derivation(worker, cfg, num_blocks):
        """The plan KvlcConnector derives from this worker's kv_caches, against kvlc init's (names given)."""
        from kvlc.compiler import compile_spec
        from kvlc.engines.vllm.derive.engine import worker_kv_caches
        from kvlc.engines.vllm.derive.spec import derive_plan, engine_view, exact_plan
        from kvlc.init import EngineOptions, init_yaml
        view = engine_view(*worker_kv_caches(worker))
        live = derive_plan(view)
        init = compile_spec(init_yaml(cfg, EngineOptions(engine="vllm", backend="CPU_ATTN", mem="DRAM", block_size=32,
                                                         num_blocks=num_blocks, name=live.name,
                                                         model_name=view.model.name)))
        exact = exact_plan(view)
        return {"digests": [live.digest, init.digest], "live_plan": live.text(),
                "exact_state_regions": [r.name for r in exact.regions if r.is_state],
                "exact_state_groups": [g.name for g in exact.groups if g.is_state]}

    if __name__ == "__main__":
        from vllm import LLM
        llm = LLM(model=sys.argv[1], load_format="dummy", enforce_eager=True, skip_tokenizer_init=True,
                  dtype="bfloat16", max_model_len=256, seed=0, max_num_seqs=2, max_num_batched_tokens=256,
                  kv_cache_memory_bytes=4 << 20, block_size=32)
        open(sys.argv[2], "w").write(json.dumps(llm.collective_rpc(check)[0]))
''')


def _nemotron_h(path: Path, transformers) -> None:
    """6 layers M*MM*M: 8 Mamba heads x 32, 2 groups x 16 states, conv 4; 2 KV heads x 64."""
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


def _qwen3_next(path: Path, transformers) -> None:
    """8 layers, full attention every 4th: DeltaNet 2 key heads x 32, 4 value heads x 16 (unequal, so the
    recurrent state's (v_heads, v_dim, k_dim) order shows), conv 4; 2 KV heads x 64."""
    cfg = transformers.Qwen3NextConfig(vocab_size=1024, hidden_size=256, num_hidden_layers=8, full_attention_interval=4,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                       linear_num_key_heads=2, linear_key_head_dim=32, linear_num_value_heads=4,
                                       linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
                                       num_experts_per_tok=2, moe_intermediate_size=128,
                                       shared_expert_intermediate_size=128, intermediate_size=512,
                                       max_position_embeddings=512, torch_dtype="bfloat16")
    cfg.architectures = ["Qwen3NextForCausalLM"]
    cfg.save_pretrained(path)


MODELS = {  # name: (config writer, conv sections in channels, per core)
    "nemotron-h": (_nemotron_h, {"conv.x": (0, 256), "conv.B": (256, 288), "conv.C": (288, 320)}, "0"),
    "qwen3-next": (_qwen3_next, {"conv.q": (0, 64), "conv.k": (64, 128), "conv.v": (128, 192)}, "1"),
}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """Each model's engine, started in parallel; name -> what its worker found (or the failing log)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("vllm")
    root = tmp_path_factory.mktemp("hybrids")
    (root / "check.py").write_text(WORKER)
    procs = {}
    for name, (write, sections, core) in MODELS.items():
        (root / name).mkdir()
        write(root / name, transformers)
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   VLLM_CPU_OMP_THREADS_BIND=core)
        procs[name] = subprocess.Popen([sys.executable, str(root / "check.py"), str(root / name),
                                        str(root / f"{name}.json"), str(root / name / "config.json"),
                                        json.dumps(sections)], cwd=root, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
    out = {}
    for name, proc in procs.items():
        log, _ = proc.communicate(timeout=600)
        out[name] = json.loads((root / f"{name}.json").read_text()) if proc.returncode == 0 else log[-4000:]
    return out


def torch_has_avx512_bf16() -> bool:
    """What vLLM's CPU platform asks: whether this CPU has AVX-512 BF16 (torch's own probe)."""
    import torch
    return bool(torch.cpu._is_avx512_bf16_supported())


def _agrees(live: dict, groups: list, block: int) -> None:
    assert live["digests"][0] == live["digests"][1], live["live_plan"]   # KvlcConnector's live derivation
    assert live["live_groups"] == live["kvlc_groups"] == groups
    assert live["live_block"] == live["kvlc_block"] == block
    assert live["live_place"] == live["kvlc_place"]


def test_mamba2_hybrid_spec_is_what_vllm_allocates(live):
    """Nemotron-H: groups (0,3) (2,5) (1,4), block 32 raised to 64, two pages per slot; every byte and field."""
    got = live["nemotron-h"]
    assert isinstance(got, dict), got
    _agrees(got, [[0, 3], [2, 5], [1, 4]], 64)
    page = 64 * 2 * 2 * 64 * 2
    assert sorted({tuple(p) for p in got["kvlc_place"].values()}) == [(0, page), (page * got["num_blocks"], page)]
    assert got["bound_bytes"] == 2 * page * got["num_blocks"]
    assert got["live_state_dtypes"] == ["bfloat16", "float32"]
    state = 3 * 320 * 2 + 8 * 32 * 16 * 4
    assert got["checked"] == got["num_blocks"] * (4 * state + 2 * page)
    assert got["fields"] == 4 * 4
    assert got["exact_state_regions"] == ["layer.0", "layer.2", "layer.3", "layer.5"]
    assert got["exact_state_groups"] == ["mamba", "mamba.1"]


def test_gated_deltanet_hybrid_spec_is_what_vllm_allocates(live):
    """Qwen3-Next: three DeltaNet groups and one full group of two layers, block 32 kept; every byte and field."""
    got = live["qwen3-next"]
    assert isinstance(got, dict), got
    _agrees(got, [[0, 4], [1, 5], [2, 6], [3, 7]], 32)
    page = 32 * 2 * 2 * 64 * 2
    # vLLM's CPU platform keeps an "auto" recurrent state in fp32 on a CPU with AVX-512 BF16, else in the
    # model dtype; kvlc init reads the same fact from this host (the field check above saw it right)
    fp32 = torch_has_avx512_bf16()
    assert got["live_state_dtypes"] == ["bfloat16", "float32" if fp32 else "bfloat16"]
    state = 3 * 192 * 2 + 4 * 16 * 32 * (4 if fp32 else 2)
    assert got["bound_bytes"] == 2 * page * got["num_blocks"]
    assert got["checked"] == got["num_blocks"] * (6 * state + 2 * page)
    assert got["fields"] == 6 * 4
    assert got["exact_state_regions"] == ["layer.0", "layer.1", "layer.2", "layer.4", "layer.5", "layer.6"]
    assert got["exact_state_groups"] == ["linear", "linear.1", "linear.2"]
