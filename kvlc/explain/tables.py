"""The tables of ``kvlc explain`` as text cells, and their terminal rendering."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvlc.compiler.plan import Plan
from kvlc.explain.numbers import both, exact
from kvlc.explain.summary import GroupTotal, Summary, collapse_storages, summarize

if TYPE_CHECKING:
    from rich.console import Console


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

