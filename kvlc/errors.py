"""One error hierarchy for kvlc.

Every error that reaches a user is a :class:`KvlcError`. Spec problems carry
where they were found (file:line:col and the YAML path), what was expected,
what was found and, where obvious, how to fix it.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from kvlc.collapse import compact_names, split_name, vary_label

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


def type_name(t: type) -> str:
    """A type's name as an error message says it (``None`` for NoneType).

    >>> type_name(float), type_name(type(None))
    ('float', 'None')
    """
    return "None" if t is type(None) else t.__name__


def did_you_mean(name: str, choices: Iterable[str], limit: int = 3) -> str:
    """A hint naming the closest valid names, or listing them all when none is close.

    >>> did_you_mean("ful", ["full", "swa"])
    "did you mean 'full'?"
    >>> did_you_mean("x", ["full", "swa"])
    "valid names: 'full', 'swa'"
    >>> did_you_mean("x", [])
    'no names are defined'
    """
    names = sorted({str(c) for c in choices})
    if not names:
        return "no names are defined"
    word = str(name)
    close = [c for c in names if word and c.startswith(word) and len(word) >= 2][:1]
    close = close or difflib.get_close_matches(word, names, n=limit, cutoff=0.6)
    if close:
        return "did you mean " + " or ".join(repr(c) for c in close) + "?"
    labels = compact_names(names)
    shown = ", ".join(repr(n) for n in labels[:12])
    more = f" and {len(labels) - 12} more" if len(labels) > 12 else ""
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
        return where + self.body()

    def body(self) -> str:
        """The problem without its file mark: YAML path, what, expected, found and fix."""
        text = f"{format_path(self.path)}: {self.what}"
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


_NAME_LIST = re.compile(r"\[('[^'\n]*'(?:, '[^'\n]*'){3,})\]")


def _compact_lists(text: str) -> str:
    """``['kv.0', 'kv.1', ..., 'kv.31']`` in a message → ``['kv.{0..31}']``."""
    def short(m: re.Match) -> str:
        names = re.findall(r"'([^'\n]*)'", m.group(1))
        return "[" + ", ".join(f"'{n}'" for n in compact_names(names)) + "]"
    return _NAME_LIST.sub(short, text)


def collapse_problems(problems: Iterable[Problem]) -> list[str]:
    """Rendered lines, one per place: problems at one mark and path that differ only by numbers
    (one per value of a ``repeat``) become one line with ``{0..31}`` and a count.

    >>> ps = [Problem(("regions", 0), f"region 'l.{i}' names unknown storage 's.{i}'",
    ...               mark=Mark("a.yaml", 3, 5)) for i in range(32)]
    >>> print(collapse_problems(ps)[0])
    a.yaml:3:5: regions[0]: region 'l.{0..31}' names unknown storage 's.{0..31}' (32 times)
    """
    groups: dict[tuple, list[str]] = {}
    for p in problems:
        body = p.body()
        bodies = groups.setdefault((p.mark, p.path, split_name(body)[0]), [])
        if body not in bodies:
            bodies.append(body)
    lines = []
    for (mark, _, _), bodies in groups.items():
        text = _compact_lists(vary_label(bodies))
        if len(bodies) > 1:
            text += f" ({len(bodies)} times)"
        lines.append((f"{mark}: " if mark else "") + text)
    return lines


class KvlcError(Exception):
    """Base class of every error kvlc raises on purpose."""


class SpecError(KvlcError):
    """A spec could not be loaded or validated; carries every problem found."""

    def __init__(self, problems: Iterable[Problem]):
        self.problems: tuple[Problem, ...] = tuple(problems)
        super().__init__(self.render())

    def render(self, limit: int = MAX_REPORTED) -> str:
        """One line per problem; those a ``repeat`` multiplied share one (:func:`collapse_problems`)."""
        lines = collapse_problems(self.problems)
        shown = lines[:limit]
        if len(lines) > limit:
            shown.append(f"... and {len(lines) - limit} more")
        return "\n".join(shown)


class CompileError(SpecError):
    """A spec is well-typed but describes impossible memory (overlaps, bounds, sharding)."""


class CompatError(KvlcError):
    """Two plans cannot be paired; carries the full compatibility report."""

    def __init__(self, report):
        self.report = report
        super().__init__(report.render_errors())


class TransferError(KvlcError):
    """A transfer was refused or failed (bad block ids, NIXL failure, peer lost)."""


class BindingError(KvlcError):
    """A tensor cannot back the plan storage it was given for (raised by the runtime's binding and by
    the vLLM derivation, which must not need the runtime's extras to say so)."""
