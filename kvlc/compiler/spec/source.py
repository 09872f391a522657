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

from kvlc.compiler.spec.syntax import reader_problem, syntax_problem
from kvlc.compiler.spec.template import render_template
from kvlc.errors import Mark, Problem, SpecError, did_you_mean

# libyaml's parser when PyYAML has it (several times faster on long specs); its nodes carry the
# same marks. On an error the pure-Python parser runs again, for its clearer messages.
_FAST_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

MAX_SPEC_BYTES = 4 << 20   # characters of YAML (the largest shipped layout has 9 thousand)
MAX_DEPTH = 64             # nested lists / mappings (a spec needs about 10)
MAX_NODES = 200_000        # values after expanding aliases (the largest layout has about 1,000)


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


class _Limit(Exception):
    """A YAML limit hit while scanning events; carries the Problem."""

    def __init__(self, problem: Problem):
        super().__init__(problem.what)
        self.problem = problem


def _at(file: str, mark) -> Mark:
    return Mark(file, mark.line + 1, mark.column + 1)


def _scan(text: str, loader, file: str) -> None:
    """Walk the YAML events once, before anything is built: nesting depth, aliases, node count.

    Aliases are counted as what they expand to (an anchor's whole subtree), so an alias bomb
    is refused after reading its few lines, and an alias inside its own anchor is a cycle.
    PyYAML's parser keeps its own stack; nothing here recurses, so any depth is safe to scan.
    """
    open_: list[list] = []          # [anchor, expanded size so far] per open collection
    sizes: dict[str, int] = {}      # anchor -> expanded size of its finished node
    total = 0
    for event in yaml.parse(text, Loader=loader):
        if isinstance(event, yaml.CollectionEndEvent):
            _close_collection(open_, sizes)
            continue
        size = _event_size(event, open_, sizes, file)
        if size is None:
            continue
        total += size
        if total > MAX_NODES:
            raise _too_many(event, file)
        if isinstance(event, yaml.CollectionStartEvent):
            _open_collection(event, open_, file)
            continue
        if isinstance(event, yaml.ScalarEvent) and event.anchor is not None:
            sizes[event.anchor] = 1
        if open_:
            open_[-1][1] += size


def _close_collection(open_: list, sizes: dict) -> None:
    """A collection ends: its anchor (if any) records its size, which its parent adds up."""
    anchor, size = open_.pop()
    if anchor is not None:
        sizes[anchor] = size
    if open_:
        open_[-1][1] += size


def _event_size(event, open_: list, sizes: dict, file: str) -> int | None:
    """How many values an event adds (an alias: all it expands to); None for events that hold none."""
    if isinstance(event, yaml.AliasEvent):
        return _alias_size(event, open_, sizes, file)
    if isinstance(event, (yaml.ScalarEvent, yaml.CollectionStartEvent)):
        return 1
    return None


def _too_many(event, file: str) -> _Limit:
    alias = isinstance(event, yaml.AliasEvent)
    return _Limit(Problem((), "YAML aliases expand too far" if alias else "spec too large",
                          expected=f"at most {MAX_NODES:,} values after expanding aliases",
                          found=f"more than {MAX_NODES:,}" + (f" at '*{event.anchor}'" if alias else ""),
                          fix="write the spec without nested aliases (or use a template)",
                          mark=_at(file, event.start_mark)))


def _open_collection(event: yaml.CollectionStartEvent, open_: list, file: str) -> None:
    open_.append([event.anchor, 1])
    if len(open_) > MAX_DEPTH:
        raise _Limit(Problem((), "YAML nested too deeply", expected=f"at most {MAX_DEPTH} levels",
                             found=f"more than {MAX_DEPTH} nested lists or mappings",
                             fix="flatten the structure (a spec needs about 10 levels)",
                             mark=_at(file, event.start_mark)))


def _alias_size(event: yaml.AliasEvent, open_: list, sizes: dict, file: str) -> int:
    """What an alias expands to; an alias inside its own anchor (a cycle) or to no anchor is refused."""
    if any(frame[0] == event.anchor for frame in open_):
        raise _Limit(Problem((), f"recursive YAML alias '*{event.anchor}'",
                             expected="an alias to a node that is complete",
                             found=f"'*{event.anchor}' inside the node '&{event.anchor}' names",
                             fix="copy the value instead of referring to itself",
                             mark=_at(file, event.start_mark)))
    if event.anchor not in sizes:
        raise _Limit(Problem((), f"unknown YAML alias '*{event.anchor}'",
                             expected=f"an anchor '&{event.anchor}' earlier in the file",
                             found="no such anchor", fix=(did_you_mean(event.anchor, sizes) if sizes else
                                                            f"mark a value with '&{event.anchor}' before"),
                             mark=_at(file, event.start_mark)))
    return sizes[event.anchor]


def _compose(text: str, file: str) -> yaml.Node | None:
    """Scan (limits) then compose; PyYAML's pure-Python parser words the syntax errors."""
    try:
        _scan(text, _FAST_LOADER, file)
        return yaml.compose(text, Loader=_FAST_LOADER)
    except _Limit as exc:
        raise SpecError([exc.problem]) from None
    except yaml.YAMLError:
        pass
    try:  # parse again with the pure-Python parser: its messages say what it expected
        _scan(text, yaml.SafeLoader, file)
        return yaml.compose(text, Loader=yaml.SafeLoader)
    except _Limit as exc:
        raise SpecError([exc.problem]) from None
    except yaml.MarkedYAMLError as exc:
        raise SpecError([syntax_problem(exc, file, text)]) from None
    except yaml.reader.ReaderError as exc:
        raise SpecError([reader_problem(exc, file, text)]) from None
    except yaml.YAMLError as exc:
        raise SpecError([Problem((), f"YAML error: {exc}", expected="valid YAML", found="something else",
                                 mark=Mark(file, 1, 1))]) from None


def _too_large(file: str, found: str) -> SpecError:
    return SpecError([Problem((), "spec too large", expected=f"at most {MAX_SPEC_BYTES:,} characters",
                              found=found, fix="is this the right file?", mark=Mark(file, 1, 1))])


def parse_yaml(text: str, file: str = "<string>") -> Source:
    """Parse YAML text into :class:`Source`; syntax errors and limits become a located SpecError.

    Limits: :data:`MAX_SPEC_BYTES` of text, :data:`MAX_DEPTH` levels of nesting and
    :data:`MAX_NODES` values with aliases expanded (a recursive alias is refused).

    >>> parse_yaml("a: [1, 2]").data
    {'a': [1, 2]}
    """
    if len(text) > MAX_SPEC_BYTES:
        raise _too_large(file, f"{len(text):,} characters")
    node = _compose(text, file)
    if node is None:
        raise SpecError([Problem((), "empty spec", expected="a mapping with 'kvlc: 1'",
                                 found="nothing", mark=Mark(file, 1, 1))])
    marks: dict = {}
    problems: list = []
    data = _convert(node, (), file, marks, problems)
    if problems:
        raise SpecError(problems)
    return Source(data=data, file=file, marks=marks)


SET_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_set(pairs: list[str] | tuple[str, ...]) -> dict:
    """Turn ``--set key=value`` pairs into a dict; values are parsed as YAML (``8``, ``x``, ``[1, 2]``).

    >>> parse_set(["tp_size=8", "name=x"])
    {'tp_size': 8, 'name': 'x'}
    """
    out: dict = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not SET_KEY.fullmatch(key):
            raise SpecError([Problem(("--set",), f"malformed --set '{pair}'",
                                     expected="NAME=VALUE, NAME a template variable (letters, digits, '_')",
                                     found=repr(pair), fix="write it like --set tp_size=8",
                                     mark=Mark("--set", 1, 1))])
        if not value.strip():
            out[key] = ""
            continue
        try:
            out[key] = parse_yaml(value, f"--set {key}").data
        except SpecError as exc:
            raise SpecError([Problem(("--set", key), f"cannot read the value of --set {key}",
                                     expected="a YAML value: a number, a word, or a closed [list]",
                                     found=repr(value), fix=p.fix or "quote the value or close its brackets",
                                     mark=p.mark) for p in exc.problems[:1]]) from None
    return out


def rendered_name(path: str | Path) -> str:
    """How marks name the YAML a template rendered: its lines are the output's, not the template's."""
    return f"{path} (rendered)"


def _json_depth(value, limit: int) -> int:
    """Nesting depth of decoded JSON, without recursion (stops counting past ``limit``)."""
    stack, deepest = [(value, 1)], 0
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > limit:
            break
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children)
    return deepest


def load_config(path: str | Path) -> dict:
    """Read a HuggingFace-style config.json (a JSON object; size and nesting bounded)."""
    path = Path(path)
    where = Mark(str(path), 1, 1)
    try:
        if path.stat().st_size > MAX_SPEC_BYTES:
            raise SpecError([Problem((), "config too large", expected=f"at most {MAX_SPEC_BYTES:,} bytes",
                                     found=f"{path.stat().st_size:,} bytes",
                                     fix="pass the model's config.json",
                                     mark=where)])
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SpecError([Problem((), f"cannot read config: {exc.strerror}", expected="a readable config.json",
                                 found=str(path), mark=where)]) from None
    except UnicodeDecodeError as exc:
        raise SpecError([Problem((), "config is not UTF-8 text", expected="UTF-8 JSON",
                                 found=f"byte 0x{exc.object[exc.start]:02x} at byte {exc.start}",
                                 fix="save the file as UTF-8", mark=where)]) from None
    except json.JSONDecodeError as exc:
        raise SpecError([Problem((), "config is not valid JSON", expected="JSON",
                                 found=exc.msg, fix="check the JSON at this position",
                                 mark=Mark(str(path), exc.lineno, exc.colno))]) from None
    except RecursionError:
        data = None
    if data is None or _json_depth(data, MAX_DEPTH) > MAX_DEPTH:
        raise SpecError([Problem((), "config nested too deeply", expected=f"at most {MAX_DEPTH} levels",
                                 found=f"more than {MAX_DEPTH} nested objects or arrays",
                                 fix="pass the model's config.json", mark=where)])
    if not isinstance(data, dict):
        raise SpecError([Problem((), "config is not a JSON object", expected="{...} with the model's fields",
                                 found=f"a JSON {type(data).__name__}", fix="pass the model's config.json",
                                 mark=where)])
    return data


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
        if path.suffix == ".j2":  # marks count lines of the rendered text (`kvlc render` shows it)
            return parse_yaml(render_template(path, config, overrides), rendered_name(path))
        try:
            if path.stat().st_size > 4 * MAX_SPEC_BYTES:  # UTF-8: at most 4 bytes a character
                raise _too_large(str(path), f"{path.stat().st_size:,} bytes")  # refused before reading it
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
