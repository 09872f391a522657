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
    what = _context_words(exc)
    parts = re.fullmatch(r"expected (.*), but (?:found|got) (.*)", problem, flags=re.S)
    if parts:
        expected, found = parts.group(1), parts.group(2)
    elif problem.startswith("found "):
        expected, found = "valid YAML", problem.removeprefix("found ")
    else:
        what += f": {problem}"
        expected, found = "valid YAML", _line_at(text, m)
    return Problem((), what, expected=expected, found=found, fix=_syntax_fix(exc.context, problem),
                   mark=mark)


def _context_words(exc: yaml.MarkedYAMLError) -> str:
    """'YAML syntax error', with the construct the parser was in and where that started."""
    what = "YAML syntax error"
    if exc.context:
        what += f" {exc.context}"
        if exc.context_mark is not None and exc.context_mark is not exc.problem_mark:
            what += f" started at line {exc.context_mark.line + 1}, column {exc.context_mark.column + 1}"
    return what


def _line_at(text: str, m) -> str:
    """The stripped line at mark ``m``, quoted, or 'end of file' when there is none."""
    lines = text.splitlines()
    line = lines[m.line].strip() if m and m.line < len(lines) else ""
    return repr(line) if line else "end of file"


def _syntax_fix(context: str | None, problem: str) -> str | None:
    """How to fix the common syntax errors (an unclosed bracket, a tab, a bare ': ')."""
    if context and "flow sequence" in context:
        return "close the '[' with ']'"
    if context and "flow mapping" in context:
        return "close the '{' with '}'"
    if "'\\t'" in problem:
        return "indent with spaces, not tabs"
    if problem == "mapping values are not allowed here":
        return "quote a value that contains ': ', or put the key on its own line"
    return None


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _content(line: str) -> bool:
    stripped = line.strip()
    return bool(stripped) and not stripped.startswith("#")


def _block_error_line(problem: str, m, lines: list[str]) -> int | None:
    """The line (0-based) of a block-structure error that indentation may explain, else None.

    That is the last line with content at or above the mark, for the two errors a wrong indent
    causes, unless the mark is past the end or a tab is in the mark's indentation.
    """
    if m is None or not (problem == "mapping values are not allowed here"
                         or re.fullmatch(r"expected <block end>, but found .*", problem)):
        return None
    if m.line >= len(lines) or "\t" in lines[m.line][:_indent(lines[m.line]) + 1]:
        return None
    row = m.line
    while row > 0 and not _content(lines[row]):
        row -= 1
    return row


def _open_blocks(lines: list[str], row: int) -> tuple[list[int], int | None]:
    """The indents of the blocks open at ``row``, innermost first, and the nearest line above with content."""
    levels, prev_row = [], None
    for i in range(row - 1, -1, -1):
        if _content(lines[i]) and (not levels or _indent(lines[i]) < levels[-1]):
            prev_row = i if prev_row is None else prev_row
            levels.append(_indent(lines[i]))
    return levels, prev_row


def _indentation_problem(problem: str, m, file: str, text: str) -> Problem | None:
    """A block-structure error whose line is indented unlike its block: say so, and by how much."""
    lines = text.splitlines()
    row = _block_error_line(problem, m, lines)
    if row is None:
        return None
    here = _indent(lines[row])
    levels, prev_row = _open_blocks(lines, row)
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
