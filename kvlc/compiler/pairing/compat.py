"""Compatibility of two plans: every finding at once, with a code and both sides' values.

:func:`check_plans` never raises for a mismatch; errors block pairing, warnings
do not. Checked once, at pairing (start-up), never per request.
"""

from __future__ import annotations

from kvlc.compiler.pairing.compat_dcp import check_dcp
from kvlc.compiler.pairing.findings import CompatReport, Finding, Pairing, Severity
from kvlc.compiler.pairing.match import RegionPair, fields_text, group_links, parts, region_pairs
from kvlc.compiler.algebra.layout import tile
from kvlc.compiler.plan.model import Plan, PlanField, PlanRegion
from kvlc.compiler.pairing.pp import holds_region, layers_text, overlap
from kvlc.compiler.spec.dtypes import PACKED

def _dims_text(f: PlanField) -> str:
    return "(" + ",".join(f"{d.name}={d.global_size if d.role == 'head' else d.size}" for d in f.dims) + ")"


def head_major_order(f: PlanField) -> str:
    """The dim order that keeps a head slice contiguous: head, then token, then the rest."""
    rest = [d.name for d in f.dims if d.role not in ("head", "token")]
    head = [d.name for d in f.dims if d.role == "head"]
    tok = [d.name for d in f.dims if d.role == "token"]
    return "(" + ", ".join(head + tok + rest) + ")"


def _finding(code: str, message: str, region: str = "", field: str = "", local: str = "", remote: str = "",
             fix: str = "", severity: Severity = "error") -> Finding:
    return Finding(code, severity, message, region, field, local, remote, fix)


# ----------------------------------------------------------------------------- plan-level checks
def check_direction(p: Pairing) -> list[Finding]:
    """The direction is READ or WRITE.

    >>> from kvlc import compile_spec
    >>> plan = compile_spec("layouts/llama-3.1-8b.yaml")
    >>> [f.code for f in check_direction(Pairing(plan, plan, 0, "PUSH"))]
    ['direction']
    """
    if p.direction in ("READ", "WRITE"):
        return []
    return [_finding("direction", "direction must be READ (pull) or WRITE (push)", local=str(p.direction))]


def check_rank(p: Pairing) -> list[Finding]:
    """The local rank lies in the local engine (``tp_size * pcp_size`` ranks).

    >>> from kvlc import compile_spec
    >>> plan = compile_spec("layouts/llama-3.1-8b.yaml")
    >>> [f.code for f in check_rank(Pairing(plan, plan, 3, "READ"))]
    ['rank']
    """
    n = p.local.parallel.ranks
    if 0 <= p.local_rank < n:
        return []
    what = "TP group" if p.local.parallel.pcp_size == 1 else "engine (tp_size x pcp_size ranks)"
    return [_finding("rank", f"local rank outside the local {what}", local=str(p.local_rank),
                     fix=f"use a rank in [0, {n})")]


def check_model(p: Pairing) -> list[Finding]:
    """Same model name, layer count and model sizes on both engines.

    >>> from kvlc import compile_spec
    >>> a, b = compile_spec("layouts/llama-3.1-8b.yaml"), compile_spec("layouts/llama-3.1-70b-tp4.yaml")
    >>> [f.code for f in check_model(Pairing(a, b, 0, "READ"))]
    ['model-name', 'model-layers']
    """
    lm, rm = p.local.model, p.remote.model
    out = []
    if lm.name != rm.name:
        out.append(_finding("model-name", "different models", local=lm.name, remote=rm.name))
    if lm.num_layers != rm.num_layers:
        out.append(_finding("model-layers", "different layer counts", local=str(lm.num_layers),
                            remote=str(rm.num_layers)))
    for key in sorted(set(lm.sizes) | set(rm.sizes)):
        a, b = lm.sizes.get(key), rm.sizes.get(key)
        if a is not None and b is not None and a != b:
            out.append(_finding("model-size", f"model size '{key}' differs", local=str(a), remote=str(b)))
    return out


def check_pp_layers(p: Pairing) -> list[Finding]:
    """Pipeline stages pair the layers both hold; none in common is an error, a part is a warning.

    >>> from kvlc import compile_spec
    >>> plan = compile_spec("layouts/llama-3.1-8b.yaml")
    >>> check_pp_layers(Pairing(plan, plan, 0, "READ"))
    []
    """
    a, b = p.local.parallel.layers, p.remote.parallel.layers
    if a == b:
        return []
    both = overlap(p.local, p.remote)
    held = dict(local=f"layers {layers_text(a)}", remote=f"layers {layers_text(b)}")
    if both is None:
        return [_finding("pp-layers", "engines hold no layer in common", **held,
                         fix="pair each pipeline stage with the stages holding its layers")]
    cons = p.local if p.direction == "READ" else p.remote
    lacking = [w for w in (((cons.parallel.layers[0], both[0])), (both[1], cons.parallel.layers[1])) if w[0] < w[1]]
    rest = ("; the consumer gets layers " + " and ".join(layers_text(w) for w in lacking)
            + " from the producer's other pipeline stages") if lacking else ""
    return [_finding("pp-partial", f"pairs layers {layers_text(both)} only, the layers both engines hold{rest}",
                     **held, fix="pair the consumer with every producer stage (kvlc.compiler.pairing.pp.coverage)"
                     if lacking else "", severity="warning")]


def linked_groups(p: Pairing) -> dict[tuple[str, str], tuple[str, ...]]:
    """(local group, remote group) → the regions both engines hold whose ids come from those groups, in
    local order (:func:`~kvlc.compiler.pairing.match.group_links`); groups of one name on both engines are
    a link even where no region joins them.

    >>> from kvlc import compile_spec
    >>> own, main = compile_spec("layouts/deepseek-v3-tp8-mtp.yaml"), compile_spec("layouts/deepseek-v3-tp1-mtp.yaml")
    >>> {k: len(v) for k, v in linked_groups(Pairing(main, own, 0, "READ")).items()}
    {('mla', 'mla'): 61, ('mla', 'mtp'): 1}
    """
    rnames = {g.name for g in p.remote.groups}
    out: dict[tuple[str, str], dict[str, None]] = {(g.name, g.name): {} for g in p.local.groups
                                                    if g.name in rnames}
    for rp in region_pairs(p.local, p.remote):
        for link in rp.links:
            out.setdefault(link, {})[rp.content] = None
    return {k: tuple(v) for k, v in out.items()}


def _group_text(plan: Plan, name: str) -> str:
    g = plan.group(name)
    return f"{plan.name} group '{name}' {g.kind}" + (f" window={g.window}" if g.window else "")


def _regions_text(regions: tuple[str, ...]) -> str:
    return regions[0] + (f" (and {len(regions) - 1} more)" if len(regions) > 1 else "")


def _window_of_consumer(p: Pairing, a, b) -> bool:
    """The consumer's group is a sliding window and the producer's holds every token: the window moves."""
    cons, prod = (a, b) if p.direction == "READ" else (b, a)
    return cons.kind == "sliding_window" and prod.kind == "full_attention"


def _kind_mismatch(p: Pairing, a, b) -> tuple[str, str]:
    """Why a local group ``a`` and a remote group ``b`` hold no common bytes, and the fix."""
    prod = b if p.direction == "READ" else a
    if a.is_state != b.is_state:
        return ("per-request state on one engine and a per-token cache on the other never hold the same bytes",
                "pair a state region with the same layer's state region (a group of one state kind on both)")
    if a.kind == b.kind == "sliding_window":
        return (f"the groups keep sliding windows of {a.window} and {b.window} tokens",
                "use the model's window on both engines")
    if prod.kind == "sliding_window" and "full_attention" in (a.kind, b.kind):
        return ("the producer keeps only a sliding window of tokens and the consumer needs every token",
                "keep the region in a full-attention group on the producer too, or in a sliding-window group "
                "on the consumer")
    return (f"a {a.kind} group and a {b.kind} group hold different caches",
            "put the region in groups of one kind on both engines")


def _link_findings(p: Pairing, link: tuple[str, str], regions: tuple[str, ...]) -> list[Finding]:
    """One group link: the same kind and window (or a consumer's window of a producer's full cache), and
    the same tokens per entry."""
    (ln, rn), a, b = link, p.local.group(link[0]), p.remote.group(link[1])
    same = ln == rn
    where = "" if same else f"region {_regions_text(regions)} is in group '{ln}' of {p.local.name} and in " \
        f"group '{rn}' of {p.remote.name}: "
    values = (dict(local=f"{a.kind} window={a.window}", remote=f"{b.kind} window={b.window}") if same
              else dict(local=_group_text(p.local, ln), remote=_group_text(p.remote, rn)))
    region = regions[0] if regions and not same else ""
    if (a.kind, a.window) != (b.kind, b.window) and not _window_of_consumer(p, a, b):
        why, fix = _kind_mismatch(p, a, b)
        return [_finding("group-kind", f"group '{ln}' differs in kind: {why}" if same else where + why, region,
                         **values, fix=fix)]
    if a.tokens_per_entry != b.tokens_per_entry:  # a compressed cache: entries of k tokens each
        subject = f"group '{ln}' compresses" if same else where + "the groups compress"
        return [_finding("tokens-per-entry", subject + " tokens differently: one entry covers another number of "
                         "tokens on each engine, so no entry holds the other's content", region,
                         local=f"tokens_per_entry {a.tokens_per_entry}",
                         remote=f"tokens_per_entry {b.tokens_per_entry}",
                         fix="use the model's compression ratio as tokens_per_entry on both engines")]
    return []


def check_groups(p: Pairing) -> list[Finding]:
    """Groups pair by the regions they hold (:func:`linked_groups`): each (local group, remote group) that a
    region links has the same kind, window and tokens per entry, except that a consumer's sliding window
    takes its tokens from a producer's full cache; a group of one engine that no region links to a group
    of the other, and that the other does not name, is ``group-missing``.

    >>> from kvlc import compile_spec
    >>> own, main = compile_spec("layouts/deepseek-v3-tp8-mtp.yaml"), compile_spec("layouts/deepseek-v3-tp1-mtp.yaml")
    >>> check_groups(Pairing(main, own, 0, "READ"))   # layer.61: group mla here, mtp there
    []
    >>> gemma = compile_spec("layouts/gemma-3-27b-tp2-b16.yaml")    # layer.0: a sliding window there
    >>> [(f.code, f.region, f.local, f.remote) for f in check_groups(Pairing(main, gemma, 0, "READ"))]
    [('group-kind', 'layer.0', "deepseek-v3-tp1-mtp group 'mla' full_attention", "gemma-3-27b-tp2-b16 group 'local' sliding_window window=1024")]
    """
    lg = {g.name for g in p.local.groups}
    rg = {g.name for g in p.remote.groups}
    links = linked_groups(p)
    linked = ({ln for ln, _ in links}, {rn for _, rn in links})
    out = []
    for name in sorted(lg ^ rg):
        a, b = name in lg, name in rg
        if name not in (linked[0] if a else linked[1]):
            out.append(_finding("group-missing", f"group '{name}' exists on one engine only",
                                local="present" if a else "absent", remote="present" if b else "absent",
                                fix="declare it on both engines, or put its regions in groups of the other engine"))
    for link in sorted(links, key=lambda k: (k[0] != k[1], k)):
        out.extend(_link_findings(p, link, links[link]))
    return out


def check_region_sets(p: Pairing) -> list[Finding]:
    """Every region that is not optional exists on both engines (by the name its fields belong to: a region
    split over several runs of blocks with ``part_of`` exists where any of its parts does).

    >>> from kvlc import compile_spec
    >>> a, b = compile_spec("layouts/llama-3.1-8b.yaml"), compile_spec("layouts/llama-3.1-70b-tp4.yaml")
    >>> len(check_region_sets(Pairing(a, b, 0, "READ")))  # 70B has 80 layers, 8B 32
    48
    """
    out = []
    for side, plan, other in (("local", p.local, p.remote), ("remote", p.remote, p.local)):
        names = {r.content for r in other.regions}
        for r in plan.regions:
            if r.content not in names and not r.optional and holds_region(other, r.content):
                part = f" (part of '{r.part_of}')" if r.part_of else ""
                out.append(_finding("region-missing", f"region exists on the {side} engine only{part}", r.name,
                                    local="present" if side == "local" else "absent",
                                    remote="absent" if side == "local" else "present",
                                    fix="declare it on both, or mark it optional"))
    return out


def common_regions(p: Pairing) -> tuple[list[str], list[str]]:
    """Names of the regions both plans hold (by ``content``: a split region once), in local and remote order."""
    lset, rset = {r.content for r in p.local.regions}, {r.content for r in p.remote.regions}
    return (list(dict.fromkeys(r.content for r in p.local.regions if r.content in rset)),
            list(dict.fromkeys(r.content for r in p.remote.regions if r.content in lset)))


def check_region_order(p: Pairing) -> list[Finding]:
    """Common regions appear in the same order on both engines.

    >>> from kvlc import compile_spec
    >>> plan = compile_spec("layouts/llama-3.1-8b.yaml")
    >>> check_region_order(Pairing(plan, plan, 0, "READ"))
    []
    """
    common_l, common_r = common_regions(p)
    if common_l == common_r:
        return []
    first = next(i for i, (a, b) in enumerate(zip(common_l, common_r)) if a != b)
    return [_finding("region-order", "regions appear in a different order", common_l[first],
                     local=f"position {first}: {common_l[first]}", remote=f"position {first}: {common_r[first]}",
                     fix="declare regions in the same order on both engines")]


# ----------------------------------------------------------------------------- region-level checks
def check_region_groups(a: PlanRegion, b: PlanRegion) -> list[Finding]:
    """A region's groups link one to one (:func:`~kvlc.compiler.pairing.match.group_links`): the same
    groups on both engines, or one group on each (whose kinds :func:`check_groups` compares). A region shared
    by several groups on one engine and by others on the other cannot say which ids address it.

    >>> from kvlc import compile_spec
    >>> g = compile_spec("layouts/gemma-3-27b-tp2-b16.yaml")
    >>> a, b = g.region("layer.0"), g.region("layer.5")
    >>> (a.groups, b.groups), check_region_groups(a, b)   # one group each: linked local > global
    ((('local',), ('global',)), [])
    """
    if group_links(a, b):
        return []
    return [_finding("region-groups", "region is shared by several groups on one engine and belongs to other "
                     "groups on the other: a block id of every group it serves addresses it, so no group's ids "
                     "map to one group of the peer", a.name, local=",".join(a.groups), remote=",".join(b.groups),
                     fix="let the region serve the same groups on both engines, or one group on each")]


def _tokens(r: PlanRegion) -> str:
    return "state" if r.is_state else f"{r.block_tokens} tokens"


def check_region_state(a: PlanRegion, b: PlanRegion) -> list[Finding]:
    """A region is per-token on both engines or per-request state on both.

    >>> from kvlc import compile_spec
    >>> n = compile_spec("layouts/nemotron-h-8b-tp2.yaml")
    >>> [f.code for f in check_region_state(n.region("layer.0"), n.region("layer.7"))]
    ['token-tiling']
    """
    if a.is_state == b.is_state:
        return []
    return [_finding("token-tiling", "region is per-token on one engine and per-request state on the other",
                     a.name, local=_tokens(a), remote=_tokens(b))]


def check_region_fields(a: PlanRegion, b: PlanRegion) -> list[Finding]:
    """Each field both regions hold passes :data:`FIELD_CHECKS` (which fields a region holds on each engine
    is :func:`check_field_sets`'s question).

    >>> from kvlc import compile_spec
    >>> a, b = compile_spec("layouts/llama-3.1-8b.yaml"), compile_spec("layouts/llama-3.1-8b-fp8-tp2.yaml")
    >>> [(f.code, f.field, f.local, f.remote) for f in check_region_fields(a.region("layer.0"), b.region("layer.0"))]
    [('field-dtype', 'k', 'bf16', 'fp8_e4m3'), ('field-dtype', 'v', 'bf16', 'fp8_e4m3')]
    """
    theirs = {f.name for f in b.fields}
    out: list[Finding] = []
    for lf in a.fields:
        if lf.name not in theirs:
            continue
        rf = b.field(lf.name)
        for check in FIELD_CHECKS:
            found = check(a, b, lf, rf)
            out.extend(found)
            if found and check in _FIELD_GATES:
                break
    return out


def check_field_sets(name: str, local: tuple[PlanRegion, ...], remote: tuple[PlanRegion, ...]) -> list[Finding]:
    """Both engines hold the same fields of region ``name`` (over all its parts: K and V may lie in one
    region on one engine and in two on the other); the finding names both layouts.

    >>> from kvlc import compile_spec
    >>> from kvlc.compiler.pairing.match import parts
    >>> a, b = compile_spec("layouts/llama-3.1-8b-split.yaml"), compile_spec("layouts/llama-3.1-8b-fp8-tp2.yaml")
    >>> [(f.code, f.local, f.remote) for f in check_field_sets("layer.0", parts(a)["layer.0"], parts(b)["layer.0"])]
    [('field-set', 'layer.0.k[k] + layer.0.v[v]', 'k,v,k_scale,v_scale')]
    """
    lnames = sorted(f.name for r in local for f in r.fields)
    rnames = sorted(f.name for r in remote for f in r.fields)
    if lnames == rnames:
        return []
    return [_finding("field-set", "regions hold different fields", name, local=fields_text(local),
                     remote=fields_text(remote), fix="declare the same fields on both engines")]


TILE_WARNING = 4096  # tokens: a larger tile means many descriptors per request


def check_tile_size(a: PlanRegion, b: PlanRegion) -> list[Finding]:
    """Warn when two block sizes share a large tile (lcm of the block sizes).

    >>> from kvlc import compile_spec
    >>> a, b = compile_spec("layouts/gemma-3-27b-tp2-b16.yaml"), compile_spec("layouts/gemma-3-27b-tp2-b32.yaml")
    >>> check_tile_size(a.region("layer.0"), b.region("layer.0"))  # tile of 32 tokens: fine
    []
    """
    if a.is_state or not a.block_entries or not b.block_entries or tile(a.block_entries, b.block_entries).tokens \
            <= TILE_WARNING:
        return []
    return [_finding("tile-size", "block sizes share a large tile", a.name, local=f"{a.block_tokens}",
                     remote=f"{b.block_tokens}", fix="prefer block sizes that divide one another",
                     severity="warning")]


# ----------------------------------------------------------------------------- field-level checks
def check_field_dtype(a: PlanRegion, b: PlanRegion, lf: PlanField, rf: PlanField) -> list[Finding]:
    """Same dtype (a transfer copies bytes; it does not convert).

    >>> from kvlc import compile_spec
    >>> a, b = compile_spec("layouts/llama-3.1-8b.yaml"), compile_spec("layouts/llama-3.1-8b-fp8-tp2.yaml")
    >>> ra, rb = a.region("layer.0"), b.region("layer.0")
    >>> [(f.local, f.remote) for f in check_field_dtype(ra, rb, ra.field("k"), rb.field("k"))]
    [('bf16', 'fp8_e4m3')]
    """
    if lf.dtype == rf.dtype:
        return []
    return [_finding("field-dtype", "dtypes differ", a.name, lf.name, lf.dtype, rf.dtype,
                     fix="transfer needs the same dtype; convert after the transfer")]


def check_field_dims(a: PlanRegion, b: PlanRegion, lf: PlanField, rf: PlanField) -> list[Finding]:
    """The same dim names (in any order).

    >>> from kvlc import compile_spec
    >>> r = compile_spec("layouts/llama-3.1-8b.yaml").region("layer.0")
    >>> check_field_dims(r, r, r.field("k"), r.field("v"))
    []
    """
    ld, rd = [d.name for d in lf.dims], [d.name for d in rf.dims]
    if set(ld) == set(rd):
        return []
    return [_finding("field-dims", "dims differ", a.name, lf.name, ",".join(ld), ",".join(rd),
                     fix="name the same dims on both engines")]


def check_dim_values(a: PlanRegion, b: PlanRegion, lf: PlanField, rf: PlanField) -> list[Finding]:
    """Each dim has the same role, and the same size (heads: the same global count).

    >>> from kvlc import compile_spec
    >>> a, b = compile_spec("layouts/llama-3.1-70b-tp4.yaml"), compile_spec("layouts/llama-3.1-70b-tp8.yaml")
    >>> ra, rb = a.region("layer.0"), b.region("layer.0")
    >>> check_dim_values(ra, rb, ra.field("k"), rb.field("k"))  # 2 vs 1 heads per rank, 8 in all: equal
    []
    """
    rd = {d.name: d for d in rf.dims}
    out = []
    for x in lf.dims:
        y = rd[x.name]
        if x.role != y.role:
            out.append(_finding("dim-role", f"dim '{x.name}' has different roles", a.name, lf.name,
                                x.role or "plain", y.role or "plain"))
        elif x.role == "head" and x.global_size != y.global_size:
            out.append(_finding("dim-size", f"dim '{x.name}' holds different head counts", a.name, lf.name,
                                str(x.global_size), str(y.global_size)))
        elif not x.role and x.size != y.size:
            out.append(_finding("dim-size", f"dim '{x.name}' has different sizes", a.name, lf.name,
                                str(x.size), str(y.size)))
    return out


def check_packed_dim(a: PlanRegion, b: PlanRegion, lf: PlanField, rf: PlanField) -> list[Finding]:
    """A packed dtype (``fp4_e2m1``, two values per byte) packs the same innermost dim on both engines: a
    byte holds two values of that dim, so a byte of one side is one of the other only if both pair alike.

    >>> from kvlc import compile_spec
    >>> r = compile_spec("layouts/llama-3.1-8b-nvfp4-tp2.yaml").region("layer.0")
    >>> check_packed_dim(r, r, r.field("k"), r.field("k"))
    []
    """
    if lf.dtype not in PACKED or lf.dims[-1].name == rf.dims[-1].name:
        return []
    return [_finding("packed-dim", f"{lf.dtype} packs two values per byte along different innermost dims",
                     a.name, lf.name, lf.dims[-1].name, rf.dims[-1].name,
                     fix="put the same plain dim (e.g. head_dim) innermost on both engines")]


def check_token_tiling(a: PlanRegion, b: PlanRegion, lf: PlanField, rf: PlanField) -> list[Finding]:
    """A per-block field (no token dim) cannot be re-tiled across block sizes.

    >>> from kvlc import compile_spec
    >>> r = compile_spec("layouts/llama-3.1-8b.yaml").region("layer.0")
    >>> check_token_tiling(r, r, r.field("k"), r.field("k"))
    []
    """
    if a.is_state or b.is_state or a.block_tokens == b.block_tokens or lf.dim("token") is not None:
        return []
    return [_finding("token-tiling", "a per-block field (no token dim) cannot be re-tiled across block sizes",
                     a.name, lf.name, f"{a.block_tokens} tokens/block", f"{b.block_tokens} tokens/block",
                     fix="use one kernel block size on both engines or give the field a token dim")]


FIELD_CHECKS = (check_field_dtype, check_field_dims, check_packed_dim, check_dim_values, check_token_tiling)
# a finding of a gate makes the later field checks meaningless
_FIELD_GATES = (check_field_dtype, check_field_dims, check_packed_dim)
REGION_CHECKS = (check_region_groups, check_region_state, check_region_fields, check_tile_size)


def check_region_pairs(p: Pairing) -> list[Finding]:
    """Every region both engines hold passes :data:`REGION_CHECKS`, region pair by region pair (a region
    split into parts on one engine pairs each part with the regions holding its fields on the other).

    >>> from kvlc import compile_spec
    >>> a, b = compile_spec("layouts/llama-3.1-70b-tp4.yaml"), compile_spec("layouts/llama-3.1-70b-tp8.yaml")
    >>> check_region_pairs(Pairing(a, b, 0, "READ"))
    []
    """
    lparts, rparts = parts(p.local), parts(p.remote)
    by_name: dict[str, list[RegionPair]] = {}
    for rp in region_pairs(p.local, p.remote):
        by_name.setdefault(rp.content, []).append(rp)
    out = []
    for name, pairs in by_name.items():
        sets = check_field_sets(name, lparts[name], rparts[name])
        for i, rp in enumerate(pairs):
            for check in REGION_CHECKS:  # a field-set finding stands for the field checks of its region
                out.extend((sets if i == 0 else []) if sets and check is check_region_fields
                           else check(rp.local, rp.remote))
    return out


CHECKS = (check_direction, check_rank, check_model, check_dcp, check_pp_layers, check_groups,
          check_region_sets, check_region_order, check_region_pairs)


def check_plans(local: Plan, remote: Plan, local_rank: int, direction: str) -> CompatReport:
    """Compare two plans for a transfer in ``direction`` from ``local_rank``'s point of view.

    Runs :data:`CHECKS` in order; errors come first in the report, each group in check order.

    >>> from kvlc import compile_spec
    >>> a, b = compile_spec("layouts/llama-3.1-70b-tp4.yaml"), compile_spec("layouts/llama-3.1-8b.yaml")
    >>> check_plans(a, b, 0, "READ").codes()[:2]
    ('model-name', 'model-layers')
    """
    p = Pairing(local, remote, local_rank, direction)
    out = [f for check in CHECKS for f in check(p)]
    return CompatReport(local=local.name, remote=remote.name, direction=direction, local_rank=local_rank,
                        findings=tuple(sorted(out, key=lambda f: f.severity != "error")))


__all__ = ["CHECKS", "REGION_CHECKS", "FIELD_CHECKS", "CompatReport", "Finding", "Pairing", "check_plans",
           "head_major_order"]
