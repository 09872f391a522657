"""``kvlc size`` on a terminal: the request's blocks per group, then bytes and descriptors per rank."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvlc.explain.numbers import both, exact
from kvlc.explain.size import RequestSize
from kvlc.explain.terminal import TableData, print_line, print_table

if TYPE_CHECKING:
    from rich.console import Console


def size_tables(s: RequestSize) -> tuple[TableData, ...]:
    """The group table (blocks and bytes one rank holds) and the rank table (what each rank moves).

    >>> from kvlc import compile_spec
    >>> from kvlc.explain.size import request_size
    >>> g, r = size_tables(request_size(compile_spec("layouts/llama-3.1-8b.yaml"), 1000))
    >>> g.rows[0][:4], r.footer[2]
    (('full', 'full_attention', '1,000', '63'), '125 MiB (131,072,000)')
    """
    t = s.tp_size
    groups = TableData(
        f"Request of {s.tokens:,} tokens in {s.local}: blocks per group",
        ("group", "kind", "tokens", "blocks / rank", "regions", "bytes / rank", f"bytes / engine (x{t})"),
        (False, False, True, True, True, True, True),
        tuple((g.group, g.kind, exact(g.tokens) if g.tokens else "state", exact(g.blocks), str(g.regions),
               both(g.bytes), both(g.bytes * t)) for g in s.groups),
        ("total", "", "", "", "", both(s.rank_bytes), both(s.engine_bytes)))
    verb = "reads from" if s.direction == "READ" else "writes to"
    counted = "every rank" if len(s.ranks) == t else f"{len(s.ranks)} of {t} ranks"
    ranks = TableData(
        f"Transfer: each rank of {s.local} {verb} {s.remote} (NIXL descriptors per request)",
        ("rank", "peer ranks", "bytes moved", "descriptors (scattered ids)", "descriptors (contiguous ids)",
         "NIXL requests"),
        (False, False, True, True, True, True),
        tuple((str(r.rank), ",".join(map(str, r.peers)), both(r.bytes), exact(r.scattered), exact(r.contiguous),
               str(len(r.parts))) for r in s.ranks),
        (f"engine ({counted})", "", both(s.moved), exact(s.scattered), exact(s.contiguous),
         str(sum(len(r.parts) for r in s.ranks))))
    return groups, ranks


def render_size(s: RequestSize, con: "Console") -> None:
    """Print :func:`size_tables` without cutting a number."""
    for t in size_tables(s):
        print_table(t, con)
    print_line(con, "scattered: no two block ids adjacent (the worst case); contiguous: ids 0, 1, 2, ... on "
                    "both sides (the best case: adjacent blocks merge where the layout allows)")
