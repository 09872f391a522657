"""Stage 0 — source: YAML text (or a jinja2 template) to plain data with source marks.

The loader keeps, for every node, where it stood in the file, so that later
stages (pydantic validation, compile passes) can point at file:line:col.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from kvlc.errors import Mark, Problem, SpecError


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
                problems.append(Problem(path, "a mapping key must be a plain scalar",
                                        found=key_node.tag, mark=kmark))
                continue
            key = _scalar(key_node)
            if key in out:
                kmark = Mark(file, key_node.start_mark.line + 1, key_node.start_mark.column + 1)
                problems.append(Problem(path + (key,), f"duplicate key '{key}'",
                                        expected="each key once", found="a second definition",
                                        fix="remove or rename one of them", mark=kmark))
            out[key] = _convert(value_node, path + (key,), file, marks, problems)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_convert(v, path + (i,), file, marks, problems) for i, v in enumerate(node.value)]
    return _scalar(node)


def _scalar(node: yaml.ScalarNode) -> Any:
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_object(node, deep=True)
    finally:
        loader.dispose()


def parse_yaml(text: str, file: str = "<string>") -> Source:
    """Parse YAML text into :class:`Source`; syntax errors become a located SpecError.

    >>> parse_yaml("a: [1, 2]").data
    {'a': [1, 2]}
    """
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        m = exc.problem_mark
        mark = Mark(file, m.line + 1, m.column + 1) if m else None
        raise SpecError([Problem((), f"YAML syntax error: {exc.problem}",
                                 expected="valid YAML", found=str(exc.context or exc.problem),
                                 mark=mark)]) from None
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


def read_source(path_or_text: str | Path, config: Mapping | None = None,
                overrides: Mapping | None = None) -> Source:
    """Read a spec from a path (plain YAML or ``.j2`` template) or from YAML text."""
    if isinstance(path_or_text, Path) or ("\n" not in str(path_or_text)
                                          and str(path_or_text).endswith((".yaml", ".yml", ".j2"))):
        path = Path(path_or_text)
        if path.suffix == ".j2":
            return parse_yaml(render_template(path, config, overrides), str(path))
        try:
            text = path.read_text()
        except OSError as exc:
            raise SpecError([Problem((), f"cannot read spec: {exc.strerror}",
                                     found=str(path), mark=Mark(str(path), 1, 1))]) from None
        return parse_yaml(text, str(path))
    return parse_yaml(str(path_or_text), "<string>")
