"""Tables on a terminal that never cut a number: wrap columns into several tables, or go vertical.

A cell is made of *atoms* that are never split: a numeric cell is one atom; a text cell breaks
only after a space or a comma (``k@0:bf16[token=16,head=8/8,head_dim=128]`` breaks after its
commas, never inside ``128``). For a width ``W``:

1. the whole table at its natural width if that fits (or if ``W`` is None: piped output with no
   ``COLUMNS``, where nothing has to fit);
2. else the columns are split into several tables that each fit, every one repeating the first
   (key) column, text columns narrowed to their longest atom at the least;
3. else (the key column and one other do not fit side by side) one block per row, a
   ``column  value`` line each.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

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


_BREAK = re.compile(r"(?<=[ ,])")
_HEAD_BREAK = re.compile(r"(?<=[ /])")
_WORD = re.compile(r"(?<= )")
UNLIMITED = 1 << 16   # a console width for output nobody reads at a fixed width


def terminal_width() -> int | None:
    """The width tables must fit: ``$COLUMNS`` if set, the terminal's if stdout is one, else None."""
    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    if sys.stdout.isatty():
        return shutil.get_terminal_size().columns
    return None


def console(width: int | None = None) -> "Console":
    """A rich console for kvlc's tables: ``width`` or :func:`terminal_width`, no highlighting."""
    from rich.console import Console
    w = width if width is not None else terminal_width()
    return Console(width=w or UNLIMITED, highlight=False, soft_wrap=False)


def atoms(text: str, numeric: bool) -> list[str]:
    """The unbreakable pieces of a cell (a numeric cell is one piece).

    >>> atoms("k@0:bf16[token=16,head=8] v@4096:bf16[x=2]", False)
    ['k@0:bf16[token=16,', 'head=8] ', 'v@4096:bf16[x=2]']
    >>> atoms("8 GiB (8,589,934,592)", True)
    ['8 GiB (8,589,934,592)']
    """
    if numeric or not text:
        return [text]
    return [a for a in _BREAK.split(text) if a]


def wrap(text: str, width: int, numeric: bool = False, pattern: re.Pattern = _BREAK) -> str:
    """``text`` as lines of at most ``width`` characters, broken only between atoms.

    >>> print(wrap("k@0:bf16[token=16,head=8/8,head_dim=128]", 20))
    k@0:bf16[token=16,
    head=8/8,
    head_dim=128]
    """
    if numeric or len(text) <= width:
        return text
    lines, line = [], ""
    for a in (x for x in pattern.split(text) if x):
        if line and len(line) + len(a.rstrip()) > width:
            lines.append(line.rstrip())
            line = ""
        line += a
    lines.append(line.rstrip())
    return "\n".join(lines)


@dataclass(frozen=True)
class _Col:
    header: str
    numeric: bool
    least: int      # the longest atom (cells) or word (header)
    natural: int    # the longest cell or header


def _columns(t: TableData) -> list[_Col]:
    cells = list(t.rows) + ([t.footer] if t.footer else [])
    out = []
    for i, (h, num) in enumerate(zip(t.columns, t.numeric)):
        col = [row[i] for row in cells]
        least = max([len(a.rstrip()) for c in col for a in atoms(c, num)]
                    + [len(w.rstrip()) for w in _HEAD_BREAK.split(h) if w])
        natural = max([len(c) for c in col] + [len(h)])
        out.append(_Col(h, num, least, natural))
    return out


def _overhead(n: int) -> int:
    return 3 * n + 1     # rich's default box: a border between columns and one space of padding each side


def fit(t: TableData, width: int | None) -> list[list[tuple[int, int]]] | None:
    """Column chunks ``[(column index, width), ...]`` that fit ``width``, or None (go vertical).

    >>> t = TableData("t", ("name", "bytes", "more"), (False, True, True), (("a", "1,024", "2,048"),))
    >>> fit(t, None), fit(t, 19)
    ([[(0, 4), (1, 5), (2, 5)]], [[(0, 4), (1, 5)], [(0, 4), (2, 5)]])
    >>> fit(t, 10) is None
    True
    """
    cols = _columns(t)
    if width is None or sum(c.natural for c in cols) + _overhead(len(cols)) <= width:
        return [[(i, c.natural) for i, c in enumerate(cols)]]
    chunks = _chunks(cols, width)
    if chunks is None:
        return None
    return [_widen(cols, chunk, width) for chunk in chunks or [[0]]]


def _chunks(cols: list[_Col], width: int) -> list[list[int]] | None:
    """Columns at their least widths in chunks of ``width``, each led by column 0; None if one cannot fit."""
    chunks: list[list[int]] = []
    for i in range(1, len(cols)):
        cur = chunks[-1] if chunks else None
        if cur is not None and sum(cols[j].least for j in cur + [i]) + _overhead(len(cur) + 1) <= width:
            cur.append(i)
        elif cols[0].least + cols[i].least + _overhead(2) <= width:
            chunks.append([0, i])
        else:
            return None
    return chunks


def _widen(cols: list[_Col], chunk: list[int], width: int) -> list[tuple[int, int]]:
    """The widths of one chunk's columns: the least, then what is left to ``width``, text columns first."""
    widths = {j: cols[j].least for j in chunk}
    spare = width - sum(widths.values()) - _overhead(len(chunk))
    for j in sorted(chunk, key=lambda j: cols[j].numeric):   # text columns get the room first
        grow = min(spare, cols[j].natural - widths[j])
        widths[j] += grow
        spare -= grow
    return [(j, widths[j]) for j in chunk]


def print_line(con: "Console", text: str, style: str = "") -> None:
    """Print ``text`` wrapped at spaces only: a word longer than the console (a digest) stays whole."""
    from rich.text import Text
    width = None if con.width >= UNLIMITED else con.width
    for line in (wrap(text, width, pattern=_WORD) if width else text).split("\n"):
        con.print(Text(line, style=style), overflow="ignore", crop=False)


def print_table(t: TableData, con: "Console", width: int | None = None) -> None:
    """Print ``t`` on ``con`` so that every number shows whole: see :func:`fit`."""
    from rich.text import Text
    w = width if width is not None else (None if con.width >= UNLIMITED else con.width)
    chunks = fit(t, w)
    if chunks is None:
        _print_vertical(t, con, w)
        return
    for k, chunk in enumerate(chunks):
        title = t.title if len(chunks) == 1 else f"{t.title} [{k + 1}/{len(chunks)}]"
        con.print(_rich_table(t, chunk, title))
    if not chunks:
        con.print(Text(t.title, style="bold"))


def _rich_table(t: TableData, chunk: Sequence[tuple[int, int]], title: str):
    from rich.table import Table
    from rich.text import Text
    table = Table(title=title, title_justify="left", title_style="bold", show_footer=t.footer is not None,
                  header_style="bold")
    def cell(text: str, i: int, w: int, pattern=_BREAK):
        num = t.numeric[i]
        return Text(wrap(text, w, num and pattern is _BREAK, pattern), justify="right" if num else "left")

    for i, w in chunk:
        table.add_column(cell(t.columns[i], i, w, _HEAD_BREAK), justify="right" if t.numeric[i] else "left",
                         footer=cell(t.footer[i], i, w) if t.footer else "", width=w,
                         no_wrap=True)
    for row in t.rows:
        table.add_row(*(cell(row[i], i, w) for i, w in chunk))
    return table


def _print_vertical(t: TableData, con: "Console", width: int) -> None:
    """One block per row: the key cell on a line, then ``column  value`` lines, values wrapped."""
    from rich.text import Text
    def out(text: str, style: str = "") -> None:     # lines are wrapped here: rich must not cut them
        con.print(Text(text, style=style), overflow="ignore", crop=False, no_wrap=True)

    out(t.title, "bold")
    key_w = max(len(c) for c in t.columns[1:])
    value_w = max(8, width - key_w - 4)
    rows = list(t.rows) + ([t.footer] if t.footer else [])
    for row in rows:
        out(row[0], "bold")
        for i in range(1, len(t.columns)):
            if not row[i]:
                continue
            lines = wrap(row[i], value_w, t.numeric[i]).split("\n")
            out(f"  {t.columns[i]:<{key_w}}  {lines[0]}")
            for line in lines[1:]:
                out(" " * (key_w + 4) + line)
