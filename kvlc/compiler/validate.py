"""Stage 1 — validate: plain data with marks → :class:`LayoutSpec`, every problem located."""

from __future__ import annotations

from pydantic import ValidationError

from kvlc.compiler.source import Source
from kvlc.compiler.spec import LayoutSpec
from kvlc.errors import Problem, SpecError


def _data_path(data, loc: tuple) -> tuple:
    """Map a pydantic ``loc`` onto a path in the data, dropping union tags it inserted."""
    path: list = []
    node = data
    for part in loc:
        if isinstance(node, dict) and part in node:
            path.append(part)
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            path.append(part)
            node = node[part]
        elif isinstance(part, str) and ("[" in part or part in ("item", "repeat", "array", "sections")
                                        or not isinstance(node, (dict, list))):
            continue  # a union tag or a constraint name, not a place in the file
        elif isinstance(node, dict):
            path.append(part)  # a missing key: point at the mapping, name the key
            node = None
        else:
            continue
    return tuple(path)


def _describe(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _problem(err: dict, source: Source) -> Problem:
    loc = tuple(err.get("loc", ()))
    path = _data_path(source.data, loc)
    kind = err.get("type", "")
    msg = err.get("msg", "invalid value")
    found = None if kind == "missing" else _describe(err.get("input"))
    expected = None
    fix = None
    if kind == "missing":
        msg = f"missing required key '{loc[-1]}'" if loc else "missing value"
        found = "nothing"
        fix = f"add '{loc[-1]}:'" if loc else None
    elif kind == "extra_forbidden":
        msg = f"unknown key '{loc[-1]}'"
        expected = "one of the keys this object defines"
        fix = "remove it or check its spelling"
    elif kind == "literal_error":
        expected = err.get("ctx", {}).get("expected")
        msg = "value not allowed"
    elif kind in ("union_tag_invalid",):
        ctx = err.get("ctx", {})
        msg = f"unknown kind {ctx.get('tag')!r}"
        expected = f"kind one of {ctx.get('expected_tags')}"
        found = repr(ctx.get('tag'))
    elif kind.startswith("value_error"):
        msg = msg.removeprefix("Value error, ")
    return Problem(path, msg, expected=expected, found=found, fix=fix, mark=source.mark(path))


def validate(source: Source) -> LayoutSpec:
    """Validate loaded data into a frozen :class:`LayoutSpec` or raise :class:`SpecError`."""
    if not isinstance(source.data, dict):
        raise SpecError([Problem((), "a spec is a mapping", expected="keys like 'kvlc: 1'",
                                 found=type(source.data).__name__, mark=source.mark(()))])
    if source.data.get("kvlc") != 1:
        raise SpecError([Problem(("kvlc",), "unsupported or missing spec version",
                                 expected="kvlc: 1", found=_describe(source.data.get("kvlc")),
                                 fix="start the file with 'kvlc: 1'", mark=source.mark(("kvlc",)))])
    try:
        return LayoutSpec.model_validate(source.data)
    except ValidationError as exc:
        problems = [_problem(e, source) for e in exc.errors(include_url=False)]
        problems.sort(key=lambda p: (p.mark.line, p.mark.col) if p.mark else (0, 0))
        raise SpecError(problems) from None
