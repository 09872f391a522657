"""``kvlc explain``: what a plan holds, as tables (rich) and as a page drawn to scale (HTML).

Pure: reads a :class:`~kvlc.compiler.plan.Plan`, returns values and text. No nixl, no torch.

Byte counts used everywhere here (all exact integers):

* a region's **bytes** are ``num_blocks * block_bytes``: the bytes its blocks hold, padding
  between blocks (``block_stride - block_bytes``) excluded. Regions of one storage never share
  a byte, so a storage's bytes are the sum of its regions' bytes and ``free = size - bytes``.
* a region's **span** is ``end - offset``: the address range from its first block's first byte
  to its last block's last byte (what the page draws). Interleaved regions have overlapping spans.
* a group's **block bytes** are the bytes of one *logical* block across all of its regions
  (``block_bytes * kernel_blocks_per_block`` summed): what one block id costs.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from kvlc.collapse import compact_ints  # noqa: F401 (part of this module's interface)
from kvlc.collapse import split_name as _split
from kvlc.collapse import vary_label as _vary_label
from kvlc.compiler.plan import Plan, PlanField, PlanRegion

if TYPE_CHECKING:
    from rich.console import Console


# ---------------------------------------------------------------- number formats
def human(n: int) -> str:
    """Bytes in binary units, exact where the unit divides, else 3 significant digits.

    >>> human(268435456), human(65536), human(1000), human(1536 * 1024 * 1024 + 1)
    ('256 MiB', '64 KiB', '1000 B', '1.50 GiB')
    """
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            if n % scale == 0:
                return f"{n // scale} {unit}"
            v = n / scale
            return f"{v:.{max(0, 2 - len(str(int(v))) + 1)}f} {unit}"
    return f"{n} B"


def exact(n: int) -> str:
    """An exact byte count, grouped by thousands: ``268,435,456``."""
    return f"{n:,}"


def both(n: int) -> str:
    """Human units and exact bytes: ``256 MiB (268,435,456)``."""
    h = human(n)
    return h if h.endswith(" B") else f"{h} ({exact(n)})"


def field_short(f: PlanField) -> str:
    """A field in short form: ``k@0:bf16[token=16,head=8/8,head_dim=128]`` (head: local/global)."""
    dims = ",".join(f"{d.name}={d.size}" + (f"/{d.global_size}" if d.role == "head" else "")
                    for d in f.dims)
    return f"{f.name}@{f.offset}:{f.dtype}[{dims}]"


# ---------------------------------------------------------------- the summary
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

    @property
    def token_bytes(self) -> float | None:
        """Bytes one token costs across the group's regions (None for per-request state)."""
        return None if self.is_state else self.block_bytes / self.block_size


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


def region_row(r: PlanRegion) -> RegionRow:
    """The numbers of one region."""
    return RegionRow(
        name=r.name, storage=r.storage, mem=f"{r.mem}:{r.device}", offset=r.offset,
        num_blocks=r.num_blocks, capacity=r.capacity, block_bytes=r.block_bytes,
        block_stride=r.block_stride, tokens=_tokens(r), groups=r.groups,
        # a region that aliases another's pages (a shared page pool) adds no bytes of its own
        bytes=0 if r.aliases else r.num_blocks * r.block_bytes, span=r.end - r.offset,
        fields=" ".join(field_short(f) for f in r.fields), optional=r.optional)


def summarize(plan: Plan) -> Summary:
    """Per-region rows and per-storage, per-memory-type and per-group totals of ``plan``."""
    rows = tuple(region_row(r) for r in plan.regions)
    by_storage: dict[str, list[RegionRow]] = defaultdict(list)
    for row in rows:
        by_storage[row.storage].append(row)
    storages = tuple(
        StorageTotal(name=s.name, mem=f"{s.mem}:{s.device}", size=s.size,
                     regions=len(by_storage[s.name]), bytes=sum(r.bytes for r in by_storage[s.name]))
        for s in plan.storages)
    mems = []
    for mem in dict.fromkeys([s.mem for s in plan.storages] + [r.mem for r in plan.regions]):
        sts = [s for s in plan.storages if s.mem == mem]
        regs = [r for r in plan.regions if r.mem == mem]
        devices = tuple(sorted({s.device for s in sts} | {r.device for r in regs}))
        mems.append(MemTotal(mem=mem, devices=devices, storages=len(sts), size=sum(s.size for s in sts),
                             regions=len(regs), bytes=sum(r.num_blocks * r.block_bytes for r in regs
                                                          if not r.aliases)))
    groups = []
    for g in plan.groups:
        regs = [r for r in plan.regions if g.name in r.groups]
        groups.append(GroupTotal(
            name=g.name, kind=g.kind, window=g.window, block_size=g.block_size,
            kernel_block_size=g.kernel_block_size, is_state=g.is_state, regions=len(regs),
            bytes=sum(r.num_blocks * r.block_bytes for r in regs),
            block_bytes=sum(r.block_bytes * r.kernel_blocks_per_block for r in regs),
            capacity=min((r.capacity for r in regs), default=0)))
    return Summary(name=plan.name, digest=plan.digest, model=plan.model.name,
                   num_layers=plan.model.num_layers, tp_size=plan.parallel.tp_size,
                   dcp_size=plan.parallel.dcp_size, layers=tuple(plan.parallel.layers),
                   regions=rows, storages=storages, mems=tuple(mems), groups=tuple(groups))


# ---------------------------------------------------------------- collapsing per-layer runs
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
    parts = _runs(rows, lambda r: r.name, lambda r: (
        _split(r.storage)[0], r.mem, r.num_blocks, r.block_bytes, r.block_stride, r.tokens, r.groups,
        r.fields, r.optional))
    return tuple(RegionRun(label=_vary_label([r.name for r in part]), rows=tuple(part),
                           storage=_vary_label([r.storage for r in part]),
                           offset=_offset_label([r.offset for r in part])) for part in parts)


def collapse_storages(storages: Sequence[StorageTotal]) -> tuple[tuple[str, tuple[StorageTotal, ...]], ...]:
    """(label, storages) for storages that differ only by one number in their name.

    >>> st = summarize(__import__("kvlc").compile_spec("layouts/llama-3.1-8b.yaml")).storages
    >>> [(label, len(part)) for label, part in collapse_storages(st)]
    [('kv.{0..31}', 32)]
    """
    parts = _runs(storages, lambda s: s.name, lambda s: (s.mem, s.size, s.regions, s.bytes))
    return tuple((_vary_label([s.name for s in part]), tuple(part)) for part in parts)


def _runs(items: Sequence, name_of, key_of) -> list[list]:
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


# ---------------------------------------------------------------- tables (shared by rich and HTML)
@dataclass(frozen=True)
class TableData:
    """A table as text cells; ``numeric[i]`` right-aligns column i."""

    title: str
    columns: tuple[str, ...]
    numeric: tuple[bool, ...]
    rows: tuple[tuple[str, ...], ...]
    footer: tuple[str, ...] | None = None


def _rows_note(what: str, total: int, shown: int, how: str) -> str:
    if shown == total:
        return f"{what} ({total})"
    return f"{what} ({total}, {how} collapsed into {shown} row{'s' if shown != 1 else ''})"


def _per_token(g: GroupTotal) -> str:
    per = g.token_bytes
    if per is None:
        return ""
    return both(int(per)) if per == int(per) else f"{per:,.2f} B"


def _region_table(s: Summary, full: bool) -> TableData:
    runs = s.runs(full)
    rows = []
    for run in runs:
        r = run.first
        groups = ",".join(r.groups) + (" (optional)" if r.optional else "")
        rows.append((run.label, f"x{run.count}" if run.count > 1 else "", run.storage, r.mem, run.offset,
                     exact(r.num_blocks), exact(r.capacity), exact(r.block_bytes), exact(r.block_stride),
                     r.tokens, groups, both(run.bytes), r.fields))
    return TableData(
        _rows_note("Regions", len(s.regions), len(runs), "per-layer runs"),
        ("region", "n", "storage", "mem", "offset", "blocks", "logical", "block B", "stride",
         "tokens/block", "groups", "bytes (all n)", "fields"),
        (False, True, False, False, True, True, True, True, True, True, False, True, False),
        tuple(rows),
        ("total", str(len(s.regions)), "", "", "", "", "", "", "", "", "", both(s.total_bytes), ""))


def _group_table(s: Summary) -> TableData:
    return TableData(
        "Groups", ("group", "kind", "window", "block", "kernel", "regions", "logical blocks",
                   "bytes / block", "bytes / token", "bytes"),
        (False, False, True, True, True, True, True, True, True, True),
        tuple((g.name, g.kind, str(g.window) if g.window else "",
               "state" if g.is_state else str(g.block_size), "" if g.is_state else str(g.kernel_block_size),
               str(g.regions), exact(g.capacity), both(g.block_bytes), _per_token(g), both(g.bytes))
              for g in s.groups))


def _storage_table(s: Summary, full: bool) -> TableData:
    parts = tuple((st.name, (st,)) for st in s.storages) if full else collapse_storages(s.storages)
    return TableData(
        _rows_note("Storages", len(s.storages), len(parts), "equal ones"),
        ("storage", "n", "mem", "size (each)", "regions (each)", "region bytes (all n)", "free (all n)"),
        (False, True, False, True, True, True, True),
        tuple((label, f"x{len(p)}" if len(p) > 1 else "", p[0].mem, both(p[0].size), str(p[0].regions),
               both(sum(st.bytes for st in p)), both(sum(st.free for st in p))) for label, p in parts),
        ("total", str(len(s.storages)), "", both(s.total_size), str(len(s.regions)), both(s.total_bytes),
         both(s.total_size - s.total_bytes)))


def _mem_table(s: Summary) -> TableData:
    return TableData(
        "Memory types", ("mem", "devices", "storages", "size", "regions", "region bytes"),
        (False, False, True, True, True, True),
        tuple((m.mem, ",".join(map(str, m.devices)), str(m.storages), both(m.size), str(m.regions),
               both(m.bytes)) for m in s.mems),
        ("total", "", str(len(s.storages)), both(s.total_size), str(len(s.regions)), both(s.total_bytes)))


def tables(summary: Summary, full: bool = False) -> tuple[TableData, ...]:
    """The regions, groups, storages and memory-type tables as text cells (rich and HTML draw these).

    >>> s = summarize(__import__("kvlc").compile_spec("layouts/llama-3.1-8b.yaml"))
    >>> [t.title for t in tables(s)][:2]
    ['Regions (32, per-layer runs collapsed into 1 row)', 'Groups']
    """
    return (_region_table(summary, full), _group_table(summary), _storage_table(summary, full),
            _mem_table(summary))


def header_lines(s: Summary) -> tuple[str, ...]:
    """The plan's identity: name, model, parallelism, digest."""
    return (f"plan {s.name}  model {s.model}  layers {s.num_layers}  tp {s.tp_size}  dcp {s.dcp_size}  "
            f"pp layers {s.layers[0]}:{s.layers[1]}",
            f"digest {s.digest}")


def render_table(plan: Plan, console: Console, full: bool = False) -> None:
    """Print the plan's tables on a :class:`rich.console.Console`.

    >>> from io import StringIO
    >>> from rich.console import Console
    >>> from kvlc import compile_spec
    >>> con = Console(file=StringIO(), width=200)
    >>> render_table(compile_spec("layouts/llama-3.1-8b.yaml"), con)
    >>> "layer.{0..31}" in con.file.getvalue()
    True
    """
    from rich.table import Table
    from rich.text import Text

    s = summarize(plan)
    for line in header_lines(s):
        console.print(Text(line, style="bold"))
    for t in tables(s, full):
        table = Table(title=t.title, title_justify="left", title_style="bold",
                      show_footer=t.footer is not None, header_style="bold")
        for i, (col, num) in enumerate(zip(t.columns, t.numeric)):
            table.add_column(col, justify="right" if num else "left",
                             footer=Text(t.footer[i]) if t.footer else "",
                             overflow="fold", no_wrap=col not in ("fields", "groups"))
        for row in t.rows:
            table.add_row(*(Text(cell) for cell in row))
        console.print(table)


# ---------------------------------------------------------------- HTML
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1",
           "#ff9da7", "#9c755f", "#8cd17d", "#86bcb6", "#d37295")
BAR_W = 960          # pixels of the largest storage
LABEL_W = 270        # storage names left of the bars
LANE_H = 22          # one lane of regions
ROW_GAP = 8
MIN_STORAGE_PX = 6.0
MIN_REGION_PX = 3.0
RULER_H = 28


def _ruler_step(size: int) -> int:
    """A power of two such that at most 8 ticks cover ``size`` bytes."""
    step = 1
    while size / step > 8:
        step *= 2
    return step


def _lanes(regions: Sequence[PlanRegion]) -> list[int]:
    """A lane per region so that spans in one lane never overlap (interleaved regions stack)."""
    order = sorted(range(len(regions)), key=lambda i: (regions[i].offset, i))
    ends: list[int] = []
    lanes = [0] * len(regions)
    for i in order:
        r = regions[i]
        lane = next((k for k, e in enumerate(ends) if e <= r.offset), len(ends))
        if lane == len(ends):
            ends.append(r.end)
        else:
            ends[lane] = r.end
        lanes[i] = lane
    return lanes


def region_title(r: PlanRegion) -> str:
    """Hover text of a region: every exact number."""
    row = region_row(r)
    gap = r.block_stride - r.block_bytes
    pad = f", {exact(gap)} B padding per block" if gap else ""
    return "\n".join((
        f"region {r.name} in {r.storage} ({row.mem})",
        f"offset {exact(r.offset)} B, end {exact(r.end)} B, span {exact(row.span)} B",
        f"{exact(r.num_blocks)} blocks x {exact(r.block_bytes)} B (stride {exact(r.block_stride)} B{pad})"
        f" = {exact(row.bytes)} B",
        f"capacity {exact(r.capacity)} logical blocks, tokens/block {row.tokens}",
        f"groups {','.join(r.groups)}" + (" (optional)" if r.optional else ""),
        f"fields {row.fields}"))


def svg_model(plan: Plan) -> dict:
    """Pixel geometry of the storage map: bars to one scale, regions to scale inside their bar."""
    colors = {g.name: PALETTE[i % len(PALETTE)] for i, g in enumerate(plan.groups)}
    summary = {st.name: st for st in summarize(plan).storages}
    largest = max((s.size for s in plan.storages), default=1)
    scale = BAR_W / largest
    y = RULER_H
    rows = []
    for s in plan.storages:
        regs = [r for r in plan.regions if r.storage == s.name]
        lanes = _lanes(regs)
        nlanes = max(lanes, default=0) + 1
        h = nlanes * LANE_H
        true_w = s.size * scale
        bar_w = max(MIN_STORAGE_PX, true_w)
        px = bar_w / s.size  # pixels per byte in this bar (the global scale unless enlarged)
        st = summary[s.name]
        bar = dict(x=LABEL_W, y=y, w=bar_w, h=h, mem=s.mem,
                   title="\n".join((f"storage {s.name} ({s.mem}:{s.device})",
                                    f"size {exact(s.size)} B ({human(s.size)})",
                                    f"{st.regions} regions, {exact(st.bytes)} B in blocks, "
                                    f"{exact(st.free)} B free")
                                   + (("drawn enlarged to stay visible",) if bar_w > true_w else ())))
        items = []
        for r, lane in zip(regs, lanes):
            span = r.end - r.offset
            w = max(MIN_REGION_PX, span * px)
            x = LABEL_W + r.offset * px
            x = min(x, LABEL_W + bar_w - w)
            ry = y + lane * LANE_H + 2
            rh = LANE_H - 4
            n = len(r.groups)
            bands = [dict(x=x, y=ry + k * rh / n, w=w, h=rh / n, color=colors[g])
                     for k, g in enumerate(r.groups)]
            label = r.name if len(r.name) * 6.6 + 8 <= w else ""
            items.append(dict(name=r.name, x=x, y=ry, w=w, h=rh, mem=r.mem, bands=bands, label=label,
                              edge=0.6 if w >= 6 else 0,
                              label_x=x + 4, label_y=ry + rh / 2 + 4, title=region_title(r),
                              bytes=r.num_blocks * r.block_bytes, span=span))
        items.sort(key=lambda it: it["w"] > it["span"] * px)  # enlarged ones last: drawn on top
        rows.append(dict(name=s.name, mem=f"{s.mem}:{s.device}", size=human(s.size), size_bytes=s.size,
                         y=y, h=h, label_y=y + h / 2 + 4, bar=bar, regions=items, enlarged=bar_w > true_w))
        y += h + ROW_GAP
    step = _ruler_step(largest)
    ticks = [dict(x=LABEL_W + k * step * scale, label=human(k * step) if k else "0")
             for k in range(largest // step + 1)]
    legend = [dict(name=g.name, kind=g.kind, color=colors[g.name]) for g in plan.groups]
    return dict(width=LABEL_W + BAR_W + 20, height=y + 4, ruler_y=RULER_H - 6, ticks=ticks,
                ruler_end=LABEL_W + BAR_W,
                scale_text=f"full width = {human(largest)} ({exact(largest)} B)", rows=rows,
                legend=legend, label_w=LABEL_W, min_region_px=MIN_REGION_PX)


def _fieldwrap(cell: str):
    """One ``<span>`` per field, breakable only after a comma (``<wbr>``), every character escaped."""
    from markupsafe import Markup, escape
    return Markup("").join(Markup("<span>") + Markup(",<wbr>").join(escape(p) for p in f.split(","))
                           + Markup("</span>") for f in cell.split(" "))


def _environment():
    import jinja2
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(Path(__file__).parent / "templates")),
                             autoescape=True, undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True)
    env.filters["px"] = lambda v: f"{v:.2f}".rstrip("0").rstrip(".")
    env.filters["fieldwrap"] = _fieldwrap
    env.filters["exact"] = exact
    env.filters["human"] = human
    return env


def render_html(plan: Plan) -> str:
    """A standalone HTML page (inline CSS and SVG, no scripts, no external assets) explaining ``plan``.

    >>> from kvlc import compile_spec
    >>> page = render_html(compile_spec("layouts/llama-3.1-8b.yaml"))
    >>> page.startswith("<!DOCTYPE html>") and "llama-3.1-8b-tp1" in page
    True
    """
    s = summarize(plan)
    short, full = tables(s), tables(s, full=True)
    longer = tuple(f for c, f in zip(short, full) if len(f.rows) != len(c.rows))
    return _environment().get_template("explain.html.j2").render(
        s=s, svg=svg_model(plan), tables=short, full_tables=longer)
