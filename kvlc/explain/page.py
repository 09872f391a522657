"""``kvlc explain --html``: a standalone page drawing a plan to scale."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from kvlc.collapse import vary_label
from kvlc.compiler.plan.model import Plan, PlanRegion
from kvlc.explain.blocks import block_maps
from kvlc.explain.numbers import exact, human
from kvlc.explain.summary import collapse, name_runs, region_row, summarize
from kvlc.explain.tables import tables


PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1",
           "#ff9da7", "#9c755f", "#8cd17d", "#86bcb6", "#d37295")
BAR_W = 940          # pixels of the largest storage
LABEL_W = 290        # storage names left of the bars
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


def region_title(r: PlanRegion, tp_size: int = 1) -> str:
    """Hover text of a region: every exact number."""
    row = region_row(r, tp_size)
    gap = r.block_stride - r.block_bytes
    pad = f", {exact(gap)} B padding per block" if gap else ""
    return "\n".join((
        f"region {r.name} in {r.storage} ({row.mem})",
        f"offset {exact(r.offset)} B, end {exact(r.end)} B, span {exact(row.span)} B",
        f"{exact(r.num_blocks)} blocks x {exact(r.block_bytes)} B (stride {exact(r.block_stride)} B{pad})"
        f" = {exact(row.bytes)} B",
        f"capacity {exact(r.capacity)} logical blocks, tokens/block {row.tokens}",
        f"groups {','.join(r.groups)}" + (" (optional)" if r.optional else ""),
        f"fields {row.fields}")
        + ((f"each byte held by {row.replicas} ranks (replicated)",) if row.replicas > 1 else ()))


def _storage_key(plan: Plan, name: str) -> tuple:
    """What a storage's drawing shows: equal keys draw alike (and collapse into one bar)."""
    s = plan.storage(name)
    return (s.mem, s.device, s.size) + tuple(
        (r.offset, r.num_blocks, r.block_bytes, r.block_stride, r.groups, r.fields)
        for r in plan.regions if r.storage == name)


def storage_runs(plan: Plan) -> list[list]:
    """Storages that differ only by one number in their name and draw alike: one bar each run.

    >>> from kvlc import compile_spec
    >>> [len(run) for run in storage_runs(compile_spec("layouts/llama-3.1-8b.yaml"))]
    [32]
    """
    return name_runs(list(plan.storages), lambda s: s.name, lambda s: _storage_key(plan, s.name))


def _region_item(r: PlanRegion, label_name: str, y: float, lane: int, px: float, x0: float, bar_w: float,
                 colors: dict, tp_size: int, count: int) -> dict:
    span = r.end - r.offset
    w = max(MIN_REGION_PX, span * px)
    x = min(x0 + r.offset * px, x0 + bar_w - w)
    ry, rh = y + lane * LANE_H + 2, LANE_H - 4
    n = len(r.groups)
    bands = [dict(x=x, y=ry + k * rh / n, w=w, h=rh / n, color=colors[g]) for k, g in enumerate(r.groups)]
    label = label_name if len(label_name) * 6.6 + 8 <= w else ""
    return dict(name=r.name, label_name=label_name, count=count, x=x, y=ry, w=w, h=rh, mem=r.mem, bands=bands,
                label=label, edge=0.6 if w >= 6 else 0, label_x=x + 4, label_y=ry + rh / 2 + 4,
                title=region_title(r, tp_size) + (f"\n(drawn once for {count} alike: {label_name})"
                                                  if count > 1 else ""),
                bytes=r.num_blocks * r.block_bytes, span=span, enlarged=w > span * px)


def _storage_title(run: list, regs: list, label: str, enlarged: bool) -> str:
    """The hover text of one storage bar (``run``: the alike storages it is drawn once for)."""
    s = run[0]
    used = sum(r.num_blocks * r.block_bytes for r in regs)
    return "\n".join((f"storage {label} ({s.mem}:{s.device})" + (f", {len(run)} alike" if len(run) > 1 else ""),
                      f"size {exact(s.size)} B ({human(s.size)})" + (" each" if len(run) > 1 else ""),
                      f"{len(regs)} regions, {exact(used)} B in blocks, {exact(s.size - used)} B free")
                     + (("drawn enlarged to stay visible",) if enlarged else ()))


def _storage_row(plan: Plan, run: list, y: float, scale: float, colors: dict, region_labels: dict) -> dict:
    """One storage bar at height ``y`` with its regions in lanes (``run``: alike storages drawn once)."""
    s = run[0]
    regs = [r for r in plan.regions if r.storage == s.name]
    lanes = _lanes(regs)
    h = (max(lanes, default=0) + 1) * LANE_H
    true_w = s.size * scale
    bar_w = max(MIN_STORAGE_PX, true_w)
    px = bar_w / s.size
    label = vary_label([x.name for x in run])
    title = _storage_title(run, regs, label, bar_w > true_w)
    items = [_region_item(r, region_labels.get(r.name, r.name), y, lane, px, LABEL_W, bar_w, colors,
                          plan.parallel.tp_size, len(run))
             for r, lane in zip(regs, lanes)]
    items.sort(key=lambda it: it["enlarged"])   # enlarged ones last: drawn on top
    return dict(name=label, first=s.name, count=len(run), members=" ".join(x.name for x in run),
                mem=f"{s.mem}:{s.device}", size=human(s.size), size_bytes=s.size, y=y, h=h,
                label_y=y + h / 2 + 4, regions=items, enlarged=bar_w > true_w,
                bar=dict(x=LABEL_W, y=y, w=bar_w, h=h, mem=s.mem, title=title))


def _mem_map(plan: Plan, mem: str, runs: list[list], colors: dict, region_labels: dict) -> dict:
    """One memory type's map: its storages (collapsed runs) on one scale of their own."""
    largest = max(run[0].size for run in runs)
    scale = BAR_W / largest
    y, rows = RULER_H, []
    for run in runs:
        rows.append(_storage_row(plan, run, y, scale, colors, region_labels))
        y += rows[-1]["h"] + ROW_GAP
    step = _ruler_step(largest)
    ticks = [dict(x=LABEL_W + k * step * scale, label=human(k * step) if k else "0")
             for k in range(largest // step + 1)]
    return dict(mem=mem, width=LABEL_W + BAR_W + 20, height=y + 4, ruler_y=RULER_H - 6, ticks=ticks,
                ruler_end=LABEL_W + BAR_W, scale_bytes=largest,
                scale_text=f"full width = {human(largest)} ({exact(largest)} B)", rows=rows,
                storages=sum(len(run) for run in runs))


def svg_model(plan: Plan) -> dict:
    """Pixel geometry of the storage maps: one per memory type, each on its own scale.

    Storages that draw alike (same size, regions at the same offsets) collapse into one bar
    labelled with their name run (``kv.{0..31}``, x32); regions are drawn to scale inside.
    """
    colors = {g.name: PALETTE[i % len(PALETTE)] for i, g in enumerate(plan.groups)}
    summary = summarize(plan)
    region_labels = {r.name: run.label for run in collapse(summary.regions) for r in run.rows}
    runs = storage_runs(plan)
    maps = [_mem_map(plan, mem, [run for run in runs if run[0].mem == mem], colors, region_labels)
            for mem in ("VRAM", "DRAM") if any(run[0].mem == mem for run in runs)]
    legend = [dict(name=g.name, kind=g.kind, color=colors[g.name]) for g in plan.groups]
    return dict(width=LABEL_W + BAR_W + 20, maps=maps, legend=legend, label_w=LABEL_W,
                min_region_px=MIN_REGION_PX, colors=colors)


def _spaced(offsets: list[int], px: float, gap: float = 56.0) -> list[int]:
    """Tick offsets at least ``gap`` pixels apart (the block's end always kept), so labels never overlap."""
    keep: list[int] = []
    for t in offsets:
        if not keep or (t - keep[-1]) * px >= gap:
            keep.append(t)
    if keep[-1] != offsets[-1]:
        if len(keep) > 1 and (offsets[-1] - keep[-1]) * px < gap:
            keep.pop()
        keep.append(offsets[-1])
    return keep


FIELD_COLORS = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#e15759", "#9c755f")
BLOCK_H = 34


def _field_note(f, w: float) -> tuple[str, ...]:
    """The lines under a field: dim order (and replicas), then what its dark runs are (if room)."""
    first = f"{f.name}: {f.order}" + (f" · x{f.replicas} ranks" if f.replicas > 1 else "")
    second = f"dark: {f.slice_what}, {f.slice_total} run{'s' if f.slice_total != 1 else ''}"
    lines = (first, second)
    return tuple(line for line in lines if len(line) * 6.6 <= max(w, 120)) or (f.name,)


def _note_anchor(f, x: float, w: float) -> dict:
    """Where the lines under a field start: at its left edge, or right-aligned if they would overflow."""
    longest = max(len(line) for line in _field_note(f, w)) * 6.6
    if x + longest <= LABEL_W + BAR_W + 10:
        return dict(note_x=x + 2, note_anchor="start")
    return dict(note_x=min(x + w, LABEL_W + BAR_W), note_anchor="end")


NOTE_H = 30         # one row of field notes (two text lines)


def _stack_notes(fields: list[dict]) -> int:
    """Give each field's notes a row so that no two notes overlap; returns the rows used."""
    ends: list[float] = []          # per row: right edge of the last note placed
    for f in fields:
        width = max(len(line) for line in f["note"]) * 6.6
        left = f["note_x"] - (width if f["note_anchor"] == "end" else 0)
        row = next((k for k, e in enumerate(ends) if left >= e + 10), len(ends))
        if row == len(ends):
            ends.append(0.0)
        ends[row] = left + width
        f["note_row"] = row
    return max(len(ends), 1)


def block_model(plan: Plan) -> list[dict]:
    """Pixel geometry of one block per layout: fields to scale, the first slice's runs darker."""
    out = []
    for m in block_maps(plan):
        px = BAR_W / m.block_bytes
        fields = []
        for i, f in enumerate(m.fields):
            x, w = LABEL_W + f.offset * px, max(MIN_REGION_PX, f.extent * px)
            runs = [dict(x=LABEL_W + a * px, w=max(1.0, n * px), start=a, length=n) for a, n in f.slice_runs]
            title = "\n".join((
                f"field {f.name} ({f.dtype}) at byte {exact(f.offset)}, {exact(f.extent)} B",
                f"dims outermost first: {f.shape}",
                f"darker: {f.slice_what}, {f.slice_total} run(s)"
                + (f" (first {len(f.slice_runs)} drawn)" if f.slice_total > len(f.slice_runs) else ""),
                f"held by {f.replicas} rank(s) of the engine" if f.replicas > 1 else "sharded: each rank its own"))
            fields.append(dict(name=f.name, x=x, w=w, color=FIELD_COLORS[i % len(FIELD_COLORS)], runs=runs,
                               offset=f.offset, extent=f.extent, order=f.order, shape=f.shape, dtype=f.dtype,
                               replicas=f.replicas, slice_what=f.slice_what, slice_total=f.slice_total,
                               label=f.name if len(f.name) * 7 + 6 <= w else "", title=title,
                               note=_field_note(f, w), **_note_anchor(f, x, w)))
        rows = _stack_notes(fields)
        ticks = _spaced(sorted({0, m.block_bytes} | {f.offset for f in m.fields}), px)
        out.append(dict(regions=m.regions, count=m.count, block_bytes=m.block_bytes, tokens=m.tokens,
                        width=LABEL_W + BAR_W + 20, height=BLOCK_H + 36 + NOTE_H * rows, y=8, h=BLOCK_H,
                        fields=fields,
                        bar_w=BAR_W, label_w=LABEL_W,
                        ticks=[dict(x=LABEL_W + t * px, label=exact(t)) for t in ticks]))
    return out


def _fieldwrap(cell: str):
    """One ``<span>`` per field, breakable only after a comma (``<wbr>``), every character escaped."""
    from markupsafe import Markup, escape
    return Markup("").join(Markup("<span>") + Markup(",<wbr>").join(escape(p) for p in f.split(","))
                           + Markup("</span>") for f in cell.split(" "))


def environment():
    """The jinja2 environment of explain's HTML pages: kvlc/templates/, autoescaped, strict, its filters."""
    import jinja2
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(Path(__file__).parent.parent / "templates")),
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
    return environment().get_template("explain.html.j2").render(
        s=s, svg=svg_model(plan), blocks=block_model(plan), tables=short, full_tables=longer)

