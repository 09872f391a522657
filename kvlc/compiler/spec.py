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

DTYPE_SIZES: Mapping[str, int] = {
    "bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1, "uint8": 1,
}
DType = Literal["bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "int8", "uint8"]
MemType = Literal["DRAM", "VRAM"]
Name = Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z_][A-Za-z0-9_.\-{}]*$")]
Positive = Annotated[int, Field(gt=0)]
NonNegative = Annotated[int, Field(ge=0)]


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)


# ---------------------------------------------------------------- model identity
class ModelInfo(Frozen):
    """What model the cache belongs to; pairing compares it, dims are checked against it."""

    name: str
    num_layers: Positive
    num_kv_heads: Positive | None = None
    head_dim: Positive | None = None
    sizes: dict[str, Positive] = Field(default_factory=dict)

    def known_sizes(self) -> dict[str, int]:
        """Dim name → size the model fixes (``head`` and ``head_dim`` plus ``sizes``)."""
        out = dict(self.sizes)
        if self.num_kv_heads is not None:
            out.setdefault("head", self.num_kv_heads)
        if self.head_dim is not None:
            out.setdefault("head_dim", self.head_dim)
        return out


class Parallel(Frozen):
    """Engine parallelism: tensor parallel size, decode context parallel size, pipeline layers."""

    tp_size: Positive = 1
    dcp_size: Positive = 1
    layers: tuple[NonNegative, NonNegative] | None = None

    @field_validator("layers")
    @classmethod
    def _ordered(cls, v):
        if v is not None and v[0] >= v[1]:
            raise ValueError(f"layer range must be [start, stop) with start < stop, got {list(v)}")
        return v


# ---------------------------------------------------------------- groups
class _GroupBase(Frozen):
    name: Name
    block_size: Positive | None = None
    kernel_block_size: Positive | None = None


class FullAttention(_GroupBase):
    kind: Literal["full_attention"]


class SlidingWindow(_GroupBase):
    kind: Literal["sliding_window"]
    window: Positive


class ChunkedLocal(_GroupBase):
    kind: Literal["chunked_local"]
    chunk: Positive


class Indexer(_GroupBase):
    kind: Literal["indexer"]


class MambaState(_GroupBase):
    kind: Literal["mamba"]


class LinearAttention(_GroupBase):
    kind: Literal["linear_attention"]


Group = Annotated[Union[FullAttention, SlidingWindow, ChunkedLocal, Indexer, MambaState,
                        LinearAttention], Field(discriminator="kind")]
STATE_GROUP_KINDS = frozenset({"mamba", "linear_attention"})


# ---------------------------------------------------------------- storages
class Storage(Frozen):
    """One allocation (a torch tensor) the runtime binds by name and registers once."""

    name: Name
    mem: MemType
    device: NonNegative = 0
    size: Positive | None = None
    align: Positive = 1


# ---------------------------------------------------------------- block layouts
class Dim(Frozen):
    """A named axis of a field. ``size`` is an int, a model size name, or omitted.

    Omitted sizes come from the model (a dim named like a model size) or, for the
    ``token`` role, from the kernel block size. A ``head`` dim gives the *global*
    count; each rank holds ``size / tp_size`` (or one replica when tp > size).
    """

    name: Name
    size: Positive | str | None = None
    role: Literal["token", "head"] | None = None
    sections: dict[Name, Positive] | None = None


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
        if any(d.sections for d in self.dims):
            raise ValueError("only a 'kind: sections' field may split a dim into sections")
        return self


class SectionsField(Frozen):
    """An array one of whose dims is split into named sections (Mamba conv x|B|C).

    Each section becomes its own field ``<name>.<section>``, sharded by TP on its own.
    """

    kind: Literal["sections"]
    name: Name
    dtype: DType
    offset: NonNegative | None = None
    dims: tuple[Dim, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _one_split(self):
        _check_dim_roles(self.dims)
        split = [d for d in self.dims if d.sections]
        if len(split) != 1:
            raise ValueError(f"a sections field splits exactly one dim, found {len(split)} dims "
                             "with 'sections'")
        if split[0].size is not None:
            raise ValueError(f"dim '{split[0].name}' has sections; its size is their sum, "
                             "remove 'size'")
        return self


def _check_dim_roles(dims) -> None:
    names = [d.name for d in dims]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"dim names must be unique within a field, '{dup[0]}' appears twice")
    for role in ("token", "head"):
        if sum(d.role == role for d in dims) > 1:
            raise ValueError(f"a field has at most one '{role}' dim")


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
    num_blocks: Positive
    groups: tuple[Name, ...] = Field(min_length=1)
    offset: NonNegative | Literal["auto"] = "auto"
    block_stride: Positive | Literal["auto"] = "auto"
    optional: bool = False


class Range(Frozen):
    var: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
    range: tuple[NonNegative, NonNegative] | Literal["layers"]


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
    block_size: Positive
    kernel_block_size: Positive | None = None
    groups: tuple[Group, ...] = Field(min_length=1)
    storages: tuple[StorageEntry, ...] = Field(min_length=1)
    layouts: dict[Name, BlockLayout] = Field(min_length=1)
    regions: tuple[RegionEntry, ...] = Field(min_length=1)
    _source: object = PrivateAttr(default=None)  # the Source it was loaded from, for marks
