"""Start a real vLLM engine on CPU and read its engine views (what ``kvlc from-vllm --from-engine`` does).

The engine is built with the given options and no connector; each worker reads
its own view from its model runner (:class:`DeriveExtension`, called by name through
``collective_rpc``), so a TP engine gives one view per rank. Single-process mode
is used for TP 1, vLLM's default executor for TP > 1 (one worker process per rank).
"""

from __future__ import annotations

import os
from typing import Any

from kvlc.engines.vllm.derive.view import EngineView, ViewError


def worker_kv_caches(worker: Any) -> tuple[Any, Any, dict]:
    """(vllm_config, kv_cache_config, {layer name: tensor}) of a vLLM worker after start-up.

    The tensors are the ones a connector's ``register_kv_caches`` receives: each
    attention layer's ``kv_cache`` in the forward context.
    """
    runner = worker.model_runner
    config = worker.vllm_config
    kv_cache_config = runner.kv_cache_config
    ctx = config.compilation_config.static_forward_context
    names = [n for g in kv_cache_config.kv_cache_groups for n in g.layer_names]
    return config, kv_cache_config, {n: ctx[n].kv_cache for n in names if n in ctx}


class DeriveExtension:
    """Mixed into each vLLM worker (``worker_extension_cls``): ``collective_rpc("kvlc_engine_view")``
    returns that worker's view as plain data — a method name crosses processes, no pickled code."""

    def kvlc_engine_view(self) -> dict:
        from kvlc.engines.vllm.derive.spec import engine_view
        config, kv_cache_config, kv_caches = worker_kv_caches(self)
        return engine_view(config, kv_cache_config, kv_caches).to_dict()


EXTENSION = f"{__name__}.DeriveExtension"


def live_views(model: str, *, block_size: int, tp_size: int = 1, dtype: str = "bfloat16",
               kv_cache_memory_bytes: int = 64 << 20, max_model_len: int = 512,
               attention_backend: str | None = None, **llm_kwargs: Any) -> tuple[EngineView, ...]:
    """Start an engine for ``model`` (a local folder), read one view per TP rank, shut it down."""
    if tp_size == 1:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is for the spec
    try:
        from vllm import LLM
    except ImportError as exc:
        raise ViewError(f"--from-engine needs vLLM (pip install 'kvlc[vllm]'): {exc}") from None
    kwargs: dict[str, Any] = dict(model=model, load_format=llm_kwargs.pop("load_format", "safetensors"),
                                  enforce_eager=True, skip_tokenizer_init=True, dtype=dtype,
                                  max_model_len=max_model_len, seed=0, max_num_seqs=4,
                                  max_num_batched_tokens=max_model_len, kv_cache_memory_bytes=kv_cache_memory_bytes,
                                  block_size=block_size, tensor_parallel_size=tp_size,
                                  worker_extension_cls=EXTENSION)
    if attention_backend:
        kwargs["attention_backend"] = attention_backend
    kwargs.update(llm_kwargs)
    llm = LLM(**kwargs)
    try:
        views = tuple(EngineView.from_dict(d) for d in llm.collective_rpc("kvlc_engine_view"))
    finally:
        _shutdown(llm)
    return tuple(sorted(views, key=lambda v: v.parallel.tp_rank))


def _shutdown(llm: Any) -> None:
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
