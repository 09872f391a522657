"""Check, part 4 — split regions: the parts of one region held in several runs of blocks.

vLLM keeps K and V of a layer in one tensor on some backends (a block holds both) and in two
on others (``key_cache`` / ``value_cache``, or one ``(2, num_blocks, ...)`` tensor whose halves
are two runs of blocks). A region says that its fields are part of another region with
``part_of: NAME``; the regions of one name (``part_of``, or their own name) hold its fields
together, and pairing matches a field by that name and its own. So the parts of one region
must hold each field once, serve the same groups (one block id addresses a block in each part)
and be optional alike.
"""

from __future__ import annotations

from kvlc.errors import Problem


def _nested(rr, by_name: dict) -> Problem | None:
    """``part_of`` names a region that is itself a part of another: a field would have two names."""
    r = rr.region
    other = by_name.get(r.part_of)
    if other is None or not other.region.part_of or other is rr:
        return None
    o = other.region
    return Problem(rr.path + ("part_of",), f"region '{r.name}' is part of region '{o.name}', which is itself "
                   f"part of '{o.part_of}'", expected="the name of a whole region (one without part_of)",
                   found=f"part_of: {r.part_of}", fix=f"write part_of: {o.part_of}")


def _against(rr, first, held: dict) -> list[Problem]:
    """A later part ``rr`` of a region against its first part ``first`` and the fields held so far."""
    r, f0 = rr.region, first.region
    whole = r.content
    if r.groups != f0.groups:
        return [Problem(rr.path + ("groups",), f"region '{r.name}' is part of '{whole}' like region '{f0.name}' "
                        "but serves other groups", expected=f"groups {list(f0.groups)} (as region '{f0.name}')",
                        found=f"groups {list(r.groups)}", fix="give every part of one region the same groups: "
                        "one block id addresses a block in each part")]
    if r.optional != f0.optional:
        return [Problem(rr.path + ("optional",), f"region '{r.name}' is part of '{whole}' like region "
                        f"'{f0.name}' but is optional otherwise", expected=f"optional: {str(f0.optional).lower()} "
                        f"(as region '{f0.name}')", found=f"optional: {str(r.optional).lower()}",
                        fix="mark every part of one region optional, or none")]
    out = []
    for f in r.fields:
        if f.name in held:
            out.append(Problem(rr.path + ("layout",), f"region '{r.name}' holds field '{f.name}' of '{whole}', "
                               f"which region '{held[f.name]}' holds already",
                               expected=f"each field of '{whole}' in one of its parts", found=f"field '{f.name}' "
                               f"in regions '{held[f.name]}' and '{r.name}'",
                               fix="hold each field in one part (or rename one: fields pair by name)"))
    return out


def check_parts(res) -> list[Problem]:
    """The parts of one region hold each field once, serve the same groups and are optional alike.

    >>> from kvlc.compiler import load_spec
    >>> from kvlc.compiler.plan.expand import expand
    >>> from kvlc.compiler.plan.resolve import resolve
    >>> check_parts(resolve(expand(load_spec("layouts/llama-3.1-8b-split.yaml"))))
    []
    """
    by_name: dict = {}
    first: dict = {}
    held: dict[str, dict[str, str]] = {}
    out = []
    for rr in res.regions:
        by_name.setdefault(rr.region.name, rr)
    for rr in res.regions:
        r = rr.region
        if by_name[r.name] is not rr:
            continue  # a duplicate name (check_names says so), not a part
        nested = _nested(rr, by_name) if r.part_of else None
        if nested is not None:
            out.append(nested)
            continue
        fields = held.setdefault(r.content, {})
        if r.content in first:
            found = _against(rr, first[r.content], fields)
            out.extend(found)
            if found:
                continue
        first.setdefault(r.content, rr)
        fields.update((f.name, r.name) for f in r.fields)
    return out
