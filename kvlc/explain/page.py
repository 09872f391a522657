"""``kvlc explain --html``: a standalone page drawing a plan to scale."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from kvlc.compiler.plan import Plan, PlanRegion
from kvlc.explain.numbers import exact, human
from kvlc.explain.summary import region_row, summarize
from kvlc.explain.tables import tables


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
    return _environment().get_template("explain.html.j2").render(
        s=s, svg=svg_model(plan), tables=short, full_tables=longer)

