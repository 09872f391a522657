"""Collapsing names that differ by a number: ``layer.0`` … ``layer.31`` → ``layer.{0..31}``.

One mechanism for every place kvlc shows many near-identical things: the explain tables'
per-layer runs and the problems a ``repeat`` multiplies (:meth:`kvlc.errors.SpecError.render`).
"""

from __future__ import annotations

import re
from typing import Iterable, Sequence


def compact_ints(values: Iterable[int]) -> str:
    """A short text for a set of integers: ranges ``a..b``, steps ``a,b,..,z``.

    >>> compact_ints(range(32)), compact_ints(range(1, 36, 2)), compact_ints([0, 1, 2, 3, 8, 9, 11])
    ('0..31', '1,3,..,35', '0..3,8,9,11')
    """
    vs = sorted(set(values))
    if len(vs) >= 3:
        step = vs[1] - vs[0]
        if all(b - a == step for a, b in zip(vs, vs[1:])):
            if step == 1:
                return f"{vs[0]}..{vs[-1]}"
            if len(vs) >= 4:
                return f"{vs[0]},{vs[1]},..,{vs[-1]}"
    parts, i = [], 0
    while i < len(vs):
        j = i
        while j + 1 < len(vs) and vs[j + 1] == vs[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{vs[i]}..{vs[j]}")
        else:
            parts.extend(str(v) for v in vs[i:j + 1])
        i = j + 1
    return ",".join(parts)


_NUM = re.compile(r"\d+")


def split_name(name: str) -> tuple[str, tuple[int, ...]]:
    """``layer.7.k`` → (``layer.{}.k``, (7,)): the name's skeleton and its numbers."""
    skeleton = _NUM.sub("{}", name.replace("{", "{{").replace("}", "}}"))
    return skeleton, tuple(int(n) for n in _NUM.findall(name))


def vary_label(names: Sequence[str]) -> str:
    """One label for names that share a skeleton: varying numbers become ``{a..b}``.

    Numbers that do not vary keep their digits as written (``4,096`` stays ``4,096``).

    >>> vary_label(["layer.0.k", "layer.1.k", "layer.2.k"]), vary_label(["a.07", "b.07"])
    ('layer.{0..2}.k', '2 names')
    """
    if len(set(names)) == 1:
        return names[0]
    skels = {split_name(n)[0] for n in names}
    if len(skels) != 1:
        return f"{len(set(names))} names"
    skel = skels.pop()
    raw = [_NUM.findall(n) for n in names]
    parts = []
    for i in range(len(raw[0])):
        col = [t[i] for t in raw]
        parts.append(col[0] if len(set(col)) == 1 else "{" + set_text([int(v) for v in col]) + "}")
    return skel.format(*parts)


def _by_skeleton(texts: Iterable[str]) -> list[list[str]]:
    """The distinct texts grouped by their skeleton (numbers taken out), in order of first appearance."""
    groups: dict[str, list[str]] = {}
    for text in dict.fromkeys(texts):
        groups.setdefault(split_name(text)[0], []).append(text)
    return list(groups.values())


def compact_names(names: Iterable[str], least: int = 3) -> list[str]:
    """Names in order, those of one skeleton (``least`` or more) as one label.

    >>> compact_names(["kv.0", "kv.1", "kv.2", "kv.3", "indexer"])
    ['kv.{0..3}', 'indexer']
    """
    out = []
    for members in _by_skeleton(names):
        out.extend([vary_label(members)] if len(members) >= least else members)
    return out


def collapse_lines(lines: Iterable[str], least: int = 2) -> list[str]:
    """Lines in order of first appearance, those that differ only by numbers as one line with a count.

    This is how a report repeated once per layer reads as one finding.

    >>> collapse_lines([f"error [region-missing] layer.{i}: absent on the remote" for i in range(32, 80)]
    ...                + ["warning [x] other"])
    ['error [region-missing] layer.{32..79}: absent on the remote (48 alike)', 'warning [x] other']
    """
    out = []
    for members in _by_skeleton(lines):
        if len(members) >= least:
            out.append(f"{vary_label(members)} ({len(members)} alike)")
        else:
            out.extend(members)
    return out


MAX_SET_TEXT = 24


def set_text(values: Sequence[int]) -> str:
    """:func:`compact_ints`, or ``N in a..b`` when that would be longer than :data:`MAX_SET_TEXT`.

    >>> set_text([0, 1, 2, 3]), set_text([v for v in range(52) if v % 6 != 5])
    ('0..3', '44 in 0..51')
    """
    text = compact_ints(values)
    if len(text) <= MAX_SET_TEXT:
        return text
    return f"{len(set(values))} in {min(values)}..{max(values)}"
