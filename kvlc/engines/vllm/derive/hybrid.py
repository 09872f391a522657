"""vLLM 0.32's hybrid page pool, offline: attention and Mamba-2 / Gated-DeltaNet layers over one allocation.

What vLLM 0.32 allocates for a hybrid model (restated from its ``kv_cache_utils``,
``platforms.interface._align_hybrid_block_size``, ``MambaStateShapeCalculator`` and
``MambaBase.bind_kv_cache``; not copied):

* **State per layer and rank.** Mamba-1 (Jamba, ``mamba1_state_shape``): a conv state of
  ``mamba_d_conv - 1`` taps over ``mamba_expand * hidden_size`` channels, taps outer, then an
  SSM state ``(channels, mamba_d_state)``; channels split by TP. Mamba-2: a conv state of ``conv_kernel - 1`` taps over the
  ``x | B | C`` channels (``mamba_num_heads * mamba_head_dim``, ``n_groups * ssm_state_size``
  twice), taps outer ("SD" order), then an SSM state ``(mamba_num_heads, mamba_head_dim,
  ssm_state_size)``; Gated DeltaNet: conv over ``q | k | v``, then a recurrent state
  ``(linear_num_value_heads, linear_value_head_dim, linear_key_head_dim)``. Channels and
  heads are split by TP; the two states are packed one after the other in a page. The conv
  state has the model dtype. The SSM state has the engine's ``--mamba-ssm-cache-dtype``; when
  that is ``auto``, the config's ``mamba_ssm_cache_dtype`` / ``mamba_ssm_dtype`` (Mamba-2 and
  Gated DeltaNet), else float32 for Mamba-2 and the model dtype for Gated DeltaNet and Mamba-1. vLLM's CPU platform then overrides it
  on a CPU with AVX-512 BF16 (``platforms/cpu.py``): the state becomes float32 unless it is a
  Gated-DeltaNet state kept in bf16 / fp16 by an explicit dtype (its accelerated kernel). A bf16
  / fp16 Mamba-2 state there is refused: vLLM keeps it or not by how the engine's transformers
  names Mamba layers, which the config does not say.
* **One page size.** The attention block grows to ``A * ceil(state / (A * token bytes))``
  tokens, ``A`` = the larger of ``--block-size`` and the backend's smallest kernel block (32 on
  CPU_ATTN, 16 on the GPU backends), rounded up to a multiple of that kernel block, so one attention
  page holds a state; state pages are padded to the attention page.
* **Groups.** Layers are bucketed by kind in layer order; the group size is the smallest
  bucket (the largest when it is under 1.5 times the smallest); a bucket of ``n`` layers
  makes ``ceil(n / size)`` groups, group ``i`` taking every ``ceil(n / size)``-th layer from ``i``.
* **Placement.** One allocation of ``group size * page * num_blocks`` bytes. Every group lays
  its ``k``-th layer at ``k * page * num_blocks`` (layer-outer), so the ``k``-th layers of all
  groups lie over the same pages: the spec declares them ``aliases``.

>>> vllm_groups([(0, "mamba"), (1, "attention"), (2, "mamba"), (3, "mamba"), (4, "mamba"), (5, "attention")])
[('mamba', (0, 3)), ('mamba', (2, 4)), ('attention', (1, 5))]
>>> hybrid_block_size(16, token_bytes=1024, state_bytes=40000)
48
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvlc.compiler.spec.dtypes import DTYPE_SIZES
from kvlc.engines.vllm.derive.groups import vllm_groups
from kvlc.engines.vllm.derive.offline import kernel_block, kv_heads
from kvlc.engines.vllm.derive.state import check_state_split, state_layout
from kvlc.engines.vllm.derive.view import ViewError, heads_per_rank

GROUP_KIND = {"attention": "full_attention", "mamba": "mamba", "linear": "linear_attention"}
GROUP_NAME = {"attention": "full", "mamba": "mamba", "linear": "linear"}


def hybrid_block_size(block_size: int, token_bytes: int, state_bytes: int, kernel: int = 16) -> int:
    """The attention block (tokens) vLLM picks so one page holds a state (``_align_hybrid_block_size``): a
    multiple of ``align = max(kernel, block_size)`` tokens whose page holds the state, rounded up to a multiple
    of the backend's smallest kernel block ``kernel``.

    >>> hybrid_block_size(16, token_bytes=1024, state_bytes=40000, kernel=32)  # CPU_ATTN: 32-token alignment
    64
    """
    align = max(kernel, block_size)
    tokens = align * -(-state_bytes // (align * token_bytes))
    return kernel * -(-tokens // kernel)


def attention_token_bytes(kv_heads: int, head_dim: int, tp: int, kv_dtype: str) -> int:
    """K and V bytes of one token of one attention layer on one rank."""
    heads = heads_per_rank(kv_heads, tp)
    if heads is None:
        raise ViewError(f"{kv_heads} KV heads cannot be split over tp_size {tp}")
    return 2 * heads * head_dim * DTYPE_SIZES[kv_dtype]


@dataclass(frozen=True)
class PoolRegion:
    """One layer's region in the pool: where, which group, and what it aliases."""

    layer: int
    kind: str
    group: str
    slot: int           # k: the layer's position in its group (its pages start at k * page * blocks)
    aliases: tuple[str, ...]


def pool_regions(groups: Sequence[tuple[str, tuple[int, ...]]]) -> list[PoolRegion]:
    """Every layer's slot and group name; a slot's later layers alias its first (``layer.{i}`` names)."""
    names: list[str] = []
    for kind, _ in groups:
        base = GROUP_NAME[kind]
        n = sum(1 for x in names if x == base or x.startswith(base + "."))
        names.append(base if n == 0 else f"{base}.{n}")
    first: dict[int, int] = {}
    out = []
    for name, (kind, members) in zip(names, groups):
        for slot, layer in enumerate(members):
            owner = first.setdefault(slot, layer)
            out.append(PoolRegion(layer, kind, name, slot, () if owner == layer else (f"layer.{owner}",)))
    return out


def attention_head_dim(c: Mapping[str, Any]) -> int:
    """``attention_head_dim`` (Nemotron-H before transformers 5), ``head_dim``, else hidden / heads (Jamba)."""
    value = c.get("attention_head_dim") or c.get("head_dim")
    return int(value) if value else int(c["hidden_size"]) // int(c["num_attention_heads"])


def _attention_part(c: Mapping[str, Any], name: str, *, backend: str, block: int, num_blocks: int, tp: int,
                    kv_dtype: str, device: str, cpu_isa: str = "") -> dict:
    """The adapter's spec of one attention layer at the pool's block size (layout, page, group entry)."""
    from kvlc.engines.vllm.derive.spec import derive_spec
    from kvlc.engines.vllm.derive.offline import published_view
    one = {"num_hidden_layers": 1, "num_attention_heads": c["num_attention_heads"],
           "num_key_value_heads": kv_heads(c),
           "head_dim": attention_head_dim(c)}
    return derive_spec(published_view(one, name, backend=backend, block_size=block, num_blocks=num_blocks,
                                      tp_size=tp, kv_dtype=kv_dtype, device=device, cpu_isa=cpu_isa))


def _group(name: str, kind: str, attention: Mapping[str, Any]) -> dict:
    """A pool group's spec entry; attention groups take the attention template's tokens per entry (CPU
    ISA amx: 16)."""
    entry = {"name": name, "kind": GROUP_KIND[kind]}
    if kind == "attention" and attention.get("tokens_per_entry", 1) > 1:
        entry["tokens_per_entry"] = attention["tokens_per_entry"]
    return entry


def hybrid_spec(c: Mapping[str, Any], name: str, layers: Sequence[tuple[int, str]], *, state_kind: str,
                backend: str, block_size: int, num_blocks: int, tp_size: int, kv_dtype: str, device: str,
                num_layers: int, ssm_cache_dtype: str = "auto", cpu_avx512_bf16: bool = False,
                cpu_isa: str = "") -> dict:
    """The ``kvlc: 1`` spec of a hybrid vLLM 0.32 engine holding ``layers`` (``(index, kind)``, kinds
    ``attention`` / ``mamba`` / ``linear``) of text config ``c`` whose state layers are ``state_kind``
    (the model's, also on a pipeline stage that holds none; see the module docstring).
    ``ssm_cache_dtype`` and ``cpu_avx512_bf16``: see :func:`ssm_dtype`; ``cpu_isa``: the attention layers'
    CPU ISA at the pool's block size (``auto``: as vLLM picks on this host)."""
    state = state_layout(c, state_kind, requested=ssm_cache_dtype, cpu_avx512_bf16=cpu_avx512_bf16)
    check_state_split(state, c, tp_size)
    head_dim = attention_head_dim(c)
    token = attention_token_bytes(kv_heads(c), head_dim, tp_size, kv_dtype)
    block = hybrid_block_size(block_size, token, state.bytes_per_rank(tp_size), kernel_block(backend))
    attn = _attention_part(c, name, backend=backend, block=block, num_blocks=num_blocks, tp=tp_size,
                           kv_dtype=kv_dtype, device=device, cpu_isa=cpu_isa)
    (template,) = attn["regions"]
    page = block * token
    groups = vllm_groups(layers)
    regions = pool_regions(groups)
    size = max(len(m) for _, m in groups) * page * num_blocks
    out = []
    for r in sorted(regions, key=lambda r: (r.layer)):
        entry = {"name": f"layer.{r.layer}", "storage": "kv",
                 "layout": template["layout"] if r.kind == "attention" else state.name,
                 "num_blocks": num_blocks, "offset": r.slot * page * num_blocks, "block_stride": page,
                 "groups": [r.group]}
        out.append({**entry, "aliases": list(r.aliases)} if r.aliases else entry)
    seen: dict[str, str] = {}
    for r in regions:
        seen.setdefault(r.group, r.kind)
    layouts = {**attn["layouts"], state.name: state.layout()}
    used = {r["layout"] for r in out}
    spec = {"kvlc": 1, "name": attn["name"], "model": {**attn["model"], "num_layers": num_layers},
            "parallel": {"tp_size": tp_size}, "block_size": block,
            "groups": [_group(g, k, attn["groups"][0]) for g, k in seen.items()],
            "storages": [{**attn["storages"][0], "size": size}],
            "layouts": {n: lay for n, lay in layouts.items() if n in used}, "regions": out}
    return spec
