"""Stage 1 — validate: plain data with marks → :class:`LayoutSpec`, every problem located."""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from kvlc.compiler.spec.source import Source
from kvlc.compiler.spec.models import LayoutSpec
from kvlc.errors import Problem, SpecError, did_you_mean

NAME_RULE = "a name of letters, digits, '_', '.', '-' or '{var}', not starting with a digit"

# pydantic error type → (what, expected); expected is formatted with the error's ctx.
_KINDS: dict[str, tuple[str, str]] = {
    "int_parsing": ("wrong type", "an integer"),
    "int_type": ("wrong type", "an integer"),
    "int_from_float": ("wrong type", "an integer"),
    "string_type": ("wrong type", "a string"),
    "bool_type": ("wrong type", "true or false"),
    "bool_parsing": ("wrong type", "true or false"),
    "tuple_type": ("wrong type", "a list"),
    "list_type": ("wrong type", "a list"),
    "dict_type": ("wrong type", "a mapping"),
    "model_type": ("wrong type", "a mapping"),
    "model_attributes_type": ("wrong type", "a mapping"),
    "greater_than": ("value out of range", "an integer > {gt}"),
    "greater_than_equal": ("value out of range", "an integer >= {ge}"),
    "less_than_equal": ("value out of range", "an integer <= {le:,}"),
    "string_too_short": ("empty string", "a non-empty string"),
    "string_pattern_mismatch": ("invalid name", NAME_RULE.replace("{", "{{").replace("}", "}}")),
    "too_short": ("too few items", "at least {min_length} item(s)"),
    "too_long": ("too many items", "at most {max_length} item(s)"),
    "literal_error": ("value not allowed", "{expected}"),
}


def _unwrap(tp):
    while hasattr(tp, "__metadata__"):  # Annotated[...]
        tp = typing.get_args(tp)[0]
    return tp


def _is_union(tp) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _members(tp) -> list[tuple[Any, set]]:
    """Members of a (possibly tagged) union with the tags that select each."""
    out = []
    for arg in typing.get_args(tp):
        tags = {meta.tag for meta in getattr(arg, "__metadata__", ()) if hasattr(meta, "tag")}
        inner = _unwrap(arg)
        if isinstance(inner, type) and issubclass(inner, BaseModel) and "kind" in inner.model_fields:
            tags.update(typing.get_args(inner.model_fields["kind"].annotation))
        out.append((inner, tags))
    return out


def _field_type(model: type[BaseModel], part):
    """The annotation of ``model``'s field ``part`` (None when it has no such field)."""
    field = model.model_fields.get(part) if isinstance(part, str) else None
    return field.annotation if field else None


def _tuple_item(args: tuple, index: int):
    """The type of item ``index`` of a ``tuple[...]`` with these type arguments."""
    if len(args) == 2 and args[1] is Ellipsis:
        return args[0]
    return args[index] if index < len(args) else None


def _child(tp, part):
    """The declared type one step below ``tp`` at ``part`` (a field, an index or a dict key)."""
    tp = _unwrap(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return _field_type(tp, part)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple and isinstance(part, int):
        return _tuple_item(args, part)
    if origin is dict or (isinstance(origin, type) and issubclass(origin, Mapping)):  # dict, FrozenMap
        return args[1]
    return None


def _tag_member(union, part):
    """The member of ``union`` that the discriminator tag ``part`` selects (None when none)."""
    return next((m for m, tags in _members(union) if part in tags), None)


def _place(node, part, in_union: bool) -> tuple[bool, Any]:
    """Whether ``part`` names a place in the data below ``node``, and the data found there.

    A missing (or unknown) key of a mapping is a place too (the problem points at the mapping
    and names the key), unless the declared type is a union: then the part names a branch.
    """
    if isinstance(node, dict) and part in node:
        return True, node[part]
    if isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
        return True, node[part]
    if isinstance(node, dict) and isinstance(part, str) and not in_union:
        return True, None
    return False, None


def _walk(data, loc: tuple) -> tuple[tuple, bool, Any]:
    """Follow a pydantic ``loc`` through the data and the spec's types at once.

    Returns the path in the data, whether the last part of ``loc`` named a union branch
    (``constrained-int``, ``literal['auto']`` …) rather than a place in the file, and the
    declared type ``loc`` ends at (None when unknown). Discriminator tags that pydantic puts
    into ``loc`` (``repeat``, ``item``, ``sliding_window`` …) are recognised by the type and
    skipped, even where a tag has the same name as a key.
    """
    path: list = []
    node, tp = data, LayoutSpec
    branch = False
    for part in loc:
        here = _unwrap(tp) if tp is not None else None
        in_union = here is not None and _is_union(here)
        member = _tag_member(here, part) if in_union else None
        if member is not None:  # a discriminator tag, not a place in the file
            tp, branch = member, False
            continue
        placed, below = _place(node, part, in_union)
        if not placed:  # a union member or a constraint name
            tp, branch = None, True
            continue
        path.append(part)
        node, branch = below, False
        tp = _child(tp, part) if tp is not None else None
    return tuple(path), branch, tp


def _union_tags(tp) -> list[str]:
    tp = _unwrap(tp) if tp is not None else None
    if tp is None or not _is_union(tp):
        return []
    return [t for _, tags in _members(tp) for t in sorted(tags)]


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The spec model class that ``loc`` (a pydantic location) points into, if any."""
    tp: Any = LayoutSpec
    for part in loc:
        here = _unwrap(tp)
        if _is_union(here):  # pydantic names the member it tried by its tag
            tp = next((m for m, tags in _members(here) if part in tags), None)
        else:
            tp = _child(here, part)
        if tp is None:
            return None
    tp = _unwrap(tp)
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def _bounds(group: list) -> tuple[int, int] | None:
    """The (lowest, highest) integer that one group of annotation metadata allows, when both are set."""
    parts = [p for meta in group for p in (*getattr(meta, "metadata", ()), meta)]
    lo = next((m.ge for m in parts if hasattr(m, "ge")), None)
    lo = next((m.gt + 1 for m in parts if hasattr(m, "gt")), lo)
    hi = next((m.le for m in parts if hasattr(m, "le")), None)
    return (lo, hi) if isinstance(lo, int) and isinstance(hi, int) else None


def _int_ranges(tp, out: set) -> None:
    """Every (lowest, highest) an annotation allows its integers (pydantic keeps them as metadata)."""
    for group in ([tp], list(getattr(tp, "__metadata__", ()))):
        bounds = _bounds(group)
        if bounds is not None:
            out.add(bounds)
    for arg in typing.get_args(tp):
        _int_ranges(arg, out)


def _allowed_range(loc: tuple) -> str | None:
    """``an integer from LO to HI`` for the field at ``loc``, when its bounds are one range."""
    for cut in (1, 2):  # a field, or an item of a tuple field
        model = _model_at(loc[:-cut]) if len(loc) >= cut else None
        part = loc[-cut] if len(loc) >= cut else None
        field = model.model_fields.get(part) if model and isinstance(part, str) else None
        if field is not None:
            ranges: set = set()
            _int_ranges(field, ranges)
            _int_ranges(field.annotation, ranges)
            if len(ranges) == 1:
                lo, hi = ranges.pop()
                return f"an integer from {lo:,} to {'2**63 - 1' if hi == 2**63 - 1 else f'{hi:,}'}"
            return None
    return None


# Keys people bring from elsewhere, and what to do instead.
_KEY_HINTS = {
    ("Dim", "strides"): "write 'stride:' (one byte stride per dim, on every dim of the field), or leave it "
                        "out: byte strides then follow from the order of dims (last dim innermost)",
}


def _describe(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _close(word, choices) -> str | None:
    """The shared "did you mean" hint when a choice is close; None when it would only list them."""
    hint = did_you_mean(str(word), [str(c) for c in choices], limit=1)
    return hint if hint.startswith("did you mean") else None


def _known_kind(err: dict, loc: tuple) -> tuple[str, str, str | None]:
    """(what, expected, fix) of a pydantic error kvlc words itself (:data:`_KINDS`)."""
    kind, ctx = err["type"], err.get("ctx") or {}
    msg, template = _KINDS[kind]
    expected, fix = template.format(**ctx), None
    if kind in ("greater_than", "greater_than_equal", "less_than_equal"):
        expected = _allowed_range(loc) or expected
        fix = "use a value " + expected.removeprefix("an integer ")
    elif kind == "string_pattern_mismatch" and "var" in loc:
        expected = "an identifier: letters, digits and '_', not starting with a digit"
    elif kind == "string_pattern_mismatch" and isinstance(err.get("input"), str):
        fixed = re.sub(r"[^A-Za-z0-9_.\-{}]", "_", err["input"])
        fix = f"for example '{'_' + fixed if fixed[:1].isdigit() or fixed[:1] in '.-' else fixed}'"
    elif kind == "literal_error":
        fix = _close(err.get("input"), re.findall(r"'([^']*)'", expected))
    return msg, expected, fix


@dataclass(frozen=True)
class _Failure:
    """One pydantic error with where it points: its ``loc``, the data path and the declared type there."""

    err: dict
    loc: tuple
    path: tuple
    declared: Any
    source: Source

    @property
    def ctx(self) -> dict:
        return self.err.get("ctx") or {}


@dataclass(frozen=True)
class _Words:
    """How one problem reads: the data path it points at, what is wrong, expected, found and fix."""

    path: tuple
    what: str
    expected: str | None
    found: str | None
    fix: str | None


def _own_words(f: _Failure) -> _Words:
    """An error raised by a spec validator, with its own expected / found / fix."""
    ctx = f.ctx
    return _Words(f.path + tuple(ctx.get("at", ())), f.err.get("msg", "invalid value"),
                  ctx.get("expected"), ctx.get("found"), ctx.get("fix"))


def _missing(f: _Failure) -> _Words:
    key = f.loc[-1] if f.loc else "?"
    return _Words(f.path, f"missing required key '{key}'", f"a '{key}' key", "nothing", f"add '{key}:'")


def _unknown_key(f: _Failure) -> _Words:
    key = f.loc[-1]
    model = _model_at(f.loc[:-1])
    allowed = sorted(model.model_fields) if model else []
    expected = ("one of " + ", ".join(allowed)) if allowed else "one of the keys this object defines"
    fix = _KEY_HINTS.get((model.__name__ if model else "", key)) or _close(key, allowed) or "remove it"
    return _Words(f.path, f"unknown key '{key}'", expected, f"'{key}'", fix)


def _no_kind(f: _Failure) -> _Words:
    tags = _union_tags(f.declared)
    expected = "'kind:' " + (f"one of {', '.join(tags)}" if tags else "naming what this is")
    fix = f"add 'kind: {tags[0]}' or another kind" if tags else "add 'kind:'"
    return _Words(f.path, "missing 'kind'", expected, "no 'kind' key", fix)


def _bad_kind(f: _Failure) -> _Words:
    tags = [t.strip().strip("'") for t in str(f.ctx.get("expected_tags", "")).split(",")]
    node = f.source.data
    for part in f.path:
        node = node[part]
    path = f.path + ("kind",) if isinstance(node, dict) and "kind" in node else f.path
    tag = f.ctx.get("tag")
    return _Words(path, f"unknown kind {tag!r}", "one of " + ", ".join(tags), repr(tag), _close(tag, tags))


def _kvlc_kind(f: _Failure) -> _Words:
    """An error kind kvlc words itself (:data:`_KINDS`)."""
    msg, expected, fix = _known_kind(f.err, f.loc)
    return _Words(f.path, msg, expected, _describe(f.err.get("input")), fix)


def _pydantic_words(f: _Failure) -> _Words:
    """Any other error: pydantic's message (without its "Value error, " prefix)."""
    msg = f.err.get("msg", "invalid value")
    if f.err.get("type", "").startswith("value_error"):
        msg = msg.removeprefix("Value error, ")
    return _Words(f.path, msg, None, _describe(f.err.get("input")), None)


# pydantic error type → how kvlc words it (the kinds of _KINDS go through _kvlc_kind).
_WORDING = {
    "kvlc": _own_words,
    "missing": _missing,
    "extra_forbidden": _unknown_key,
    "union_tag_not_found": _no_kind,
    "union_tag_invalid": _bad_kind,
}


def _problem(err: dict, source: Source) -> tuple[Problem, bool]:
    """One pydantic error as a located :class:`Problem`, and whether it is one branch of a union."""
    loc = tuple(err.get("loc", ()))
    path, branch, declared = _walk(source.data, loc)
    kind = err.get("type", "")
    wording = _WORDING.get(kind) or (_kvlc_kind if kind in _KINDS else _pydantic_words)
    w = wording(_Failure(err, loc, path, declared, source))
    return Problem(w.path, w.what, expected=w.expected, found=w.found, fix=w.fix,
                   mark=source.mark(w.path)), branch


def _joined(q: Problem, p: Problem) -> Problem:
    """Two failed branches of one union at one place as one problem: 'expected A or B'."""
    expected = " or ".join(e for e in (q.expected, p.expected) if e)
    return Problem(q.path, f"invalid value for '{q.path[-1]}'" if q.path else q.what,
                   expected=expected, found=q.found, fix=q.fix, mark=q.mark)


def _merge_branches(items: list[tuple[Problem, bool]]) -> list[Problem]:
    """One problem per place: the failed branches of a union join into one 'expected A or B'."""
    out: list[Problem] = []
    where: dict[tuple, int] = {}
    for p, branch in items:
        if branch and p.path in where:
            out[where[p.path]] = _joined(out[where[p.path]], p)
            continue
        if branch:
            where[p.path] = len(out)
        out.append(p)
    deeper = {p.path[:n] for p in out for n in range(len(p.path))}
    # a union member that failed as a whole, where another member found a precise fault inside
    return [p for p in out if not (p.path in where and p.path in deeper)]


def _consequence(err: dict, data) -> bool:
    """A 'too few items' error that only repeats that some items failed (pydantic reports both)."""
    if err.get("type") != "too_short":
        return False
    node = data
    for part in _walk(data, tuple(err.get("loc", ())))[0]:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return False
    ctx = err.get("ctx") or {}
    return isinstance(node, (list, dict)) and len(node) >= ctx.get("min_length", 0)


def validate(source: Source) -> LayoutSpec:
    """Validate loaded data into a frozen :class:`LayoutSpec` or raise :class:`SpecError`."""
    if not isinstance(source.data, dict):
        found = {list: "a list", str: "a string"}.get(type(source.data), type(source.data).__name__)
        raise SpecError([Problem((), "a spec is a mapping", expected="keys like 'kvlc: 1'",
                                 found=found, mark=source.mark(()))])
    version = source.data.get("kvlc")
    if type(version) is not int or version != 1:  # not True, not 1.0
        missing = "kvlc" not in source.data
        raise SpecError([Problem(("kvlc",), "missing spec version" if missing else "unsupported spec version",
                                 expected="kvlc: 1",
                                 found="no 'kvlc' key" if missing else _describe(source.data["kvlc"]),
                                 fix="start the file with 'kvlc: 1'", mark=source.mark(("kvlc",)))])
    try:
        return LayoutSpec.model_validate(source.data)
    except ValidationError as exc:
        errors = [e for e in exc.errors(include_url=False) if not _consequence(e, source.data)]
        problems = _merge_branches([_problem(e, source) for e in errors])
        problems.sort(key=lambda p: (p.mark.line, p.mark.col) if p.mark else (0, 0))
        raise SpecError(problems) from None
