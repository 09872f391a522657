"""One error hierarchy for kvlc.

Every error that reaches a user is a :class:`KvlcError`. Spec problems carry
where they were found (file:line:col and the YAML path), what was expected,
what was found and, where obvious, how to fix it.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Iterable, Sequence

MAX_REPORTED = 20


@dataclass(frozen=True)
class Mark:
    """A position in a source file (1-based line and column)."""

    file: str
    line: int
    col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


def format_path(path: Sequence[object]) -> str:
    """Render a YAML path the way a reader types it: ``regions[3].fields[0].dims``."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "<root>"


def did_you_mean(name: str, choices: Iterable[str], limit: int = 3) -> str:
    """A hint naming the closest valid names, or listing them all when none is close.

    >>> did_you_mean("ful", ["full", "swa"])
    "did you mean 'full'?"
    >>> did_you_mean("x", ["full", "swa"])
    "valid names: 'full', 'swa'"
    >>> did_you_mean("x", [])
    'no names are defined'
    """
    names = sorted(set(choices))
    if not names:
        return "no names are defined"
    close = difflib.get_close_matches(str(name), names, n=limit, cutoff=0.6)
    if close:
        return "did you mean " + " or ".join(repr(c) for c in close) + "?"
    shown = ", ".join(repr(n) for n in names[:12])
    more = f" and {len(names) - 12} more" if len(names) > 12 else ""
    return f"valid names: {shown}{more}"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec, located and explained."""

    path: tuple
    what: str
    expected: str | None = None
    found: str | None = None
    fix: str | None = None
    mark: Mark | None = None

    def __str__(self) -> str:
        where = f"{self.mark}: " if self.mark else ""
        text = f"{where}{format_path(self.path)}: {self.what}"
        details = []
        if self.expected is not None:
            details.append(f"expected {self.expected}")
        if self.found is not None:
            details.append(f"found {self.found}")
        if details:
            text += " (" + ", ".join(details) + ")"
        if self.fix:
            text += f"; fix: {self.fix}"
        return text


class KvlcError(Exception):
    """Base class of every error kvlc raises on purpose."""


class SpecError(KvlcError):
    """A spec could not be loaded or validated; carries every problem found."""

    def __init__(self, problems: Iterable[Problem]):
        self.problems: tuple[Problem, ...] = tuple(problems)
        super().__init__(self.render())

    def render(self, limit: int = MAX_REPORTED) -> str:
        lines = [str(p) for p in self.problems[:limit]]
        if len(self.problems) > limit:
            lines.append(f"... and {len(self.problems) - limit} more")
        return "\n".join(lines)


class CompileError(SpecError):
    """A spec is well-typed but describes impossible memory (overlaps, bounds, sharding)."""


class CompatError(KvlcError):
    """Two plans cannot be paired; carries the full compatibility report."""

    def __init__(self, report):
        self.report = report
        super().__init__(report.render_errors())


class TransferError(KvlcError):
    """A transfer was refused or failed (bad block ids, NIXL failure, peer lost)."""
