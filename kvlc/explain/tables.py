"""The tables of ``kvlc explain`` as text cells (:class:`~kvlc.explain.terminal.TableData`), and printing them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvlc.compiler.plan.model import Plan
from kvlc.explain.numbers import both, exact
from kvlc.explain.summary import GroupTotal, Summary, collapse_storages, summarize
from kvlc.explain.terminal import TableData, print_line, print_table

if TYPE_CHECKING:
    from rich.console import Console


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
                     r.tokens, groups, f"x{r.replicas}" if r.replicas > 1 else "", both(run.bytes), r.fields))
    return TableData(
        _rows_note("Regions", len(s.regions), len(runs), "per-layer runs"),
        ("region", "n", "storage", "mem", "offset", "blocks", "logical", "block B", "stride",
         "tokens/block", "groups", "replicas", "bytes (all n)", "fields"),
        (False, True, False, False, True, True, True, True, True, True, False, True, True, False),
        tuple(rows),
        ("total", str(len(s.regions)), "", "", "", "", "", "", "", "", "", "", both(s.total_bytes), ""))


def _group_table(s: Summary) -> TableData:
    return TableData(
        "Groups", ("group", "kind", "window", "block", "kernel", "regions", "logical blocks",
                   "token capacity", "bytes / block", "bytes / token", "bytes / rank"),
        (False, False, True, True, True, True, True, True, True, True, True),
        tuple((g.name, g.kind, str(g.window) if g.window else "",
               "state" if g.is_state else str(g.block_size), "" if g.is_state else str(g.kernel_block_size),
               str(g.regions), exact(g.capacity), _capacity(g), both(g.block_bytes), _per_token(g),
               both(g.bytes))
              for g in s.groups))


def _capacity(g: GroupTotal) -> str:
    """Tokens the engine's cache holds in this group; state groups hold one request per block."""
    if g.is_state:
        return f"{exact(g.capacity)} requests"
    return exact(g.engine_tokens)


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
    t = s.tp_size
    return TableData(
        "Memory types", ("mem", "devices", "storages", "size / rank", "regions", "region bytes / rank",
                         f"region bytes / engine (x{t})"),
        (False, False, True, True, True, True, True),
        tuple((m.mem, ",".join(map(str, m.devices)), str(m.storages), both(m.size), str(m.regions),
               both(m.bytes), both(m.bytes * t)) for m in s.mems),
        ("total", "", str(len(s.storages)), both(s.total_size), str(len(s.regions)), both(s.total_bytes),
         both(s.engine_bytes)))


def tables(summary: Summary, full: bool = False) -> tuple[TableData, ...]:
    """The regions, groups, storages and memory-type tables as text cells (rich and HTML draw these).

    >>> s = summarize(__import__("kvlc").compile_spec("layouts/llama-3.1-8b.yaml"))
    >>> [t.title for t in tables(s)][:2]
    ['Regions (32, per-layer runs collapsed into 1 row)', 'Groups']
    """
    return (_region_table(summary, full), _group_table(summary), _storage_table(summary, full),
            _mem_table(summary))


def header_lines(s: Summary) -> tuple[str, ...]:
    """The plan's identity (name, model, parallelism, digest) and what its numbers count."""
    ranks = f"{s.tp_size} ranks" if s.tp_size > 1 else "1 rank"
    return (f"plan {s.name}  model {s.model}  layers {s.num_layers}  tp {s.tp_size}  dcp {s.dcp_size}  "
            f"pp layers {s.layers[0]}:{s.layers[1]}",
            f"digest {s.digest}",
            f"bytes are per rank; the engine ({ranks}) holds {both(s.engine_bytes)} in regions, "
            f"{both(s.engine_size)} in storages")


def render_table(plan: Plan, console: Console, full: bool = False) -> None:
    """Print the plan's tables on a :class:`rich.console.Console`, never cutting a number.

    Tables wider than the console are split into several (or go vertical): see
    :mod:`kvlc.explain.terminal`.

    >>> from io import StringIO
    >>> from rich.console import Console
    >>> from kvlc import compile_spec
    >>> con = Console(file=StringIO(), width=200)
    >>> render_table(compile_spec("layouts/llama-3.1-8b.yaml"), con)
    >>> "layer.{0..31}" in con.file.getvalue()
    True
    """
    s = summarize(plan)
    for line in header_lines(s):
        print_line(console, line, style="bold")
    for t in tables(s, full):
        print_table(t, console)


def program_table(program, op: str, rank: int) -> TableData:
    """The program summary of ``kvlc pair``: one row per NIXL request (part) of one rank."""
    return TableData(f"program {op} rank {rank}: peers {list(program.peer_ranks)}",
                     ("part (peer: local -> remote mem)", "entries", "descriptors/tile", "bytes/tile"),
                     (False, True, True, True),
                     tuple((str(key), str(st["entries"]), exact(st["runs_per_tile"]), exact(st["bytes_per_tile"]))
                           for key, st in program.stats().items()))
