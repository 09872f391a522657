"""What a plan holds, as exact integers: per region, storage, memory type and group.

Byte counts used everywhere here (all exact integers):

* a region's **bytes** are ``num_blocks * block_bytes``: the bytes its blocks hold, padding
  between blocks (``block_stride - block_bytes``) excluded. Regions of one storage never share
  a byte, so a storage's bytes are the sum of its regions' bytes and ``free = size - bytes``.
* a region's **span** is ``end - offset``: the address range from its first block's first byte
  to its last block's last byte (what the page draws). Interleaved regions have overlapping spans.
* a group's **block bytes** are the bytes of one *logical* block across all of its regions
  (``block_bytes * kernel_blocks_per_block`` summed): what one block id costs.

Every number of a plan is **per rank**: each of the engine's ``tp_size`` ranks holds one such
set of storages. Engine totals multiply by ``tp_size``; token capacity is the same on every rank.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

from kvlc.collapse import compact_ints
from kvlc.collapse import split_name as _split
from kvlc.collapse import vary_label
from kvlc.compiler.plan.model import Plan, PlanField, PlanRegion
from kvlc.explain.numbers import exact, field_short, human


@dataclass(frozen=True)
class RegionRow:
    """One region, in numbers. ``bytes = num_blocks * block_bytes``; ``span = end - offset``."""

    name: str
    storage: str
    mem: str            # "VRAM:0"
    offset: int
    num_blocks: int     # kernel blocks
    capacity: int       # logical blocks (num_blocks // kernel blocks per block)
    block_bytes: int    # one kernel block
    block_stride: int
    tokens: str         # tokens per logical block ("16", "32 (2x16)") or "state"
    groups: tuple[str, ...]
    bytes: int
    span: int
    fields: str         # short form of every field, space separated
    optional: bool = False
    replicas: int = 1   # ranks of the engine holding each byte of this region (largest over fields)


@dataclass(frozen=True)
class StorageTotal:
    """One storage: ``bytes`` is the sum of its regions' bytes, ``free = size - bytes``."""

    name: str
    mem: str            # "VRAM:0"
    size: int
    regions: int
    bytes: int

    @property
    def free(self) -> int:
        return self.size - self.bytes


@dataclass(frozen=True)
class MemTotal:
    """One memory type (DRAM or VRAM) over every storage of that type."""

    mem: str
    devices: tuple[int, ...]
    storages: int
    size: int           # sum of storage sizes
    regions: int
    bytes: int          # sum of region bytes


@dataclass(frozen=True)
class GroupTotal:
    """One KV-cache group over every region that serves it (a shared region counts in each group)."""

    name: str
    kind: str
    window: int
    block_size: int
    kernel_block_size: int
    is_state: bool
    regions: int
    bytes: int          # sum of region bytes
    block_bytes: int    # one logical block across all its regions
    capacity: int       # logical blocks every region can hold (the minimum), 0 without regions
    dcp_size: int = 1

    @property
    def token_bytes(self) -> float | None:
        """Bytes one token costs across the group's regions (None for per-request state)."""
        return None if self.is_state else self.block_bytes / self.block_size

    @property
    def rank_tokens(self) -> int | None:
        """Tokens one rank's regions of this group hold (``capacity * block_size``); None for state."""
        return None if self.is_state else self.capacity * self.block_size

    @property
    def engine_tokens(self) -> int | None:
        """Tokens of requests the engine holds in this group: every TP rank holds the same tokens
        (other heads); with decode context parallelism each rank holds every ``dcp_size``-th token."""
        return None if self.is_state else self.capacity * self.block_size * self.dcp_size


@dataclass(frozen=True)
class RegionRun:
    """Regions that differ only by one number in their name (the layer): one table row.

    ``label`` is e.g. ``layer.{0..31}``; ``offset``/``storage`` say how those vary.
    """

    label: str
    rows: tuple[RegionRow, ...]
    storage: str
    offset: str

    @property
    def count(self) -> int:
        return len(self.rows)

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.rows)

    @property
    def first(self) -> RegionRow:
        return self.rows[0]


@dataclass(frozen=True)
class Summary:
    """Everything ``kvlc explain`` shows, as exact integers.

    >>> from kvlc import compile_spec
    >>> s = summarize(compile_spec("layouts/llama-3.1-8b.yaml"))
    >>> len(s.regions), s.regions[0].bytes, human(s.total_bytes)
    (32, 268435456, '8 GiB')
    >>> [(r.label, r.count) for r in s.runs()]
    [('layer.{0..31}', 32)]
    """

    name: str
    digest: str
    model: str
    num_layers: int
    tp_size: int
    dcp_size: int
    layers: tuple[int, int]
    regions: tuple[RegionRow, ...]
    storages: tuple[StorageTotal, ...]
    mems: tuple[MemTotal, ...]
    groups: tuple[GroupTotal, ...]

    @property
    def total_bytes(self) -> int:
        """Sum of every region's bytes."""
        return sum(r.bytes for r in self.regions)

    @property
    def total_size(self) -> int:
        """Sum of every storage's size."""
        return sum(s.size for s in self.storages)

    @property
    def engine_bytes(self) -> int:
        """Region bytes of the whole engine: ``tp_size`` ranks, each holding :attr:`total_bytes`."""
        return self.total_bytes * self.tp_size

    @property
    def engine_size(self) -> int:
        """Storage bytes of the whole engine (``tp_size`` ranks)."""
        return self.total_size * self.tp_size

    def runs(self, full: bool = False) -> tuple[RegionRun, ...]:
        """Region rows for a table: per-layer runs collapsed into one row each (``full``: one per region)."""
        if full:
            return tuple(RegionRun(r.name, (r,), r.storage, exact(r.offset)) for r in self.regions)
        return collapse(self.regions)


def _tokens(r: PlanRegion) -> str:
    if r.is_state:
        return "state"
    kb = r.kernel_blocks_per_block
    total = r.block_tokens * kb
    return f"{total} ({kb}x{r.block_tokens})" if kb > 1 else str(total)


def replicas(f: PlanField, tp_size: int) -> int:
    """How many ranks of an engine of TP ``tp_size`` hold each byte of field ``f``.

    A field without a ``head`` dim is replicated on every rank (an MLA latent); a head dim with
    fewer heads than ranks puts each head on ``tp_size / heads`` ranks (GQA at high TP).

    >>> from kvlc import compile_spec
    >>> replicas(compile_spec("layouts/deepseek-v3-tp8.yaml").regions[0].fields[0], 8)
    8
    >>> replicas(compile_spec("layouts/llama-3.1-70b-tp8.yaml").regions[0].fields[0], 8)
    1
    """
    head = f.dim("head")
    if head is None:
        return tp_size
    return max(1, tp_size * head.size // head.global_size)


def region_row(r: PlanRegion, tp_size: int = 1) -> RegionRow:
    """The numbers of one region (``tp_size``: the engine's, for :attr:`RegionRow.replicas`)."""
    return RegionRow(
        name=r.name, storage=r.storage, mem=f"{r.mem}:{r.device}", offset=r.offset,
        num_blocks=r.num_blocks, capacity=r.capacity, block_bytes=r.block_bytes,
        block_stride=r.block_stride, tokens=_tokens(r), groups=r.groups,
        bytes=0 if r.aliases else r.num_blocks * r.block_bytes, span=r.end - r.offset,
        fields=" ".join(field_short(f) for f in r.fields), optional=r.optional,
        replicas=max((replicas(f, tp_size) for f in r.fields), default=1))


def _storage_totals(plan: Plan, rows: tuple[RegionRow, ...]) -> tuple[StorageTotal, ...]:
    by_storage: dict[str, list[RegionRow]] = defaultdict(list)
    for row in rows:
        by_storage[row.storage].append(row)
    return tuple(
        StorageTotal(name=s.name, mem=f"{s.mem}:{s.device}", size=s.size,
                     regions=len(by_storage[s.name]), bytes=sum(r.bytes for r in by_storage[s.name]))
        for s in plan.storages)


def _mem_total(plan: Plan, mem: str) -> MemTotal:
    sts = [s for s in plan.storages if s.mem == mem]
    regs = [r for r in plan.regions if r.mem == mem]
    devices = tuple(sorted({s.device for s in sts} | {r.device for r in regs}))
    return MemTotal(mem=mem, devices=devices, storages=len(sts), size=sum(s.size for s in sts),
                    regions=len(regs), bytes=sum(r.num_blocks * r.block_bytes for r in regs if not r.aliases))


def _group_total(plan: Plan, g) -> GroupTotal:
    regs = [r for r in plan.regions if g.name in r.groups]
    return GroupTotal(
        name=g.name, kind=g.kind, window=g.window, block_size=g.block_size,
        kernel_block_size=g.kernel_block_size, is_state=g.is_state, regions=len(regs),
        bytes=sum(r.num_blocks * r.block_bytes for r in regs),
        block_bytes=sum(r.block_bytes * r.kernel_blocks_per_block for r in regs),
        capacity=min((r.capacity for r in regs), default=0),
        dcp_size=plan.group_dcp(g.name))  # a replicated group: every rank holds all of its tokens


def summarize(plan: Plan) -> Summary:
    """Per-region rows and per-storage, per-memory-type and per-group totals of ``plan``."""
    rows = tuple(region_row(r, plan.parallel.tp_size) for r in plan.regions)
    mems = dict.fromkeys([s.mem for s in plan.storages] + [r.mem for r in plan.regions])
    return Summary(name=plan.name, digest=plan.digest, model=plan.model.name,
                   num_layers=plan.model.num_layers, tp_size=plan.parallel.tp_size,
                   dcp_size=plan.parallel.dcp_size, layers=tuple(plan.parallel.layers),
                   regions=rows, storages=_storage_totals(plan, rows),
                   mems=tuple(_mem_total(plan, mem) for mem in mems),
                   groups=tuple(_group_total(plan, g) for g in plan.groups))


# ---------------------------------------------------------------- collapsing per-layer runs
# The name-collapsing rules are shared with error rendering (kvlc.collapse).


def _offset_label(offsets: Sequence[int]) -> str:
    if len(set(offsets)) == 1:
        return exact(offsets[0])
    step = offsets[1] - offsets[0]
    if step > 0 and all(b - a == step for a, b in zip(offsets, offsets[1:])):
        return f"{exact(offsets[0])} + i*{exact(step)}"
    return f"{exact(min(offsets))}..{exact(max(offsets))}"


def collapse(rows: Sequence[RegionRow]) -> tuple[RegionRun, ...]:
    """Merge regions that differ only by one number in their name (and, with it, storage/offset).

    Everything else — memory, block count and geometry, tokens, groups, fields — must be equal.
    Runs keep the order of their first region; regions of a run keep plan order.

    >>> rows = summarize(__import__("kvlc").compile_spec("layouts/llama-3.1-8b.yaml")).regions
    >>> [(r.label, r.storage, r.offset, r.count) for r in collapse(rows)]
    [('layer.{0..31}', 'kv.{0..31}', '0', 32)]
    """
    parts = name_runs(rows, lambda r: r.name, lambda r: (
        _split(r.storage)[0], r.mem, r.num_blocks, r.block_bytes, r.block_stride, r.tokens, r.groups,
        r.fields, r.optional))
    return tuple(RegionRun(label=vary_label([r.name for r in part]), rows=tuple(part),
                           storage=vary_label([r.storage for r in part]),
                           offset=_offset_label([r.offset for r in part])) for part in parts)


def collapse_storages(storages: Sequence[StorageTotal]) -> tuple[tuple[str, tuple[StorageTotal, ...]], ...]:
    """(label, storages) for storages that differ only by one number in their name.

    >>> st = summarize(__import__("kvlc").compile_spec("layouts/llama-3.1-8b.yaml")).storages
    >>> [(label, len(part)) for label, part in collapse_storages(st)]
    [('kv.{0..31}', 32)]
    """
    parts = name_runs(storages, lambda s: s.name, lambda s: (s.mem, s.size, s.regions, s.bytes))
    return tuple((vary_label([s.name for s in part]), tuple(part)) for part in parts)


def name_runs(items: Sequence, name_of, key_of) -> list[list]:
    """Partition ``items`` into runs whose names differ by one number and whose ``key_of`` is equal.

    Runs are ordered by their first item; items keep their order inside a run.
    """
    buckets: dict[tuple, list] = {}
    for item in items:
        buckets.setdefault((_split(name_of(item))[0],) + tuple(key_of(item)), []).append(item)
    index = {id(item): i for i, item in enumerate(items)}
    parts = [part for members in buckets.values() for part in _by_number(members, name_of)]
    return sorted(parts, key=lambda part: index[id(part[0])])


def _by_number(members: list, name_of) -> list[list]:
    """Split items of one name skeleton so that one number position at most varies within a part."""
    nums = [_split(name_of(m))[1] for m in members]
    varying = [i for i in range(len(nums[0])) if len({t[i] for t in nums}) > 1]
    if len(varying) <= 1:
        return [members]
    layer = varying[0]
    parts: dict[tuple, list] = {}
    for m, t in zip(members, nums):
        parts.setdefault(t[:layer] + t[layer + 1:], []).append(m)
    return list(parts.values())

