"""CPU_ATTN's block interior per attention ISA, as vLLM 0.32's CPU kernels write it.

vLLM's CPU backend (``vllm/v1/attention/backends/cpu_attn.py``, ``_get_attn_isa``) picks one
ISA per KV-cache group: ``vec16`` when the head size is a multiple of 16 but not of 32;
``amx`` for bf16 on a CPU with AMX tiles (block size a multiple of 32); ``neon`` on Arm;
``rvv`` / ``vxe`` / ``vsx`` on RISC-V / s390x / POWER; ``vec`` otherwise (AVX2/AVX-512 x86,
and every dtype but bf16 on AMX hosts). The kernels re-view each KV head's ``[N][2D]`` rows
of a block as ``[2N][D]`` and split them: a K half, then a V half, ``N * D`` elements each.
Inside the halves the order is the ISA's, established with vLLM's own
``cpu_attn_reshape_and_cache`` (``tests/engines/test_cpu_layout.py`` checks these against it):

=========  ============================  ============================  =================
ISA        K half                        V half                        tokens per entry
=========  ============================  ============================  =================
vec, vec16 ``K[D][N]`` (transposed)      ``V[N][D]``                   1
amx        ``K[N/16][D/2][16][2]``       ``V[D/16][N/2][16][2]``       16
=========  ============================  ============================  =================

AMX keeps K as B tiles of 16 tokens (pairs of dims interleaved per token) and V as B tiles
of pairs of tokens: one token's K and V are never a run of its own, but 16 consecutive
tokens (an *entry*, from token 0 of the block) are: a K run of ``16 * D`` elements and
``D / 16`` V runs of 256. The plan therefore moves tokens in entries of 16
(``tokens_per_entry``). A vec engine and an amx engine cannot pair: no byte range of one
holds whole tokens of the other, and kvlc refuses it (the ``tokens-per-entry`` finding).

The spec language orders a field's dims row-major, so the derived spec keeps each half as
one opaque ``cell`` (exact bytes; engines of one block size pair); :func:`cpu_exact_plan`
gives the plan the real strides, so engines of different block sizes pair too.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlc.compiler.plan.model import PlanDim, PlanField
from kvlc.engines.vllm.derive.view import EngineView, KvPacking, ViewError


@dataclass(frozen=True)
class IsaLayout:
    """How one ISA orders a K/V half: tokens per entry, and the dims of K and V (outermost first).

    A dim is ``(name, size, element stride)``, sizes and strides as functions of (N, D);
    the ``token`` dim counts entries of ``tokens_per_entry`` tokens.
    """

    name: str
    tokens_per_entry: int
    words: str

    def k_dims(self, n: int, d: int) -> tuple[tuple[str, int, int], ...]:
        if self.tokens_per_entry == 1:
            return ("head_dim", d, n), ("token", n, 1)
        return ("token", n // 16, 16 * d), ("cell", 16 * d, 1)

    def v_dims(self, n: int, d: int) -> tuple[tuple[str, int, int], ...]:
        if self.tokens_per_entry == 1:
            return ("token", n, d), ("head_dim", d, 1)
        return ("head_dim_tile", d // 16, 16 * n), ("token", n // 16, 256), ("cell", 256, 1)


_VEC = IsaLayout("vec", 1, "K[head_dim][token], V[token][head_dim]")
ISA_LAYOUTS = {"vec": _VEC, "vec16": IsaLayout("vec16", 1, _VEC.words),
               "amx": IsaLayout("amx", 16, "K[token/16][head_dim/2][16][2], V[head_dim/16][token/2][16][2] "
                                           "(AMX tiles: tokens move in entries of 16)")}
OTHER_ISAS = {"neon": "Arm", "rvv": "RISC-V", "vxe": "s390x", "vsx": "POWER"}


def isa_layout(isa: str) -> IsaLayout:
    """The layout of ``isa`` (a :class:`ViewError` with the fix for an ISA kvlc has not established)."""
    layout = ISA_LAYOUTS.get(isa)
    if layout is not None:
        return layout
    where = f" (vLLM picks it on {OTHER_ISAS[isa]})" if isa in OTHER_ISAS else ""
    raise ViewError(f"the CPU attention ISA '{isa or 'unknown'}'{where}: kvlc has not established the order "
                    f"inside its K/V halves (it knows {', '.join(ISA_LAYOUTS)}); fix: give both engines the spec "
                    "`kvlc from-vllm --from-engine` writes (kv_connector_extra_config.spec): whole K/V halves, "
                    "engines of the same ISA and block size")


ISA_CHOICES = ("auto", "vec", "vec16", "amx")  # what ``kvlc init`` / ``from-vllm`` take as ``--cpu-isa``
_AMX_DTYPES = ("bf16", "fp8_e4m3", "fp8_e5m2")  # KV dtypes of a bf16 model (vLLM's dtype test is the model's)


def pick_isa(kv_dtype: str, block_size: int, head_size: int, amx: bool) -> str:
    """The ISA vLLM 0.32 picks on an x86 host (``cpu_attn._get_attn_isa``) for a KV-cache group of
    ``block_size`` tokens and ``head_size``; ``amx``: the host has AMX tiles. The model dtype it tests is
    taken as the KV dtype (an fp8 cache counts as a bf16 model's).

    >>> pick_isa("bf16", 32, 128, amx=True), pick_isa("bf16", 128, 128, amx=False), pick_isa("bf16", 16, 128, amx=True)
    ('amx', 'vec', 'vec16')
    >>> pick_isa("fp32", 32, 128, amx=True), pick_isa("bf16", 32, 80, amx=True)
    ('vec', 'vec16')
    """
    if head_size % 32 and head_size % 16 == 0:
        return "vec16"
    if amx and kv_dtype in _AMX_DTYPES and block_size % 32 == 0:
        return "amx"
    return "vec" if block_size % 32 == 0 else "vec16"


def host_flags() -> frozenset[str]:
    """This host's CPU flags (``/proc/cpuinfo``; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[-1].split())
    except OSError:
        pass
    return frozenset()


def host_amx() -> bool:
    """Whether this host has AMX tiles (``amx_tile``; vLLM asks ``torch.cpu._is_amx_tile_supported()``)."""
    return "amx_tile" in host_flags()


def backend_isa(asked: str, backend: str) -> str:
    """The ``cpu_isa`` an offline view of ``backend`` is given: ``asked`` on CPU_ATTN; elsewhere none, where only
    ``auto`` may be asked (a :class:`ViewError` naming ``--cpu-isa`` otherwise)."""
    if backend == "CPU_ATTN":
        return asked
    if asked != "auto":
        raise ViewError(f"--cpu-isa {asked}: only vLLM's CPU_ATTN backend has a CPU attention ISA (--backend "
                        f"{backend}); fix: drop --cpu-isa")
    return ""


def resolve_isa(asked: str, *, kv_dtype: str, block_size: int, head_size: int, option: str = "--cpu-isa") -> str:
    """The ISA of an engine described offline: ``asked`` ``auto`` is what vLLM 0.32 picks on this host
    (:func:`pick_isa`, :func:`host_amx`); another is checked to be one it picks for these on some x86 host (a
    :class:`ViewError` naming ``option`` otherwise)."""
    if asked == "auto":
        return pick_isa(kv_dtype, block_size, head_size, host_amx())
    if asked not in ISA_LAYOUTS:
        raise ViewError(f"{option} '{asked}': kvlc knows the CPU attention ISAs {', '.join(ISA_CHOICES)}; "
                        f"fix: one of them (auto: as vLLM picks on this host)")
    possible = {pick_isa(kv_dtype, block_size, head_size, amx) for amx in (False, True)}
    if asked not in possible:
        raise ViewError(f"{option} '{asked}': vLLM 0.32 picks {' or '.join(sorted(possible))} for a {kv_dtype} "
                        f"cache of {block_size}-token blocks and head size {head_size} (amx: bf16, blocks a "
                        "multiple of 32, on a host with AMX; vec16: head sizes a multiple of 16 but not of 32, "
                        f"or blocks not a multiple of 32); fix: {option} auto (this host) or "
                        f"{' / '.join(sorted(possible))}")
    return asked


def tokens_per_entry(view: EngineView) -> int:
    """Tokens one entry of a CPU block covers for the view's ISA (1 for other backends and unknown ISAs)."""
    if view.kv_packing != KvPacking.PER_HEAD_BLOCK or view.cpu_isa not in ISA_LAYOUTS:
        return 1
    return ISA_LAYOUTS[view.cpu_isa].tokens_per_entry


def _field(name: str, kv: PlanField, dims, offset: int) -> PlanField:
    """Field ``name`` of the region's opaque ``kv`` field: its head dim, then ``dims`` in bytes."""
    item = kv.itemsize
    out = [kv.dims[0]]  # the head dim: per head a K half, then a V half
    for dim, size, stride in dims:
        role = "token" if dim == "token" else ""
        out.append(PlanDim(name=dim, role=role, size=size, global_size=size, stride=stride * item))
    return PlanField(name=name, dtype=kv.dtype, itemsize=item, offset=offset, dims=tuple(out))


def _fields(region, layout: IsaLayout, head_dim: int) -> tuple[PlanField, PlanField]:
    kv = region.fields[0]
    n = region.block_tokens
    k = _field("k", kv, layout.k_dims(n, head_dim), kv.offset)
    v = _field("v", kv, layout.v_dims(n, head_dim), kv.offset + n * head_dim * kv.itemsize)
    return k, v


def cpu_exact_plan(view: EngineView, plan):
    """``plan`` (derived from ``view``) with exact K/V fields when ``view`` is CPU_ATTN; else ``plan``."""
    if view.kv_packing != KvPacking.PER_HEAD_BLOCK:
        return plan
    layout = isa_layout(view.cpu_isa)
    regions = tuple(r if r.is_state else   # a hybrid's state regions hold no K/V: as derived
                    r.model_copy(update={"fields": _fields(r, layout, view.model.head_dim),
                                         "tokens_per_entry": layout.tokens_per_entry}) for r in plan.regions)
    groups = tuple(g if g.is_state else g.model_copy(update={"tokens_per_entry": layout.tokens_per_entry})
                   for g in plan.groups)
    return plan.model_copy(update={"regions": regions, "groups": groups, "name": plan.name + "-exact"})


def _tokens(n: int) -> str:
    return f"{n} token" + "s" * (n != 1)


def isa_mismatch(local: str, remote: str) -> str | None:
    """Why engines of CPU attention ISAs ``local`` and ``remote`` cannot pair; None when they can (or
    when one is not a CPU engine or its ISA is unknown: pairing decides then).

    >>> isa_mismatch("vec", "vec16") is None
    True
    """
    a, b = ISA_LAYOUTS.get(local), ISA_LAYOUTS.get(remote)
    if a is None or b is None or a.tokens_per_entry == b.tokens_per_entry:
        return None
    return (f"this engine's CPU attention ISA is '{local}' ({a.words}), the other engine's is '{remote}' "
            f"({b.words}): one block holds tokens in entries of {_tokens(a.tokens_per_entry)}, the other in "
            f"entries of {_tokens(b.tokens_per_entry)}, so no byte range of one holds whole tokens of the "
            "other; fix: run both engines on one ISA: vLLM picks amx only for bfloat16 on a CPU with AMX, so give both engines "
            "--dtype float16 (or float32), or run both on hosts with AMX (or both without)")
