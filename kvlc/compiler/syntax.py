"""YAML syntax errors worded for people: where it broke, what the parser wanted, and the fix.

PyYAML's messages name parser states ("expected <block end>, but found ..."); here they
become located :class:`~kvlc.errors.Problem` values, and a block whose line is indented
unlike its neighbours is called an indentation error, with the indents that would fit.
"""

from __future__ import annotations

import re

import yaml

from kvlc.errors import Mark, Problem


def syntax_problem(exc: yaml.MarkedYAMLError, file: str, text: str) -> Problem:
    """A PyYAML error as a Problem: where it broke, what the parser wanted and what it met."""
    m = exc.problem_mark or exc.context_mark
    mark = Mark(file, m.line + 1, m.column + 1) if m else None
    problem = str(exc.problem or "invalid YAML")
    indentation = _indentation_problem(problem, m, file, text)
    if indentation is not None:
        return indentation
    what = "YAML syntax error"
    if exc.context:
        what += f" {exc.context}"
        if exc.context_mark is not None and exc.context_mark is not exc.problem_mark:
            what += f" started at line {exc.context_mark.line + 1}, column {exc.context_mark.column + 1}"
    parts = re.fullmatch(r"expected (.*), but (?:found|got) (.*)", problem, flags=re.S)
    if parts:
        expected, found = parts.group(1), parts.group(2)
    elif problem.startswith("found "):
        expected, found = "valid YAML", problem.removeprefix("found ")
    else:
        what += f": {problem}"
        lines = text.splitlines()
        line = lines[m.line].strip() if m and m.line < len(lines) else ""
        expected, found = "valid YAML", repr(line) if line else "end of file"
    fix = None
    if exc.context and "flow sequence" in exc.context:
        fix = "close the '[' with ']'"
    elif exc.context and "flow mapping" in exc.context:
        fix = "close the '{' with '}'"
    elif "'\\t'" in problem:
        fix = "indent with spaces, not tabs"
    elif problem == "mapping values are not allowed here":
        fix = "quote a value that contains ': ', or put the key on its own line"
    return Problem((), what, expected=expected, found=found, fix=fix, mark=mark)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _content(line: str) -> bool:
    stripped = line.strip()
    return bool(stripped) and not stripped.startswith("#")


def _indentation_problem(problem: str, m, file: str, text: str) -> Problem | None:
    """A block-structure error whose line is indented unlike its block: say so, and by how much."""
    if m is None or not (problem == "mapping values are not allowed here"
                         or re.fullmatch(r"expected <block end>, but found .*", problem)):
        return None
    lines = text.splitlines()
    if m.line >= len(lines) or "\t" in lines[m.line][:_indent(lines[m.line]) + 1]:
        return None
    row = m.line
    while row > 0 and not _content(lines[row]):
        row -= 1
    here = _indent(lines[row])
    levels, prev_row = [], None
    for i in range(row - 1, -1, -1):  # the indents of the open blocks, innermost first
        if _content(lines[i]) and (not levels or _indent(lines[i]) < levels[-1]):
            prev_row = i if prev_row is None else prev_row
            levels.append(_indent(lines[i]))
    if prev_row is None or here in levels:
        return None
    near = min(levels, key=lambda lv: (abs(lv - here), -lv))  # a tie: the inner block
    allowed = ", ".join(str(lv) for lv in sorted(set(levels)))
    return Problem((), f"YAML indentation error: line {row + 1} is indented {here} space"
                       f"{'s' if here != 1 else ''}, unlike the block it belongs to",
                   expected=f"an indentation of {allowed} spaces (the open blocks; line {prev_row + 1} "
                            f"has {_indent(lines[prev_row])})",
                   found=f"{here} space{'s' if here != 1 else ''}",
                   fix=f"indent line {row + 1} by {near} spaces",
                   mark=Mark(file, row + 1, here + 1))


def reader_problem(exc: yaml.reader.ReaderError, file: str, text: str) -> Problem:
    """A character YAML does not allow (a control character), located by line and column."""
    pos = exc.position
    line = text.count("\n", 0, pos) + 1
    col = pos - (text.rfind("\n", 0, pos) + 1) + 1
    char = exc.character if isinstance(exc.character, int) else ord(str(exc.character)[:1] or "\0")
    return Problem((), f"YAML syntax error: {exc.reason}", expected="printable characters",
                   found=f"character #x{char:04x}", fix="remove the character",
                   mark=Mark(file, line, col))
