"""Check, part 3 — aliased page pools: regions that lie over the same pages on purpose.

vLLM's hybrid allocator gives attention layers and Mamba / linear-attention layers one page
pool: page ``i`` of a layer's tensor is an attention block for one request and a state for
another. A region declares that with ``aliases: [other regions]``. A declared alias must lie
page for page over the other region (same storage, offset, block stride and block count, each
block inside its page) and serve other groups; every overlap that is not declared stays an
error (:func:`kvlc.compiler.plan.check.check_overlaps`).
"""

from __future__ import annotations

from kvlc.compiler.plan.fields import unknown_fix
from kvlc.errors import Problem


def pools(regions) -> dict[str, str]:
    """Region name → the first region of its page pool: regions joined by declared aliases
    (transitively: two states aliasing one attention region share its pages with each other).

    >>> from types import SimpleNamespace as N
    >>> rs = [N(region=N(name=n, aliases=a)) for n, a in (("attn", ()), ("s0", ("attn",)), ("s1", ("attn",)))]
    >>> pools(rs)
    {'attn': 'attn', 's0': 'attn', 's1': 'attn'}
    """
    regions = [getattr(rr, "region", rr) for rr in regions]  # resolved or plan regions
    parent = {r.name: r.name for r in regions}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for r in regions:
        for other in r.aliases:
            if other in parent:
                a, b = sorted((find(r.name), find(other)), key=list(parent).index)
                parent[b] = a
    return {name: find(name) for name in parent}


def _page_mismatch(a, b) -> tuple[str, str, str] | None:
    """(what, a's value, b's value) of the first page-pool property two regions do not share."""
    for what in ("storage", "offset", "block_stride", "num_blocks"):
        if getattr(a, what) != getattr(b, what):
            return what, str(getattr(a, what)), str(getattr(b, what))
    return None


def check_aliases(res) -> list:
    """Declared aliases name other regions that share their pages exactly, for other groups.

    >>> from kvlc.compiler import load_spec
    >>> from kvlc.compiler.plan.expand import expand
    >>> from kvlc.compiler.plan.resolve import resolve
    >>> check_aliases(resolve(expand(load_spec("layouts/llama-3.1-8b.yaml"))))
    []
    """
    by_name = {rr.region.name: rr for rr in res.regions}
    out = []
    for rr in res.regions:
        r = rr.region
        for ai, name in enumerate(r.aliases):
            path = rr.path + ("aliases", ai)
            other = by_name.get(name)
            if name == r.name:
                out.append(Problem(path, f"region '{r.name}' aliases itself", expected="another region's name",
                                   found=repr(name), fix="name the region whose pages this one shares"))
                continue
            if other is None:
                out.append(Problem(path, f"region '{r.name}' aliases unknown region '{name}'",
                                   expected="a region of this spec", found=repr(name),
                                   fix=unknown_fix(name, sorted(by_name), "regions")))
                continue
            o = other.region
            bad = _page_mismatch(r, o)
            if bad is not None:
                what, mine, theirs = bad
                out.append(Problem(path, f"region '{r.name}' aliases region '{name}' but does not lie page for "
                                   f"page over it ({what} differs)",
                                   expected=f"{what} {theirs} (as region '{name}')", found=f"{what} {mine}",
                                   fix=f"give both regions one storage, offset, block_stride and num_blocks "
                                   f"(set block_stride to the page size), or drop the alias"))
                continue
            shared = sorted(set(r.groups) & set(o.groups))
            if shared or name in r.aliases[:ai]:
                out.append(Problem(path, f"region '{r.name}' aliases region '{name}', and both serve group "
                                   f"'{shared[0]}'", expected="aliased regions of different groups",
                                   found=f"groups {list(r.groups)} and {list(o.groups)}",
                                   fix="alias regions of different groups only (one page holds one group's block)"))
    return out
