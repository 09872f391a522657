"""Check, part 3 — aliased page pools: regions that lie over the same pages on purpose.

vLLM's hybrid allocator gives attention layers and Mamba / linear-attention layers one page
pool: page ``i`` of a layer's tensor is an attention block for one request and a state for
another. A region declares that with ``aliases: [other regions]``. A declared alias must lie
page for page over the other region (same storage, offset, page size and page count, each
block inside its page) and serve other groups; every overlap that is not declared stays an
error (:func:`kvlc.compiler.plan.check.check_overlaps`). A page is one logical block of the
region's group: where the attention kernel block is smaller than the page (``m`` kernel blocks
per block), the region's ``m`` consecutive kernel blocks of ``block_stride`` bytes make one page.
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


def _page_props(r, split: bool) -> list[tuple[str, int, str]]:
    """(property, value, text) of where ``r``'s pages lie; ``split``: compare whole pages (one logical
    block: ``kernel_blocks_per_block`` kernel blocks of ``block_stride`` bytes) instead of blocks."""
    if not split:
        return [(w, getattr(r, w), str(getattr(r, w))) for w in ("storage", "offset", "block_stride", "num_blocks")]
    m = r.kernel_blocks_per_block
    per = f" ({m} kernel blocks per page)" if m > 1 else ""
    return [("storage", r.storage, r.storage), ("offset", r.offset, str(r.offset)),
            ("page size", r.block_stride * m, f"{r.block_stride * m} bytes{per}"),
            ("page count", r.num_blocks // m, f"{r.num_blocks // m} pages{per}")]


def _page_mismatch(a, b) -> tuple[str, str, str] | None:
    """(what, a's value, b's value) of the first page-pool property two regions do not share."""
    split = a.kernel_blocks_per_block > 1 or b.kernel_blocks_per_block > 1
    for (what, x, tx), (_, y, ty) in zip(_page_props(a, split), _page_props(b, split)):
        if x != y:
            return what, tx, ty
    return None


def _page_fix(a, b) -> str:
    if a.kernel_blocks_per_block == b.kernel_blocks_per_block == 1:
        return ("give both regions one storage, offset, block_stride and num_blocks (set block_stride to the "
                "page size), or drop the alias")
    return ("give both regions one storage and offset and the same pages: a region of kernel blocks has "
            "block_stride = page size / kernel blocks per page and num_blocks = pages x kernel blocks per page; "
            "or drop the alias")


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
                                   fix=_page_fix(r, o)))
                continue
            shared = sorted(set(r.groups) & set(o.groups))
            if shared or name in r.aliases[:ai]:
                out.append(Problem(path, f"region '{r.name}' aliases region '{name}', and both serve group "
                                   f"'{shared[0]}'", expected="aliased regions of different groups",
                                   found=f"groups {list(r.groups)} and {list(o.groups)}",
                                   fix="alias regions of different groups only (one page holds one group's block)"))
    return out
