"""Stage 0 — source: YAML text (or a jinja2 template) to plain data with source marks.

The loader keeps, for every node, where it stood in the file, so that later
stages (pydantic validation, compile passes) can point at file:line:col.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from kvlc.errors import Mark, Problem, SpecError

# libyaml's parser when PyYAML has it (several times faster on long specs); its nodes carry the
# same marks. On an error the pure-Python parser runs again, for its clearer messages.
_FAST_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclass(frozen=True)
class Source:
    """Plain YAML data plus the mark of every path in it."""

    data: Any
    file: str
    marks: Mapping[tuple, Mark] = field(default_factory=dict)

    def mark(self, path: tuple) -> Mark | None:
        """The mark of ``path``, or of its nearest ancestor that has one."""
        path = tuple(path)
        while True:
            if path in self.marks:
                return self.marks[path]
            if not path:
                return None
            path = path[:-1]


def _convert(node: yaml.Node, path: tuple, file: str, marks: dict, problems: list) -> Any:
    marks[path] = Mark(file, node.start_mark.line + 1, node.start_mark.column + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                kmark = Mark(file, key_node.start_mark.line + 1, key_node.start_mark.column + 1)
                kind = "a list" if isinstance(key_node, yaml.SequenceNode) else "a mapping"
                problems.append(Problem(path, "a mapping key must be a plain scalar",
                                        expected="a name or number as key", found=kind,
                                        fix="write the key as a plain word", mark=kmark))
                continue
            key = _scalar(key_node, path, file, problems)
            if key in out:
                kmark = Mark(file, key_node.start_mark.line + 1, key_node.start_mark.column + 1)
                first = marks.get(path + (key,))
                problems.append(Problem(path + (key,), f"duplicate key '{key}'",
                                        expected="each key once",
                                        found=f"a second '{key}'" + (f" (first on line {first.line})"
                                                                     if first else ""),
                                        fix="remove or rename one of them", mark=kmark))
            out[key] = _convert(value_node, path + (key,), file, marks, problems)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_convert(v, path + (i,), file, marks, problems) for i, v in enumerate(node.value)]
    return _scalar(node, path, file, problems)


def _scalar(node: yaml.ScalarNode, path: tuple, file: str, problems: list) -> Any:
    """The Python value of a scalar node, as yaml.safe_load builds it (tags it refuses: a problem)."""
    try:
        return yaml.constructor.SafeConstructor().construct_object(node, deep=True)
    except yaml.constructor.ConstructorError:
        problems.append(Problem(path, "YAML tag not allowed", expected="a plain value",
                                found=f"tag {node.tag!r}", fix="remove the '!' tag",
                                mark=Mark(file, node.start_mark.line + 1, node.start_mark.column + 1)))
        return None


def _syntax_problem(exc: yaml.MarkedYAMLError, file: str, text: str) -> Problem:
    """A PyYAML error as a Problem: where it broke, what the parser wanted and what it met."""
    m = exc.problem_mark or exc.context_mark
    mark = Mark(file, m.line + 1, m.column + 1) if m else None
    problem = str(exc.problem or "invalid YAML")
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
    return Problem((), what, expected=expected, found=found, fix=fix, mark=mark)


def _reader_problem(exc: yaml.reader.ReaderError, file: str, text: str) -> Problem:
    """A character YAML does not allow (a control character), located by line and column."""
    pos = exc.position
    line = text.count("\n", 0, pos) + 1
    col = pos - (text.rfind("\n", 0, pos) + 1) + 1
    char = exc.character if isinstance(exc.character, int) else ord(str(exc.character)[:1] or "\0")
    return Problem((), f"YAML syntax error: {exc.reason}", expected="printable characters",
                   found=f"character #x{char:04x}", fix="remove the character",
                   mark=Mark(file, line, col))


def parse_yaml(text: str, file: str = "<string>") -> Source:
    """Parse YAML text into :class:`Source`; syntax errors become a located SpecError.

    >>> parse_yaml("a: [1, 2]").data
    {'a': [1, 2]}
    """
    try:
        node = yaml.compose(text, Loader=_FAST_LOADER)
    except yaml.YAMLError:
        try:  # parse again with the pure-Python parser: its messages say what it expected
            node = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.MarkedYAMLError as exc:
            raise SpecError([_syntax_problem(exc, file, text)]) from None
        except yaml.reader.ReaderError as exc:
            raise SpecError([_reader_problem(exc, file, text)]) from None
    if node is None:
        raise SpecError([Problem((), "empty spec", expected="a mapping with 'kvlc: 1'",
                                 found="nothing", mark=Mark(file, 1, 1))])
    marks: dict = {}
    problems: list = []
    data = _convert(node, (), file, marks, problems)
    if problems:
        raise SpecError(problems)
    return Source(data=data, file=file, marks=marks)


def parse_set(pairs: list[str] | tuple[str, ...]) -> dict:
    """Turn ``--set key=value`` pairs into a dict; values are parsed as YAML scalars.

    >>> parse_set(["tp_size=8", "name=x"])
    {'tp_size': 8, 'name': 'x'}
    """
    out: dict = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SpecError([Problem(("--set",), f"malformed --set '{pair}'",
                                     expected="KEY=VALUE", found=pair)])
        out[key.strip()] = yaml.safe_load(value) if value else ""
    return out


def render_template(path: str | Path, config: Mapping | None = None,
                    overrides: Mapping | None = None) -> str:
    """Render a ``*.yaml.j2`` template with a model ``config`` and ``--set`` overrides.

    Inside the template ``config`` is the HuggingFace-style config.json and every
    override is also a top-level variable; undefined variables are errors.
    """
    import jinja2

    path = Path(path)
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(path.parent)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    variables = {"config": dict(config or {})}
    variables.update(overrides or {})
    try:
        return env.get_template(path.name).render(**variables)
    except jinja2.TemplateSyntaxError as exc:
        raise SpecError([Problem((), f"template syntax error: {exc.message}",
                                 mark=Mark(str(path), exc.lineno or 1, 1))]) from None
    except jinja2.UndefinedError as exc:
        raise SpecError([Problem((), f"template variable undefined: {exc.message}",
                                 expected="a value from --config or --set",
                                 found="nothing", fix="pass --config config.json or --set NAME=VALUE",
                                 mark=Mark(str(path), 1, 1))]) from None


def load_config(path: str | Path) -> dict:
    """Read a HuggingFace-style config.json."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecError([Problem((), f"cannot read config: {exc}", mark=Mark(str(path), 1, 1))]) from None


def _is_file(text: str) -> bool:
    try:
        return Path(text).is_file()
    except (OSError, ValueError):  # a long one-line YAML text is no file name
        return False


def read_source(path_or_text: str | Path, config: Mapping | None = None,
                overrides: Mapping | None = None) -> Source:
    """Read a spec from a path (plain YAML or ``.j2`` template) or from YAML text."""
    text = str(path_or_text)
    if isinstance(path_or_text, Path) or ("\n" not in text and (text.endswith((".yaml", ".yml", ".j2"))
                                                               or _is_file(text))):
        path = Path(path_or_text)
        if path.suffix == ".j2":
            return parse_yaml(render_template(path, config, overrides), str(path))
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise SpecError([Problem((), f"cannot read spec: {exc.strerror}",
                                     expected="a readable YAML file", found=str(path),
                                     mark=Mark(str(path), 1, 1))]) from None
        except UnicodeDecodeError as exc:
            raw = path.read_bytes()
            line = raw.count(b"\n", 0, exc.start) + 1
            col = len(raw[raw.rfind(b"\n", 0, exc.start) + 1:exc.start].decode("utf-8", "replace")) + 1
            raise SpecError([Problem((), "spec is not UTF-8 text", expected="UTF-8 text",
                                     found=f"byte 0x{raw[exc.start]:02x}", fix="save the file as UTF-8",
                                     mark=Mark(str(path), line, col))]) from None
        return parse_yaml(text, str(path))
    return parse_yaml(str(path_or_text), "<string>")
