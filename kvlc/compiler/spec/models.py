"""Stage 1 — spec: the typed, frozen models of the ``kvlc: 1`` YAML language.

A spec describes one engine's KV-cache memory: storages (allocations), regions
(runs of equally shaped blocks inside a storage) and block layouts (fields with
ordered, named dims). Models here check types and local facts only; facts that
span several objects (overlaps, bounds, sharding) are checked by the passes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Mapping, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, PrivateAttr, Tag,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError

from kvlc.compiler.algebra.layout import STATE_KINDS
from kvlc.compiler.algebra.sharding import check_interleave, check_parallel
from kvlc.compiler.frozen import FrozenMap
from kvlc.compiler.spec.bounds import check_spec_bounds
from kvlc.compiler.spec.dtypes import DTYPE_SIZES, PACKED, DType
from kvlc.errors import did_you_mean

MemType = Literal["DRAM", "VRAM"]
Name = Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z_][A-Za-z0-9_.\-{}]*$")]
# Every integer a spec takes is bounded: byte values stay below 2**63 (addresses are int64 at
# the runtime boundary), counts stay where a real engine is. Derived totals are checked by the
# passes; these bounds keep every product they form an exact, finite integer.
MAX_BYTES = 2**63 - 1          # offsets, sizes, strides, alignments
MAX_LAYERS = 4096              # model layers (the largest models have about 130)
MAX_RANKS = 4096               # tp_size, pcp_size, dcp_size
MAX_DEVICE = 1023              # device ordinal
MAX_BLOCKS = 2**40             # blocks in one region
MAX_TOKENS = 2**20             # tokens per block, window, chunk
MAX_DIM = 2**24                # heads, head_dim, model sizes, dim sizes, sections
MAX_REPEAT_VALUE = 2**20       # values of a repeat range


def _ints(lo: int, hi: int):
    return Annotated[int, Field(ge=lo, le=hi)]


Positive = _ints(1, MAX_BYTES)
NonNegative = _ints(0, MAX_BYTES)
Layers = _ints(1, MAX_LAYERS)
LayerIndex = _ints(0, MAX_LAYERS)
Ranks = _ints(1, MAX_RANKS)
Device = _ints(0, MAX_DEVICE)
Blocks = _ints(1, MAX_BLOCKS)
Tokens = _ints(1, MAX_TOKENS)
DimSize = _ints(1, MAX_DIM)
RepeatValue = _ints(0, MAX_REPEAT_VALUE)
RepeatStep = _ints(1, MAX_REPEAT_VALUE)


def spec_error(what: str, expected: str | None = None, found: str | None = None,
               fix: str | None = None, at: tuple = ()) -> PydanticCustomError:
    """A validation error that keeps kvlc's expected / found / fix, located ``at`` below the model.

    :mod:`kvlc.compiler.spec.validate` turns it into a :class:`~kvlc.errors.Problem`.
    """
    return PydanticCustomError("kvlc", what, {"expected": expected, "found": found, "fix": fix,
                                              "at": tuple(at)})


def _ordered_range(v, what: str):
    if v is not None and not isinstance(v, str) and v[0] >= v[1]:
        raise spec_error(f"{what} is empty or reversed", expected="[start, stop] with start < stop",
                         found=str(list(v)), fix=f"use [{v[1]}, {v[0]}]" if v[1] < v[0] else
                         f"use [{v[0]}, {v[0] + 1}] or more")
    return v


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)


# ---------------------------------------------------------------- model identity
class ModelInfo(Frozen):
    """What model the cache belongs to; pairing compares it, dims are checked against it."""

    name: str
    num_layers: Layers
    num_kv_heads: DimSize | None = None
    head_dim: DimSize | None = None
    sizes: FrozenMap[str, DimSize] = Field(default_factory=FrozenMap)

    def known_sizes(self) -> dict[str, int]:
        """Dim name → size the model fixes (``head`` and ``head_dim`` plus ``sizes``)."""
        out = dict(self.sizes)
        if self.num_kv_heads is not None:
            out.setdefault("head", self.num_kv_heads)
        if self.head_dim is not None:
            out.setdefault("head_dim", self.head_dim)
        return out


class Parallel(Frozen):
    """Engine parallelism: tensor, prefill context and decode context parallel sizes, pipeline layers."""

    tp_size: Ranks = 1
    pcp_size: Ranks = 1
    dcp_size: Ranks = 1
    dcp_interleave: Tokens = 1
    layers: tuple[LayerIndex, LayerIndex] | None = None

    @field_validator("layers")
    @classmethod
    def _ordered(cls, v):
        return _ordered_range(v, "pipeline layer range")

    @model_validator(mode="after")
    def _dcp(self):
        check_parallel(self, spec_error)
        return self


# ---------------------------------------------------------------- groups
class _GroupBase(Frozen):
    name: Name
    block_size: Tokens | None = None
    kernel_block_size: Tokens | None = None
    tokens_per_entry: Tokens = 1  # one token-dim entry covers this many tokens (a compressed cache)
    dcp: Literal["sharded", "replicated"] = "sharded"  # replicated: DCP does not shard this group's tokens


class FullAttention(_GroupBase):
    kind: Literal["full_attention"]


class SlidingWindow(_GroupBase):
    kind: Literal["sliding_window"]
    window: Annotated[int, Field(ge=1, le=2**40)]


class ChunkedLocal(_GroupBase):
    kind: Literal["chunked_local"]
    chunk: Annotated[int, Field(ge=1, le=2**40)]


class Indexer(_GroupBase):
    kind: Literal["indexer"]


class MambaState(_GroupBase):
    kind: Literal["mamba"]


class LinearAttention(_GroupBase):
    kind: Literal["linear_attention"]


Group = Annotated[Union[FullAttention, SlidingWindow, ChunkedLocal, Indexer, MambaState,
                        LinearAttention], Field(discriminator="kind")]
STATE_GROUP_KINDS = STATE_KINDS  # one definition: kvlc.compiler.algebra.layout


# ---------------------------------------------------------------- storages
class Storage(Frozen):
    """One allocation (a torch tensor) the runtime binds by name and registers once."""

    name: Name
    mem: MemType
    device: Device = 0
    size: Positive | None = None
    align: Positive = 1


# ---------------------------------------------------------------- block layouts
class Dim(Frozen):
    """A named axis of a field. ``size`` is an int, a model size name, or omitted.

    Omitted sizes come from the model (a dim named like a model size) or, for the
    ``token`` role, from the kernel block size (in entries of the group's ``tokens_per_entry``). A ``head`` dim gives the *global*
    count; each rank holds ``size / tp_size`` (or one replica when tp > size).
    """

    name: Name
    size: DimSize | str | None = None
    role: Literal["token", "head"] | None = None
    sections: FrozenMap[Name, DimSize] | None = None
    stride: Positive | None = None  # explicit byte stride (all dims of a field, or none)


class ArrayField(Frozen):
    """A dense array of ``dtype`` with dims in order (last dim innermost)."""

    kind: Literal["array"] = "array"
    name: Name
    dtype: DType
    offset: NonNegative | None = None
    dims: tuple[Dim, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _dims(self):
        _check_dim_roles(self.dims)
        _check_strides(self.dims)
        _check_packed(self.name, self.dtype, self.dims)
        for i, d in enumerate(self.dims):
            if d.sections:
                raise spec_error(f"dim '{d.name}' has sections, but field '{self.name}' is a plain array",
                                 expected="'kind: sections' on a field that splits a dim",
                                 found="kind: array", at=("dims", i, "sections"),
                                 fix="add 'kind: sections' to the field, or remove 'sections'")
        return self


class SectionsField(Frozen):
    """An array one of whose dims is split into named sections (Mamba conv x|B|C).

    Each section becomes its own field ``<name>.<section>``, sharded by TP on its own; a section
    named in ``replicated`` is held whole by every rank (vLLM's Mamba-2 B and C when ``n_groups`` is 1).
    """

    kind: Literal["sections"]
    name: Name
    dtype: DType
    offset: NonNegative | None = None
    dims: tuple[Dim, ...] = Field(min_length=1)
    replicated: tuple[Name, ...] = ()

    @model_validator(mode="after")
    def _one_split(self):
        _check_dim_roles(self.dims)
        _check_packed(self.name, self.dtype, self.dims)
        strided = [i for i, d in enumerate(self.dims) if d.stride is not None]
        if strided:
            raise spec_error(f"sections field '{self.name}' cannot take explicit strides",
                             expected="strides on plain array fields only", found="stride: "
                             f"{self.dims[strided[0]].stride}", at=("dims", strided[0], "stride"),
                             fix="remove 'stride' (sections share their parent's row-major strides)")
        split = [i for i, d in enumerate(self.dims) if d.sections]
        if len(split) != 1:
            names = ", ".join(f"'{self.dims[i].name}'" for i in split)
            raise spec_error(f"sections field '{self.name}' must split exactly one dim",
                             expected="one dim with 'sections: {NAME: SIZE, ...}'",
                             found=f"{len(split)} dims with sections" + (f" ({names})" if names else ""),
                             at=("dims", split[1]) if split else ("dims",),
                             fix=("add 'sections:' to the dim to split" if not split
                                  else "split one dim only"))
        d = self.dims[split[0]]
        if d.size is not None:
            raise spec_error(f"dim '{d.name}' has sections, so its size is their sum",
                             expected=f"no 'size' (the sections add up to {sum(d.sections.values())})",
                             found=f"size: {d.size}", at=("dims", split[0], "size"), fix="remove 'size'")
        _check_replicated(self, d)
        return self


def _check_replicated(f: SectionsField, d: Dim) -> None:
    """``replicated`` names distinct sections of the split dim ``d``, which TP shards (role ``head``)."""
    if not f.replicated:
        return
    if d.role != "head":
        raise spec_error(f"sections field '{f.name}' replicates sections of dim '{d.name}', which TP does "
                         "not shard", expected="'replicated' only where the split dim has role head",
                         found=f"role: {d.role or 'none'}", at=("replicated",),
                         fix="remove 'replicated' (every rank holds all of a plain dim), or give the dim "
                             "role head")
    for i, name in enumerate(f.replicated):
        if name not in d.sections:
            raise spec_error(f"'{name}' is not a section of dim '{d.name}'",
                             expected=f"one of {list(d.sections)}", found=repr(name), at=("replicated", i),
                             fix=did_you_mean(name, list(d.sections)))
        if name in f.replicated[:i]:
            raise spec_error(f"section '{name}' is replicated twice", expected="each section once",
                             found=f"{list(f.replicated)}", at=("replicated", i), fix=f"drop the second '{name}'")


def _check_strides(dims) -> None:
    """Explicit byte strides are given on every dim of a field or on none."""
    given = [d.stride is not None for d in dims]
    if any(given) and not all(given):
        i = given.index(False)
        raise spec_error(f"dim '{dims[i].name}' has no stride, but other dims of its field do",
                         expected="'stride:' on every dim of the field, or on none",
                         found=f"strides on {sum(given)} of {len(dims)} dims", at=("dims", i),
                         fix=f"add 'stride:' to dim '{dims[i].name}', or remove the others")


def _check_packed(name: str, dtype: str, dims) -> None:
    """A packed dtype (``fp4_e2m1``) packs its innermost dim: a plain one (a byte can't split heads)."""
    last = dims[-1]
    if dtype not in PACKED or not (last.role or last.sections):
        return
    what = f"role {last.role}" if last.role else "sections"
    raise spec_error(f"field '{name}' packs {PACKED[dtype]} {dtype} values per byte along its innermost dim "
                     f"'{last.name}', which has {what}",
                     expected="a plain innermost dim (no role, no sections), e.g. head_dim",
                     found=f"{what} on dims[{len(dims) - 1}]", at=("dims", len(dims) - 1),
                     fix="put a plain dim (head_dim, latent) last, or use a one-value-per-byte dtype")


def _check_dim_roles(dims) -> None:
    seen: dict[str, int] = {}
    for i, d in enumerate(dims):
        if d.name in seen:
            raise spec_error(f"dim name '{d.name}' is used twice in one field",
                             expected="unique dim names within a field",
                             found=f"'{d.name}' at dims[{seen[d.name]}] and dims[{i}]",
                             at=("dims", i, "name"), fix="rename one of the dims")
        seen[d.name] = i
    for role in ("token", "head"):
        having = [i for i, d in enumerate(dims) if d.role == role]
        if len(having) > 1:
            names = " and ".join(f"'{dims[i].name}'" for i in having[:2])
            raise spec_error(f"a field has at most one '{role}' dim",
                             expected=f"one dim with role {role}", found=f"role {role} on dims {names}",
                             at=("dims", having[1], "role"), fix="drop the role from one of them")


def _field_kind(v: Any) -> str:
    return v.get("kind", "array") if isinstance(v, dict) else getattr(v, "kind", "array")


FieldSpec = Annotated[Union[Annotated[ArrayField, Tag("array")],
                            Annotated[SectionsField, Tag("sections")]],
                      Discriminator(_field_kind)]


class BlockLayout(Frozen):
    """The struct of one block: fields at byte offsets (auto-packed when omitted)."""

    fields: tuple[FieldSpec, ...] = Field(min_length=1)
    size: Positive | None = None


# ---------------------------------------------------------------- regions
class Region(Frozen):
    """A run of ``num_blocks`` equally shaped blocks inside a storage."""

    kind: Literal["region"] = "region"
    name: Name
    storage: Name
    layout: Name
    num_blocks: Blocks
    groups: tuple[Name, ...] = Field(min_length=1)
    offset: NonNegative | Literal["auto"] = "auto"
    block_stride: Positive | Literal["auto"] = "auto"
    optional: bool = False
    aliases: tuple[Name, ...] = ()  # regions whose pages this one lies over on purpose (one page pool)
    part_of: Name | None = None  # the region whose fields this one holds some of (split K/V tensors)


class Range(Frozen):
    """The values of a repeat: ``range: layers`` (the engine's layers), ``range: [start, stop]``,
    ``range: [start, stop, step]`` (e.g. every other layer), or an explicit ``values: [...]`` list."""

    var: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
    range: tuple[RepeatValue, ...] | Literal["layers"] | None = None
    values: tuple[RepeatValue, ...] | None = None

    @field_validator("range")
    @classmethod
    def _ordered(cls, v):
        if v is not None and not isinstance(v, str):
            if len(v) not in (2, 3):
                raise spec_error("a repeat range is [start, stop] or [start, stop, step]",
                                 expected="2 or 3 integers", found=f"{len(v)}: {list(v)}",
                                 fix="write range: [0, 8] or range: [0, 8, 2] (or range: layers)")
            if len(v) == 3 and v[2] < 1:
                raise spec_error("a repeat range's step must be positive", expected="a step >= 1",
                                 found=f"step {v[2]}", at=(2,), fix="use a step of 1 or more")
        return _ordered_range(v, "repeat range")

    @model_validator(mode="after")
    def _one_source(self):
        if (self.range is None) == (self.values is None):
            raise spec_error("a repeat takes exactly one of 'range' and 'values'",
                             expected="range: layers | [start, stop] | [start, stop, step], or values: [...]",
                             found="both" if self.range is not None else "neither")
        if self.values is not None and len(set(self.values)) != len(self.values):
            raise spec_error("repeat values must be distinct", found=str(list(self.values)),
                             fix="list each value once")
        return self


class RepeatRegions(Frozen):
    """``repeat: {var: layer, range: layers}`` + ``regions: [...]``: one copy per value."""

    kind: Literal["repeat"] = "repeat"
    repeat: Range
    regions: tuple["RegionEntry", ...] = Field(min_length=1)


class RepeatStorages(Frozen):
    kind: Literal["repeat"] = "repeat"
    repeat: Range
    storages: tuple["StorageEntry", ...] = Field(min_length=1)


def _entry_kind(v: Any) -> str:
    if isinstance(v, dict):
        return "repeat" if "repeat" in v else "item"
    return "repeat" if getattr(v, "kind", None) == "repeat" else "item"


RegionEntry = Annotated[Union[Annotated[Region, Tag("item")], Annotated[RepeatRegions, Tag("repeat")]],
                        Discriminator(_entry_kind)]
StorageEntry = Annotated[Union[Annotated[Storage, Tag("item")], Annotated[RepeatStorages, Tag("repeat")]],
                         Discriminator(_entry_kind)]
RepeatRegions.model_rebuild()
RepeatStorages.model_rebuild()


# ---------------------------------------------------------------- the spec
class LayoutSpec(Frozen):
    """A whole ``kvlc: 1`` spec, validated but not yet compiled."""

    kvlc: Literal[1]
    name: Name
    model: ModelInfo
    parallel: Parallel = Parallel()
    block_size: Tokens
    kernel_block_size: Tokens | None = None
    groups: tuple[Group, ...] = Field(min_length=1)
    storages: tuple[StorageEntry, ...] = Field(min_length=1)
    layouts: FrozenMap[Name, BlockLayout] = Field(min_length=1)
    regions: tuple[RegionEntry, ...] = Field(min_length=1)
    _source: object = PrivateAttr(default=None)  # the Source it was loaded from, for marks

    @model_validator(mode="after")
    def _bounded(self):
        check_spec_bounds(self, spec_error)
        check_interleave(self, spec_error)
        return self
