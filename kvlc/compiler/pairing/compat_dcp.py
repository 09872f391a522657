"""Compatibility of decode context parallelism: what a DCP pairing cannot move correctly.

Any DCP size and interleave on either side pairs (tokens are mapped through their global
positions, :mod:`kvlc.compiler.algebra.sharding`; per-request state, which has no token axis, and the
regions of a ``dcp: replicated`` group are held whole by every DCP rank and pair by TP alone on that
side), except where the bytes have no single right place:

* ``dcp-heads``: an engine whose DCP group spans ranks that hold different heads (more DCP
  ranks than replicas of a head) stores some tokens of a head on no rank at all;
* ``dcp-compressed``: a compressed cache (``tokens_per_entry`` > 1) is not mapped across DCP
  ranks yet;
* ``dcp-per-block``: a field without a token dim (one value per block) describes a different
  set of tokens on each side unless both shard tokens identically.
"""

from __future__ import annotations

from kvlc.compiler.algebra.sharding import dcp_chunks
from kvlc.compiler.pairing.findings import Finding, Pairing
from kvlc.compiler.pairing.match import region_pairs
from kvlc.compiler.plan.model import Plan, PlanRegion
from kvlc.compiler.pairing.tp import dcp_holders


def _sharding(plan: Plan, r: PlanRegion) -> tuple[int, int, int]:
    """How region ``r`` shards tokens: (DCP size, interleave, tokens per kernel block); a group replicated
    under DCP shards like an engine without DCP."""
    p = plan.region_parallel(r)
    return p.dcp_size, p.dcp_interleave, r.block_tokens


def _geometry(plan: Plan, r: PlanRegion) -> str:
    dcp, inter, block_tokens = _sharding(plan, r)
    rep = f" (replicated under dcp_size {plan.parallel.dcp_size})" if r.dcp_replicated else ""
    return f"dcp_size {dcp}{rep}, dcp_interleave {inter}, {block_tokens} tokens/kernel block"


def _uncovered(plan: Plan) -> tuple[int, int, int] | None:
    """A (global heads, head, DCP rank) whose tokens no TP rank stores, if any."""
    seen = set()
    for r in plan.regions:
        for f in () if r.is_state or r.dcp_replicated else r.fields:  # state, replicated: not sharded
            hd = f.dim("head")
            if hd is None or hd.global_size in seen:
                continue
            seen.add(hd.global_size)
            for h in range(hd.global_size):
                for d, ranks in enumerate(dcp_holders(h, hd.global_size, plan.parallel)):
                    if not ranks:
                        return hd.global_size, h, d
    return None


def check_dcp_heads(p: Pairing) -> list[Finding]:
    """Every DCP rank's tokens of every head are held by some TP rank, on both engines."""
    out = []
    for side, plan in (("local", p.local), ("remote", p.remote)):
        par = plan.parallel
        bad = _uncovered(plan) if par.dcp_size > 1 else None
        if bad is None:
            continue
        heads, h, d = bad
        per = max(par.tp_size // heads, 1)
        if par.pcp_size > 1:   # DCP over every rank (tp_size * pcp_size) spans TP ranks of other heads
            held, fix = (f"{per * par.pcp_size} rank(s) ({per} TP rank(s) x pcp_size {par.pcp_size})",
                         f"use dcp_size {par.pcp_size} (DCP along the PCP ranks, which hold the same heads) or 1")
        else:
            held, fix = f"{per} rank(s)", f"use a dcp_size that divides {per} (vLLM: dcp_size <= tp_size / num_kv_heads)"
        pcp = f", pcp_size {par.pcp_size}" if par.pcp_size > 1 else ""
        out.append(Finding(
            "dcp-heads", "error", f"with tp_size {par.tp_size}{pcp} and {heads} heads each head is held by {held}, "
            f"fewer than dcp_size {par.dcp_size}: the tokens of DCP rank {d} of head {h} are stored "
            "by no rank", **{side: f"tp_size {par.tp_size}{pcp}, dcp_size {par.dcp_size}, {heads} heads"},
            fix=fix))
    return out


def check_dcp_regions(p: Pairing) -> list[Finding]:
    """Fields without a token dim under DCP: one value per block, so both engines must shard alike."""
    if p.local.parallel.dcp_size == 1 and p.remote.parallel.dcp_size == 1:
        return []
    out = []
    for rp in region_pairs(p.local, p.remote):
        a, b = rp.local, rp.remote
        sharded = p.local.region_parallel(a).dcp_size > 1 or p.remote.region_parallel(b).dcp_size > 1
        if sharded and not (a.is_state or b.is_state):
            out.extend(_dcp_region(p, a, b))
    return out


def _dcp_region(p: Pairing, a: PlanRegion, b: PlanRegion) -> list[Finding]:
    """The DCP findings of one token region present on both engines (``a`` local, ``b`` remote)."""
    if a.tokens_per_entry > 1 or b.tokens_per_entry > 1:
        return [Finding("dcp-compressed", "error", "a compressed cache (one entry per "
                        f"{max(a.tokens_per_entry, b.tokens_per_entry)} tokens) under decode context "
                        "parallelism: kvlc does not map compressed entries across DCP ranks yet",
                        a.name, local=f"dcp_size {p.local.parallel.dcp_size}",
                        remote=f"dcp_size {p.remote.parallel.dcp_size}",
                        fix="pair compressed groups between engines without DCP")]
    ga, gb = _geometry(p.local, a), _geometry(p.remote, b)
    per_block = [f.name for f in a.fields if f.dim("token") is None]
    if per_block and _sharding(p.local, a) != _sharding(p.remote, b):
        return [Finding("dcp-per-block", "error", "a field without a token dim holds one value per "
                        "block, and the blocks of the two engines cover different tokens", a.name,
                        per_block[0], ga, gb, fix="shard tokens identically on both engines (same "
                        "dcp_size, dcp_interleave and kernel block size) or give the field a token dim")]
    return []


def check_dcp(p: Pairing) -> list[Finding]:
    """Decode context parallelism pairs on any sizes except where bytes have no single right place.

    >>> from kvlc import compile_spec
    >>> from kvlc.compiler.pairing.findings import Pairing
    >>> plan = compile_spec("layouts/llama-3.1-8b.yaml")
    >>> check_dcp(Pairing(plan, plan, 0, "READ"))
    []
    """
    return check_dcp_heads(p) + check_dcp_regions(p)


# ----------------------------------------------------------------------------- warnings of a built program
def fragmented(prog) -> list[Finding]:
    """Warn where DCP pairs tokens in runs shorter than the kernel blocks (descriptors per token run).

    A tile needs one run per kernel block on the side with more blocks when both engines
    shard tokens alike; different interleaves cut that into ``min(interleave)``-token runs.
    """
    seen: dict[tuple, list[str]] = {}
    for e in prog.entries:
        if e.shards is None or not e.tile_tokens:
            continue
        lr, rr = prog.local.region(e.region), prog.remote.region(e.remote_region)
        key = (lr.block_tokens, rr.block_tokens, e.shards, e.tile_tokens, max(e.local_sub, e.remote_sub))
        seen.setdefault(key, []).append(e.region)
    out = []
    for (lb, rb, shards, tile, blocks), regions in seen.items():
        runs = len(dcp_chunks(lb, rb, shards, tile))
        if runs > blocks:
            regions = list(dict.fromkeys(regions))
            more = f" (and in {len(regions) - 1} more region(s))" if len(regions) > 1 else ""
            out.append(Finding(
                "dcp-fragmented", "warning", f"{runs} token runs per {tile}-token tile (kernel blocks: {blocks}) "
                f"because the engines interleave tokens differently{more}", regions[0],
                local=f"DCP rank {shards.local.text()}", remote=f"DCP rank {shards.remote.text()}",
                fix="give a DCP engine a dcp_interleave equal to its kernel block size (vLLM sets "
                    "cp_kv_cache_interleave_size to the block size for its NIXL connector)"))
    return out
