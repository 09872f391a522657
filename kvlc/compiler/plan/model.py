"""The Plan: one engine's KV-cache memory, compiled, frozen and content-hashed.

A plan is rank-independent: sizes are per rank (a ``head`` dim holds
``global_size / tp`` heads), which heads a rank holds is decided at pairing.
It never holds expanded per-block descriptors, only geometry.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal, Mapping

import numpy as np
from pydantic import BaseModel, ConfigDict, PrivateAttr, model_serializer

from kvlc.compiler.frozen import FrozenMap
from kvlc.compiler.algebra.layout import Layout, ceildiv, is_state_kind
from kvlc.compiler.algebra.sharding import dcp_rank, engine_ranks, tp_rank
from kvlc.errors import KvlcError, TransferError, did_you_mean

PLAN_VERSION = 1


class UnknownName(KvlcError, KeyError):
    """A name that a plan does not hold (also a ``KeyError``, for callers that catch that)."""

    def __str__(self) -> str:  # KeyError quotes its argument; show the sentence as written
        return str(self.args[0]) if self.args else ""


def _lookup(items, name: str, what: str, owner: str):
    for item in items:
        if item.name == name:
            return item
    raise UnknownName(f"{owner} has no {what} '{name}'; {did_you_mean(name, [i.name for i in items])}")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _drop_default(out: dict, key: str, value, default) -> dict:
    """Leave a field at its default out of the JSON, so plans without it serialize (and hash) as before."""
    if value == default:
        out.pop(key, None)
    return out


class PlanDim(_Frozen):
    """One axis of a field: per-rank ``size``, ``global_size`` (heads before TP), byte ``stride``."""

    name: str
    role: Literal["token", "head", ""] = ""
    size: int
    global_size: int
    stride: int

    def text(self) -> str:
        tag = {"token": "T", "head": "H", "": ""}[self.role]
        glob = f"/{self.global_size}" if self.role == "head" else ""
        return f"{self.name}{'@' + tag if tag else ''}={self.size}{glob}:{self.stride}"


class PlanField(_Frozen):
    """A field of a block: byte ``offset`` in the block, dtype, dims (outermost first)."""

    name: str
    dtype: str
    itemsize: int
    offset: int
    dims: tuple[PlanDim, ...]

    @property
    def extent(self) -> int:
        """Bytes from the field's first byte to one past its last."""
        return sum((d.size - 1) * d.stride for d in self.dims) + self.itemsize

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for d in self.dims:
            n *= d.size
        return n

    @property
    def layout(self) -> Layout:
        """Element coordinates → byte offsets inside the field (dims outermost first).

        >>> from kvlc import compile_spec
        >>> str(compile_spec("layouts/llama-3.1-8b.yaml").regions[0].fields[0].layout)
        '(16,8,128):(2048,256,2)'
        """
        return Layout(tuple(d.size for d in self.dims), tuple(d.stride for d in self.dims))

    def dim(self, role: str) -> PlanDim | None:
        return next((d for d in self.dims if d.role == role), None)

    def text(self) -> str:
        return f"{self.name}@{self.offset}:{self.dtype}({','.join(d.text() for d in self.dims)})"


class PlanGroup(_Frozen):
    """A KV-cache group. ``block_size`` tokens per logical block, ``kernel_block_size`` per kernel block."""

    name: str
    kind: str
    window: int = 0
    block_size: int
    kernel_block_size: int
    tokens_per_entry: int = 1  # tokens one token-dim entry covers (> 1: a compressed cache)
    dcp_replicated: bool = False  # under DCP: every rank holds all tokens (a block id covers block_size)

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        out = _drop_default(handler(self), "tokens_per_entry", self.tokens_per_entry, 1)
        return _drop_default(out, "dcp_replicated", self.dcp_replicated, False)

    @property
    def is_state(self) -> bool:
        return is_state_kind(self.kind)

    @property
    def kernel_blocks_per_block(self) -> int:
        return self.block_size // self.kernel_block_size

    def entries_for(self, tokens: int) -> int:
        """Token-dim entries that hold ``tokens`` tokens: a partly filled last entry counts whole.

        >>> PlanGroup(name="c4a", kind="full_attention", block_size=256, kernel_block_size=256,
        ...           tokens_per_entry=4).entries_for(13)
        4
        """
        return ceildiv(tokens, self.tokens_per_entry)


class PlanStorage(_Frozen):
    name: str
    mem: Literal["DRAM", "VRAM"]
    device: int
    size: int


class PlanRegion(_Frozen):
    """A run of ``num_blocks`` kernel blocks of ``block_bytes`` every ``block_stride`` bytes."""

    name: str
    storage: str
    mem: Literal["DRAM", "VRAM"]
    device: int
    offset: int
    num_blocks: int
    block_bytes: int
    block_stride: int
    groups: tuple[str, ...]
    block_tokens: int
    kernel_blocks_per_block: int
    optional: bool = False
    fields: tuple[PlanField, ...]
    aliases: tuple[str, ...] = ()  # regions lying over the same pages (a shared page pool)
    tokens_per_entry: int = 1  # tokens one entry of the token dims covers (the group's; > 1: compressed)
    dcp_replicated: bool = False  # its groups are not token-sharded by DCP: every rank holds every token
    part_of: str = ""  # the region whose fields this one holds part of ("": none, it is a whole region)

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        out = handler(self)
        if not self.aliases:  # plans without aliasing serialize (and hash) as before
            out.pop("aliases", None)
        out = _drop_default(out, "dcp_replicated", self.dcp_replicated, False)
        out = _drop_default(out, "part_of", self.part_of, "")
        return _drop_default(out, "tokens_per_entry", self.tokens_per_entry, 1)

    @property
    def content(self) -> str:
        """The name its fields' content goes by across engines: ``part_of``, or its own name. Pairing
        matches a field by (content, field name), so a region split over several runs of blocks (K and V
        in two tensors) pairs with one holding all the fields (one joint tensor).

        >>> from kvlc import compile_spec
        >>> [r.content for r in compile_spec("layouts/llama-3.1-8b-split.yaml").regions[:2]]
        ['layer.0', 'layer.0']
        """
        return self.part_of or self.name

    @property
    def is_state(self) -> bool:
        """Per-request state (Mamba): no token axis, a block is copied whole."""
        return self.block_tokens == 0

    @property
    def block_entries(self) -> int:
        """Entries of the token dims in one kernel block: ``block_tokens / tokens_per_entry`` (0: state)."""
        return self.block_tokens // self.tokens_per_entry

    @property
    def capacity(self) -> int:
        """How many logical blocks fit (``num_blocks`` counts kernel blocks)."""
        return self.num_blocks // self.kernel_blocks_per_block

    @property
    def end(self) -> int:
        return self.offset + (self.num_blocks - 1) * self.block_stride + self.block_bytes

    def field(self, name: str) -> PlanField:
        """The field called ``name``; a :class:`~kvlc.errors.KvlcError` listing the fields otherwise."""
        return _lookup(self.fields, name, "field", f"region '{self.name}'")

    def text(self) -> str:
        kb = f"x{self.kernel_blocks_per_block}" if self.kernel_blocks_per_block > 1 else ""
        toks = "state" if self.is_state else f"tokens={self.block_tokens}{kb}"
        if self.tokens_per_entry > 1:
            toks += f" entries={self.block_entries}"
        opt = (" optional" if self.optional else "") + (" dcp=replicated" if self.dcp_replicated else "")
        opt += f" part_of={self.part_of}" if self.part_of else ""
        return (f"{self.name} {self.storage}+{self.offset} {self.mem}:{self.device} "
                f"blocks={self.num_blocks} bytes={self.block_bytes} stride={self.block_stride} "
                f"{toks} groups={','.join(self.groups)}{opt}"
                + (f" aliases={','.join(self.aliases)}" if self.aliases else "") + " | "
                + " ".join(f.text() for f in self.fields))


class PlanModel(_Frozen):
    name: str
    num_layers: int
    sizes: FrozenMap[str, int]


class PlanParallel(_Frozen):
    tp_size: int
    dcp_size: int
    layers: tuple[int, int]
    dcp_interleave: int = 1  # tokens a DCP rank stores in a row before the next rank's turn
    pcp_size: int = 1        # prefill context parallelism: tp_size * pcp_size ranks, TP innermost

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        out = handler(self)
        for key in ("dcp_interleave", "pcp_size"):  # plans without them serialize (and hash) as before
            if out.get(key) == 1:
                out.pop(key)
        return out

    @property
    def ranks(self) -> int:
        """Ranks of the engine (of one pipeline stage): ``tp_size * pcp_size``.

        >>> PlanParallel(tp_size=8, dcp_size=1, pcp_size=2, layers=(0, 61)).ranks
        16
        """
        return engine_ranks(self)

    def tp_rank(self, rank: int) -> int:
        """The TP rank of engine rank ``rank``: the heads it holds (:func:`kvlc.compiler.algebra.sharding.tp_rank`)."""
        return tp_rank(self, rank)

    def dcp_rank(self, rank: int) -> int:
        """The DCP rank of engine rank ``rank``: the tokens it holds (:func:`kvlc.compiler.algebra.sharding.dcp_rank`)."""
        return dcp_rank(self, rank)


class Plan(_Frozen):
    """A compiled spec. Same spec → byte-identical :meth:`to_json` → same :attr:`digest`.

    >>> from kvlc import compile_spec
    >>> plan = compile_spec("layouts/llama-3.1-8b.yaml")
    >>> Plan.from_json(plan.to_json()) == plan
    True
    """

    kvlc: int = PLAN_VERSION
    name: str
    model: PlanModel
    parallel: PlanParallel
    groups: tuple[PlanGroup, ...]
    storages: tuple[PlanStorage, ...]
    regions: tuple[PlanRegion, ...]

    # derived once at construction (not fields, not part of the JSON)
    _digest: str = PrivateAttr("")
    _region_index: FrozenMap = PrivateAttr(default_factory=FrozenMap)

    def model_post_init(self, context: Any) -> None:
        self._digest = hashlib.sha256(self.to_json().encode()).hexdigest()
        self._region_index = FrozenMap((r.name, i) for i, r in enumerate(self.regions))

    def model_copy(self, *, update: Mapping | None = None, deep: bool = False) -> "Plan":
        """A copy, validated again when ``update`` changes fields (the digest follows)."""
        if not update:
            return self
        return type(self).model_validate({**{k: getattr(self, k) for k in type(self).model_fields}, **update})

    # ---------------------------------------------------------------- identity
    def to_json(self) -> str:
        """Canonical JSON: sorted keys, no whitespace, integers and strings only."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "Plan":
        return cls.model_validate_json(text)

    @property
    def digest(self) -> str:
        """sha256 of the canonical JSON, hex."""
        return self._digest

    # ---------------------------------------------------------------- lookups
    def region(self, name: str) -> PlanRegion:
        """The region called ``name``; a :class:`~kvlc.errors.KvlcError` naming the closest otherwise.

        >>> from kvlc import compile_spec
        >>> compile_spec("layouts/llama-3.1-8b.yaml").region("layer.0.k")
        Traceback (most recent call last):
        kvlc.compiler.plan.model.UnknownName: plan 'llama-3.1-8b-tp1' has no region 'layer.0.k'; did you mean 'layer.0'...?
        """
        i = self._region_index.get(name)
        if i is None:
            _lookup(self.regions, name, "region", f"plan '{self.name}'")
        return self.regions[i]

    def storage(self, name: str) -> PlanStorage:
        """The storage called ``name``; a :class:`~kvlc.errors.KvlcError` listing the storages otherwise."""
        return _lookup(self.storages, name, "storage", f"plan '{self.name}'")

    def group(self, name: str) -> PlanGroup:
        """The group called ``name``; a :class:`~kvlc.errors.KvlcError` listing the groups otherwise."""
        return _lookup(self.groups, name, "group", f"plan '{self.name}'")

    def group_capacity(self, group: str) -> int:
        """Logical blocks a request of ``group`` can use: the smallest capacity among its regions."""
        self.group(group)
        caps = [r.capacity for r in self.regions if group in r.groups]
        if not caps:
            raise UnknownName(f"no region of plan '{self.name}' belongs to group '{group}'")
        return min(caps)

    def blocks_for(self, group: str, tokens: int) -> int:
        """Logical blocks of ``group`` that ``tokens`` tokens occupy (one state block for Mamba groups).

        With decode context parallelism a block id covers ``block_size * dcp_size`` tokens.

        >>> from kvlc import compile_spec
        >>> compile_spec("layouts/llama-3.1-8b.yaml").blocks_for("full", 33)
        3
        """
        g = self.group(group)
        return 1 if g.is_state else ceildiv(tokens, g.block_size * self.group_dcp(group))

    def group_dcp(self, group: str) -> int:
        """DCP ranks a block id of ``group`` spreads its tokens over: ``dcp_size``, or 1 for a group that
        DCP does not shard (``dcp: replicated``; per-request state needs one block whatever this says).

        >>> from kvlc import compile_spec
        >>> compile_spec("layouts/deepseek-v3-tp8-dcp8-mtp.yaml").group_dcp("mtp")
        1
        """
        g = self.group(group)
        return 1 if g.dcp_replicated else self.parallel.dcp_size

    def region_parallel(self, region: PlanRegion) -> PlanParallel:
        """The parallelism ``region`` is laid out under: the plan's, without DCP where its groups are not
        token-sharded (``dcp: replicated``); pairing maps such a region by TP alone on this side."""
        if not region.dcp_replicated:
            return self.parallel
        return self.parallel.model_copy(update={"dcp_size": 1, "dcp_interleave": 1})

    @property
    def mem_types(self) -> tuple[str, ...]:
        """Memory types present, in the order first seen."""
        return tuple(dict.fromkeys(r.mem for r in self.regions))

    # ---------------------------------------------------------------- text
    def text(self) -> str:
        """Short canonical text: a header, one line per group, storage and region."""
        p = self.parallel
        inter = f" dcp_interleave={p.dcp_interleave}" if p.dcp_interleave > 1 else ""
        pcp = f" pcp={p.pcp_size}" if p.pcp_size > 1 else ""
        lines = [f"plan {self.name} model={self.model.name} layers={self.model.num_layers} "
                 f"tp={p.tp_size}{pcp} dcp={p.dcp_size}{inter} pp_layers={p.layers[0]}:{p.layers[1]}"]
        for g in self.groups:
            win = f" window={g.window}" if g.window else ""
            per = f" tokens_per_entry={g.tokens_per_entry}" if g.tokens_per_entry > 1 else ""
            per += " dcp=replicated" if g.dcp_replicated else ""
            lines.append(f"group {g.name} {g.kind} block={g.block_size} kernel={g.kernel_block_size}{win}{per}")
        for s in self.storages:
            lines.append(f"storage {s.name} {s.mem}:{s.device} size={s.size}")
        lines.extend("region " + r.text() for r in self.regions)
        return "\n".join(lines) + "\n"

    # ---------------------------------------------------------------- descriptors
    def local_descriptors(self, bases: Mapping[str, int]) -> np.ndarray:
        """(N, 3) uint64 (addr, len, device) for every kernel block of every region, region-major.

        ``bases`` maps each storage name to its base address.
        """
        missing = [s.name for s in self.storages if s.name not in bases]
        if missing:
            raise TransferError(f"no base address for storage(s) {missing}; pass one per storage")
        total = sum(r.num_blocks for r in self.regions)
        out = np.empty((total, 3), dtype=np.uint64)
        steps: dict[tuple[int, int], np.ndarray] = {}  # i * stride, shared by regions of one shape
        start = 0
        for r in self.regions:
            stop = start + r.num_blocks
            step = steps.get((r.num_blocks, r.block_stride))
            if step is None:
                step = np.arange(r.num_blocks, dtype=np.uint64) * np.uint64(r.block_stride)
                steps[(r.num_blocks, r.block_stride)] = step
            # One pass per column over the output: addr = i * stride + (base + offset).
            np.add(step, np.uint64(int(bases[r.storage]) + r.offset), out=out[start:stop, 0])
            out[start:stop, 1] = r.block_bytes
            out[start:stop, 2] = r.device
            start = stop
        return out
