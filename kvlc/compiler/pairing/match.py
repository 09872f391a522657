"""Pairing, step 0 — which regions pair: fields matched by the region they belong to and their name.

A field's content is named by (region, field), where the region is the one the field belongs to:
``part_of`` where a region holds part of another's fields (K and V in two tensors), else the
region itself (:attr:`~kvlc.compiler.plan.model.PlanRegion.content`). Two engines pair a field
wherever both hold it under one such name, whichever run of blocks holds it on each side: a
split K/V engine pairs with a joint one field by field, and each (local region, remote region)
that share a field is one :class:`RegionPair`, copied on its own (its own storages, offsets and
strides on each side). Engines without ``part_of`` pair region by region, by name, as before.

Groups pair by region too (:func:`group_links`): a region in group G on one engine and group H on the
other (DeepSeek-V3's MTP layer in a group of its own on one side, in the main group on the other)
links G to H, and a request's ids for that region come from the local ids of G and the remote ids
of H. A region shared by several groups pairs only with the same groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlc.compiler.plan.model import Plan, PlanRegion


@dataclass(frozen=True)
class RegionPair:
    """A local and a remote region holding fields of one region (``content``), and the fields both hold.

    ``fields`` is empty only for two regions of one name that share no field (a ``field-set`` finding).
    """

    local: PlanRegion
    remote: PlanRegion
    fields: tuple[str, ...]   # in the local region's order

    @property
    def content(self) -> str:
        return self.local.content

    @property
    def links(self) -> tuple[tuple[str, str], ...]:
        """(local group, remote group) of each group the pair is copied in (:func:`group_links`)."""
        return group_links(self.local, self.remote)


def group_links(local: PlanRegion, remote: PlanRegion) -> tuple[tuple[str, str], ...]:
    """The (local group, remote group) pairs whose block ids address a region on each engine: each group
    with itself where both list the same groups, the one group of each side where each lists one, else none
    (a region shared by several groups on either side pairs only with the same groups: ``region-groups``).

    >>> from kvlc import compile_spec
    >>> own, main = compile_spec("layouts/deepseek-v3-tp8-mtp.yaml"), compile_spec("layouts/deepseek-v3-tp1-mtp.yaml")
    >>> group_links(own.region("layer.61"), main.region("layer.61")), group_links(own.region("layer.0"), main.region("layer.0"))
    ((('mtp', 'mla'),), (('mla', 'mla'),))
    """
    if local.groups == remote.groups:
        return tuple((g, g) for g in local.groups)
    if len(local.groups) == 1 and len(remote.groups) == 1:
        return ((local.groups[0], remote.groups[0]),)
    return ()


def link_name(local: str, remote: str) -> str:
    """The name of a group link: the group where both sides call it alike, else ``local>remote``.

    >>> link_name("mla", "mla"), link_name("mtp", "mla")
    ('mla', 'mtp>mla')
    """
    return local if local == remote else f"{local}>{remote}"


def parts(plan: Plan) -> dict[str, tuple[PlanRegion, ...]]:
    """Region name → the regions holding its fields, in plan order (one for a region that is not split).

    >>> from kvlc import compile_spec
    >>> [r.name for r in parts(compile_spec("layouts/llama-3.1-8b-split.yaml"))["layer.3"]]
    ['layer.3.k', 'layer.3.v']
    """
    out: dict[str, list[PlanRegion]] = {}
    for r in plan.regions:
        out.setdefault(r.content, []).append(r)
    return {k: tuple(v) for k, v in out.items()}


def _content_pairs(lparts: tuple[PlanRegion, ...], rparts: tuple[PlanRegion, ...]) -> list[RegionPair]:
    out = []
    for a in lparts:
        for b in rparts:
            theirs = {f.name for f in b.fields}
            shared = tuple(f.name for f in a.fields if f.name in theirs)
            if shared:
                out.append(RegionPair(a, b, shared))
    return out or [RegionPair(lparts[0], rparts[0], ())]


def region_pairs(local: Plan, remote: Plan) -> tuple[RegionPair, ...]:
    """Every (local region, remote region) that hold a field of one region, in local then remote order.

    >>> from kvlc import compile_spec
    >>> split, joint = compile_spec("layouts/llama-3.1-8b-split.yaml"), compile_spec("layouts/llama-3.1-8b.yaml")
    >>> [(p.local.name, p.remote.name, p.fields) for p in region_pairs(split, joint)[:2]]
    [('layer.0.k', 'layer.0', ('k',)), ('layer.0.v', 'layer.0', ('v',))]
    """
    lp, rp = parts(local), parts(remote)
    return tuple(pair for name, ls in lp.items() if name in rp for pair in _content_pairs(ls, rp[name]))


def fields_text(regions: tuple[PlanRegion, ...]) -> str:
    """The fields of a region's parts: ``k,v`` for one region, ``layer.0.k[k] + layer.0.v[v]`` for parts.

    >>> from kvlc import compile_spec
    >>> fields_text(parts(compile_spec("layouts/llama-3.1-8b-split.yaml"))["layer.0"])
    'layer.0.k[k] + layer.0.v[v]'
    """
    if len(regions) == 1 and not regions[0].part_of:
        return ",".join(f.name for f in regions[0].fields)
    return " + ".join(f"{r.name}[{','.join(f.name for f in r.fields)}]" for r in regions)
