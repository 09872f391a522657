"""The engine view: what kvlc reads from a vLLM engine, as frozen plain data.

An :class:`EngineView` holds the facts a spec is derived from — model identity,
parallelism, KV-cache groups and, per attention layer, the tensor vLLM hands to
a connector (shape, element strides, dtype, addresses, and the allocation it is
a view of). It imports neither torch nor vLLM: :func:`EngineView.to_dict` and
:func:`EngineView.from_dict` turn it into JSON-able data and back, so tests
build views from plain data and a view read from a live engine can be saved.

>>> view = EngineView.from_dict(EXAMPLE)
>>> view.layers[1].name, view.layers[1].layer_index
('model.layers.1.self_attn.attn', 1)
>>> EngineView.from_dict(view.to_dict()) == view
True
"""

from __future__ import annotations

import dataclasses
import re
from enum import Enum
from typing import Any, Mapping, get_args, get_origin, get_type_hints

from kvlc.compiler.spec.dtypes import DTYPE_SIZES
from kvlc.errors import KvlcError, did_you_mean


class ViewError(KvlcError):
    """An engine view (read from vLLM or given as data) is malformed or cannot be laid out."""


class GroupKind(str, Enum):
    """vLLM KV-cache group kinds kvlc knows (``KVCacheSpec`` classes)."""

    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    CHUNKED_LOCAL = "chunked_local"
    MLA = "mla"
    MAMBA = "mamba"
    OTHER = "other"


class Axis(str, Enum):
    """What one dim of a layer tensor means."""

    BLOCK = "block"          # kernel blocks of the paged cache
    HEAD = "head"            # KV heads held by this rank
    TOKEN = "token"          # tokens within a kernel block
    KV = "kv"                # 2: K then V
    HEAD_DIM = "head_dim"    # elements of one head vector
    CONTENT = "content"      # K|V packed: 2 * head_dim elements (see KvPacking)
    LATENT = "latent"        # MLA: kv_lora_rank + rope elements, one per token
    CELL = "cell"            # CPU_ATTN: one head's K or V of a block, N * D elements in the kernel's order
    STATE = "state"          # a dim of one request's Mamba / linear-attention state (conv taps, channels, heads)


class KvPacking(str, Enum):
    """How a ``content`` dim of ``2 * head_dim`` holds K and V.

    ``per_token``: each (head, token) row is K[head_dim] then V[head_dim] (FLASH_ATTN,
    FLASHINFER and the other CUDA backends of vLLM's logical [B, H, N, 2*D] view).
    ``per_head_block``: the kernels re-view a head's [N][2*D] rows as [2*N][D] and
    split them in halves, so a head holds its K half, then its V half (CPU_ATTN). Inside
    the halves the order is the kernel ISA's: measured on a live engine with the ``vec``
    ISA, K is stored transposed, K[D][N], and V as V[N][D].
    ``none``: no content dim (split K/V, MLA latent).
    """

    PER_TOKEN = "per_token"
    PER_HEAD_BLOCK = "per_head_block"
    NONE = "none"


class Provenance(str, Enum):
    """Where a view's numbers come from."""

    LIVE = "live engine"
    PUBLISHED = "vLLM's published shapes, not run on a GPU here"
    PUBLISHED_CPU = "vLLM's published shapes (CPU backend, as a live engine lays it out)"


@dataclasses.dataclass(frozen=True)
class ModelIdentity:
    """The model: name, layers, global KV heads, head size, KV dtype (kvlc name); MLA sizes if any."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None


@dataclasses.dataclass(frozen=True)
class ParallelView:
    """Parallel sizes and this worker's ranks; ``layers`` is the pipeline stage's [start, stop)."""

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    dcp_size: int = 1
    dcp_rank: int = 0
    dcp_interleave: int = 1   # cp_kv_cache_interleave_size: tokens a DCP rank stores in a row
    layers: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class GroupView:
    """One KV-cache group: kind, tokens per block, its layers (vLLM names); window/chunk if any."""

    kind: GroupKind
    block_size: int
    layer_names: tuple[str, ...]
    window: int = 0
    chunk: int = 0
    spec_type: str = ""


@dataclasses.dataclass(frozen=True)
class StateTensors:
    """One Mamba / linear-attention layer as vLLM hands it to a connector: its state tensors, conv first
    (each ``[blocks, ...]``, one block per request, all blocks of the layer over one page slab)."""

    name: str
    parts: tuple["LayerTensor", ...]

    @property
    def layer_index(self) -> int:
        """The model layer number parsed from the name."""
        return layer_index(self.name)


@dataclasses.dataclass(frozen=True)
class LayerTensor:
    """One layer's KV tensor: element shape/strides with the meaning of each dim, and its allocation."""

    name: str
    axes: tuple[Axis, ...]
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    itemsize: int
    data_ptr: int
    nbytes: int
    storage_ptr: int
    storage_nbytes: int
    device: str = "cpu"

    @property
    def layer_index(self) -> int:
        """The model layer number parsed from the name (``model.layers.7.self_attn.attn`` → 7)."""
        return layer_index(self.name)

    @property
    def offset(self) -> int:
        """Byte offset of this tensor's first element in its allocation."""
        return self.data_ptr - self.storage_ptr


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """One state layer's fields (whole-model sizes; TP splits ``head`` dims and conv sections)."""

    name: str                                     # the spec's layout name: mamba2_state, gdn_state, short_conv_state
    conv_taps: int
    sections: tuple[tuple[str, int], ...]
    conv_dtype: str
    rec_field: str                                # "" where the layer keeps only its conv taps (a short convolution)
    rec_dims: tuple[tuple[str, int, bool], ...]   # (name, size, sharded by TP)
    rec_dtype: str
    replicated: tuple[str, ...] = ()              # conv sections every rank holds whole (one-group B, C)

    def section_sizes(self, tp: int) -> tuple[tuple[str, int], ...]:
        """Each conv section's channels on one rank: split by ``tp``, or whole where replicated.

        >>> StateLayout("s", 3, (("x", 8), ("B", 2)), "bf16", "ssm", (), "fp32", ("B",)).section_sizes(2)
        (('x', 4), ('B', 2))
        """
        return tuple((n, size if n in self.replicated else size // tp) for n, size in self.sections)

    @property
    def parts(self) -> int:
        """The tensors vLLM hands per layer: conv and the recurrent state, or the conv taps alone."""
        return 2 if self.rec_field else 1

    def bytes_per_rank(self, tp: int) -> int:
        conv = self.conv_taps * sum(size for _, size in self.section_sizes(tp)) * DTYPE_SIZES[self.conv_dtype]
        if not self.rec_field:
            return conv
        rec = DTYPE_SIZES[self.rec_dtype]
        for _, size, sharded in self.rec_dims:
            rec *= size // tp if sharded else size
        return conv + rec

    def layout(self) -> dict:
        conv = {"name": "conv", "kind": "sections", "dtype": self.conv_dtype, "dims": [
            {"name": "conv_tap", "size": self.conv_taps},
            {"name": "channel", "role": "head", "sections": dict(self.sections)}]}
        if self.replicated:
            conv["replicated"] = list(self.replicated)
        if not self.rec_field:
            return {"fields": [conv]}
        rec = {"name": self.rec_field, "dtype": self.rec_dtype, "dims": [
            {"name": n, "role": "head", "size": s} if sharded else {"name": n, "size": s}
            for n, s, sharded in self.rec_dims]}
        return {"fields": [conv, rec]}


@dataclasses.dataclass(frozen=True)
class EngineView:
    """Everything :func:`~kvlc.engines.vllm.derive.spec.derive_spec` needs, as frozen plain data."""

    model: ModelIdentity
    parallel: ParallelView
    backend: str
    kv_cache_layout: str
    kv_packing: KvPacking
    block_size: int
    kernel_block_size: int
    num_blocks: int
    groups: tuple[GroupView, ...]
    layers: tuple[LayerTensor, ...]
    provenance: Provenance = Provenance.LIVE
    cpu_isa: str = ""  # CPU_ATTN: the attention layers' kernel ISA ("vec", "amx", "vec16", ...)
    state: StateLayout | None = None      # hybrids: the model's state layer (Mamba-2, Gated DeltaNet)
    states: tuple[StateTensors, ...] = ()   # hybrids: each state layer's tensors

    def group_of(self, layer_name: str) -> int:
        """Index of the group holding ``layer_name``."""
        for i, g in enumerate(self.groups):
            if layer_name in g.layer_names:
                return i
        raise ViewError(f"layer '{layer_name}' is in no KV-cache group of the view "
                        f"(groups hold {sum(len(g.layer_names) for g in self.groups)} layers); "
                        "fix: list it under one group's layer_names")

    def to_dict(self) -> dict:
        """JSON-able data (enums as their values, tuples as lists)."""
        return _plain(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "EngineView":
        """Rebuild a view from :meth:`to_dict` output; raises :class:`ViewError` naming the bad key."""
        return _build(cls, data, "view")


def heads_per_rank(total: int, tp_size: int) -> int | None:
    """KV heads each TP rank holds: ``total / tp`` when it divides, one replica when ``tp`` is a multiple
    of ``total`` (vLLM: ``max(1, total // tp)``); None when neither, which vLLM refuses too.

    >>> heads_per_rank(8, 2), heads_per_rank(2, 8), heads_per_rank(6, 4)
    (4, 1, None)
    """
    if total % tp_size == 0:
        return total // tp_size
    return 1 if tp_size % total == 0 else None


_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)(?:\.|$)")


def layer_index(name: str) -> int:
    """The layer number in a vLLM attention layer name.

    >>> layer_index("model.layers.12.self_attn.attn"), layer_index("transformer.h.3.attn")
    (12, 3)
    """
    m = _LAYER_RE.search(name) or re.search(r"\.(\d+)\.", f".{name}.")
    if m is None:
        raise ViewError(f"cannot find a layer number in layer name '{name}'; expected a name like "
                        "'model.layers.N.self_attn.attn'")
    return int(m.group(1))


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _build(tp: Any, data: Any, where: str) -> Any:
    """Convert plain ``data`` to type ``tp`` (dataclass, enum, tuple, int, str, optional)."""
    origin = get_origin(tp)
    if origin is tuple:
        return _build_tuple(get_args(tp), data, where)
    if origin is not None:  # X | None
        args = [a for a in get_args(tp) if a is not type(None)]
        return None if data is None else _build(args[0], data, where)
    if isinstance(tp, type) and issubclass(tp, Enum):
        return _build_enum(tp, data, where)
    if dataclasses.is_dataclass(tp):
        return _build_dataclass(tp, data, where)
    if tp is int and (not isinstance(data, int) or isinstance(data, bool)):
        raise ViewError(f"{where}: expected an integer, found {data!r}")
    if tp is str and not isinstance(data, str):
        raise ViewError(f"{where}: expected a string, found {data!r}")
    return data


def _build_tuple(args: tuple, data: Any, where: str) -> tuple:
    if not isinstance(data, (list, tuple)):
        raise ViewError(f"{where}: expected a list, found {type(data).__name__}")
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_build(args[0], v, f"{where}[{i}]") for i, v in enumerate(data))
    if len(args) != len(data):
        raise ViewError(f"{where}: expected {len(args)} items, found {len(data)}")
    return tuple(_build(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, data)))


def _build_enum(tp: type, data: Any, where: str) -> Enum:
    try:
        return tp(data)
    except ValueError:
        raise ViewError(f"{where}: unknown {tp.__name__} {data!r}; "
                        f"{did_you_mean(str(data), [m.value for m in tp])}") from None


def _build_dataclass(tp: type, data: Any, where: str) -> Any:
    if not isinstance(data, Mapping):
        raise ViewError(f"{where}: expected a mapping for {tp.__name__}, found {type(data).__name__}")
    hints = get_type_hints(tp)
    fields = {f.name: f for f in dataclasses.fields(tp)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise ViewError(f"{where}: unknown key {unknown[0]!r} for {tp.__name__}; "
                        f"{did_you_mean(unknown[0], fields)}")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _build(hints[name], data[name], f"{where}.{name}")
        elif f.default is dataclasses.MISSING:
            raise ViewError(f"{where}: missing key '{name}' for {tp.__name__}")
    return tp(**kwargs)


def _example() -> dict:
    """A two-layer CPU_ATTN view (2 KV heads x 64, bf16, 32-token blocks, 8 blocks), as plain data."""
    layer_bytes = 8 * 2 * 32 * 128 * 2
    layers = [{"name": f"model.layers.{i}.self_attn.attn", "axes": ["block", "head", "token", "content"],
               "shape": [8, 2, 32, 128], "strides": [8192, 4096, 128, 1], "dtype": "bf16", "itemsize": 2,
               "data_ptr": 4096 + i * layer_bytes, "nbytes": layer_bytes, "storage_ptr": 4096,
               "storage_nbytes": 2 * layer_bytes, "device": "cpu"} for i in range(2)]
    return {"model": {"name": "tiny-llama", "num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "dtype": "bf16"},
            "parallel": {"tp_size": 1, "tp_rank": 0}, "backend": "CPU_ATTN", "kv_cache_layout": "LBHNC",
            "kv_packing": "per_head_block", "block_size": 32, "kernel_block_size": 32, "num_blocks": 8,
            "groups": [{"kind": "full_attention", "block_size": 32,
                        "layer_names": [x["name"] for x in layers]}],
            "layers": layers}


EXAMPLE = _example()
