"""Engine descriptions as data: which backends an engine has and how each lays out K/V.

An engine description is what ``kvlc init`` needs besides the model: engine and
backend, parallelism, block size, KV dtype, memory type, block counts
(:class:`EngineOptions`). A backend (:class:`Backend`) says how paged K/V sits
in memory; MLA latents, the indexer and Mamba/DeltaNet states have one layout
each, whatever the backend.

Engine ``kvlc`` names the cache shapes of the checked-in layouts:

=============  =====================================================================
backend        paged K/V
=============  =====================================================================
paged-nhd      one tensor per layer; each block holds K then V, each (token, head, head_dim)
paged-hnd      the same with heads outermost: (head, token, head_dim)
split-nhd      one tensor per layer: all K blocks, then all V blocks (two regions)
split-hnd      the same, heads outermost
pooled-nhd     one allocation per attention kind; a layer's K and V are runs of blocks in it
pooled-hnd     the same, heads outermost
=============  =====================================================================

>>> ENGINES["kvlc"]["paged-hnd"].order
('head', 'token')
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvlc.errors import did_you_mean
from kvlc.init.model import InitError


class KvPlacement(str, Enum):
    """Where a layer's V lies relative to its K."""

    BLOCK = "block"      # inside each block, after K (one region per layer)
    TENSOR = "tensor"    # all K blocks, then all V blocks of one tensor (regions .k and .v)
    POOL = "pool"        # K then V blocks carved from a pool per attention kind (regions .k and .v)


@dataclass(frozen=True)
class Backend:
    """How one backend stores paged K/V: the order of token and head inside a field, and V's place."""

    order: tuple[str, str]
    placement: KvPlacement


NHD, HND = ("token", "head"), ("head", "token")
ENGINES: dict[str, dict[str, Backend]] = {
    "kvlc": {
        "paged-nhd": Backend(NHD, KvPlacement.BLOCK),
        "paged-hnd": Backend(HND, KvPlacement.BLOCK),
        "split-nhd": Backend(NHD, KvPlacement.TENSOR),
        "split-hnd": Backend(HND, KvPlacement.TENSOR),
        "pooled-nhd": Backend(NHD, KvPlacement.POOL),
        "pooled-hnd": Backend(HND, KvPlacement.POOL),
    },
}
MEMS = ("VRAM", "DRAM")


@dataclass(frozen=True)
class EngineOptions:
    """One engine's description for ``kvlc init`` (block counts: per region, in scheduler blocks).

    ``layers`` is the pipeline stage's ``[start, stop)`` (None: all layers; ``pp_size``
    and ``pp_rank`` give an even split instead). ``sliding_blocks`` / ``state_slots``
    default to ``num_blocks``. ``mamba_ssm_cache_dtype`` is vLLM's flag of that name (the
    dtype of a hybrid's SSM state); ``cpu_avx512_bf16`` says whether a vLLM CPU engine's host
    has AVX-512 BF16, which changes that dtype (None: whether the host running init has it); ``cpu_isa``
    is a vLLM CPU_ATTN engine's attention ISA, which orders its blocks (``auto``: what vLLM 0.32 picks
    on the host running init: ``amx`` for bf16 where it has AMX).
    """

    engine: str = "kvlc"
    backend: str = "paged-nhd"
    tp_size: int = 1
    pp_size: int = 1
    pp_rank: int = 0
    layers: tuple[int, int] | None = None
    pcp_size: int = 1
    dcp_size: int = 1
    dcp_interleave: int = 1
    block_size: int = 16
    kernel_block_size: int | None = None
    kv_dtype: str = "bf16"
    mem: str = "VRAM"
    device: int = 0
    num_blocks: int = 4096
    sliding_blocks: int | None = None
    state_slots: int | None = None
    draft_layers: bool = True
    mamba_ssm_cache_dtype: str = "auto"
    cpu_avx512_bf16: bool | None = None
    cpu_isa: str = "auto"
    name: str = ""
    model_name: str = ""


def default_block_size(engine: str, backend: str) -> int:
    """Tokens per block an engine takes when not told: vLLM 0.32's CPU platform picks 128 for CPU_ATTN
    (``platforms/cpu.py``), its other backends (CPU_MLA's reference path included) 16, as kvlc's engines.

    >>> default_block_size("vllm", "CPU_ATTN"), default_block_size("vllm", "FLASH_ATTN")
    (128, 16)
    """
    return 128 if (engine, backend) == ("vllm", "CPU_ATTN") else 16


def backend_of(opts: EngineOptions) -> Backend:
    """The backend an engine description names, or an :class:`InitError` saying which exist."""
    if opts.engine not in ENGINES:
        raise InitError(f"--engine '{opts.engine}': unknown engine; {did_you_mean(opts.engine, [*ENGINES, 'vllm'])}")
    backends = ENGINES[opts.engine]
    if opts.backend not in backends:
        raise InitError(f"--backend '{opts.backend}': engine '{opts.engine}' has no such backend; "
                        f"{did_you_mean(opts.backend, backends)}")
    return backends[opts.backend]


def stage_layers(opts: EngineOptions, num_layers: int) -> tuple[int, int] | None:
    """The layer window of this engine: ``layers``, or stage ``pp_rank`` of an even ``pp_size`` split.

    The first ``num_layers % pp_size`` stages hold one layer more.

    >>> stage_layers(EngineOptions(pp_size=3, pp_rank=1), 62)
    (21, 42)
    """
    if opts.layers is not None:
        start, stop = opts.layers
        if not 0 <= start < stop <= num_layers:
            raise InitError(f"--layers {start}:{stop} is not a window of the model's {num_layers} layers; "
                            f"expected 0 <= start < stop <= {num_layers}")
        return (start, stop) if (start, stop) != (0, num_layers) else None
    pp, rank = opts.pp_size, opts.pp_rank
    if pp < 1 or not 0 <= rank < pp or pp > num_layers:
        raise InitError(f"--pp-size {pp} --pp-rank {rank}: expected 1 <= pp_size <= {num_layers} layers "
                        "and 0 <= pp_rank < pp_size")
    if pp == 1:
        return None
    base, extra = divmod(num_layers, pp)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def dcp_parallel(opts: EngineOptions) -> dict:
    """The ``parallel`` keys of context parallelism, prefill and decode (none without it)."""
    out = {"pcp_size": opts.pcp_size} if opts.pcp_size != 1 else {}
    out.update({"dcp_size": opts.dcp_size} if opts.dcp_size != 1 else {})
    return {**out, "dcp_interleave": opts.dcp_interleave} if opts.dcp_interleave != 1 else out
