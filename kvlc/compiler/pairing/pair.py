"""Pairing: two plans and a rank → a checked, frozen transfer program of coalesced run templates.

One general computation covers heterogeneous TP (both ways, GQA replicas,
replicated fields), block-size ratios (also non-divisible ones, through tiles
of lcm(tokens) tokens), kernel blocks, Mamba sections and state, and dim orders:

* the **consumer** is the engine that receives bytes, the **producer** the one
  that sends them. READ: the local engine consumes (pull); WRITE: it produces (push).
* :mod:`~kvlc.compiler.pairing.match` says which regions pair: fields by the region they belong to and
  their name (a region split over several tensors with ``part_of`` pairs with a joint one, field by field);
* :mod:`~kvlc.compiler.pairing.compat` checks the two plans (``CHECKS``);
* :mod:`~kvlc.compiler.pairing.tp` maps each consumer rank's heads to producer ranks;
* :mod:`~kvlc.compiler.pairing.runs` turns one tile of each region pair into minimal runs;
* :mod:`~kvlc.compiler.pairing.program` holds the result; :mod:`kvlc.compiler.request` serves requests.
"""

from __future__ import annotations

from dataclasses import replace

from kvlc.compiler.algebra.layout import head_range, tile
from kvlc.compiler.algebra.sharding import Shard, ShardPair, dcp_tile
from kvlc.compiler.pairing.compat import check_plans, head_major_order
from kvlc.compiler.pairing.findings import CompatReport, Finding
from kvlc.compiler.pairing.compat_dcp import fragmented
from kvlc.compiler.pairing.match import RegionPair, region_pairs
from kvlc.compiler.pairing.program import Entry, TransferProgram
from kvlc.compiler.pairing.runs import Piece, tile_runs
from kvlc.compiler.pairing.tp import dcp_sources, reader_counts, shards_meet, tp_alone
from kvlc.compiler.plan.model import Plan, PlanField, PlanRegion
from kvlc.errors import CompatError


def _pieces(cons_rank: int, cons: Plan, prod: Plan, region: PlanRegion, fields: tuple[str, ...], dcp,
            local_is_consumer: bool) -> dict[int, list[Piece]]:
    """Per producer rank: the pieces of the ``fields`` of the consumer's ``region`` that one consumer rank
    reads from it (``dcp``: both sides' parallelism where either shards tokens by DCP, else None)."""
    ctp, ptp = cons.parallel.tp_size, prod.parallel.tp_size
    pars = dcp or (tp_alone(cons.parallel), tp_alone(prod.parallel))
    out: dict[int, list[Piece]] = {}
    for f in (f for f in region.fields if f.name in fields):
        hd = f.dim("head")
        for s in dcp_sources(cons_rank, f, *pars):
            if dcp is not None and not shards_meet(dcp[0], cons_rank, dcp[1], s.producer):
                continue  # the two ranks hold no token in common
            if hd is None:
                piece = Piece(f.name, 0, 0, 0, 0)
            else:   # heads follow the TP rank (PCP ranks of one TP rank hold the same heads)
                c0 = head_range(cons_rank % ctp, hd.global_size, ctp)[0]
                p0 = head_range(s.producer % ptp, hd.global_size, ptp)[0]
                l0, r0 = (c0, p0) if local_is_consumer else (p0, c0)
                piece = Piece(f.name, s.h0, s.h1, l0, r0)
            out.setdefault(s.producer, []).append(piece)
    return out


def _dcp(a: Plan, b: Plan, ar: PlanRegion, br: PlanRegion):
    """Both sides' parallelism of regions ``ar`` (of plan ``a``) and ``br`` (of ``b``) where either shards
    its tokens by DCP, else None.

    Every DCP rank holds a request's whole state, and all tokens of a region whose group is
    ``dcp: replicated``: such a side pairs by TP alone (``Plan.region_parallel``).
    """
    if ar.is_state:
        return None
    ap, bp = a.region_parallel(ar), b.region_parallel(br)
    return (ap, bp) if ap.dcp_size > 1 or bp.dcp_size > 1 else None


def _shards(local: Plan, rank: int, remote: Plan, peer: int, rp: RegionPair) -> ShardPair:
    """The token shards of a region pair on the local rank and the peer rank."""
    lp, rp_ = local.region_parallel(rp.local), remote.region_parallel(rp.remote)
    return ShardPair(Shard(lp.dcp_size, lp.dcp_interleave, lp.dcp_rank(rank)),
                     Shard(rp_.dcp_size, rp_.dcp_interleave, rp_.dcp_rank(peer)))


def _by_peer(rp: RegionPair, local: Plan, remote: Plan, rank: int, local_is_consumer: bool
             ) -> dict[int, list[Piece]]:
    """Per peer rank: the pieces of a region pair that this local rank copies with it."""
    cons, prod = (local, remote) if local_is_consumer else (remote, local)
    cr, pr = (rp.local, rp.remote) if local_is_consumer else (rp.remote, rp.local)
    dcp = _dcp(cons, prod, cr, pr)
    by_peer: dict[int, list[Piece]] = {}
    for c in ([rank] if local_is_consumer else range(cons.parallel.ranks)):
        for p, pieces in _pieces(c, cons, prod, cr, rp.fields, dcp, local_is_consumer).items():
            if local_is_consumer:
                by_peer[p] = pieces
            elif p == rank:
                by_peer[c] = pieces
    return by_peer


def _entries(rp: RegionPair, local: Plan, remote: Plan, rank: int, local_is_consumer: bool, cache: dict
             ) -> list[Entry]:
    lr, rr = rp.local, rp.remote
    dcp = _dcp(local, remote, lr, rr) is not None
    out = []
    for peer, pieces in sorted(_by_peer(rp, local, remote, rank, local_is_consumer).items()):
        pieces = tuple(pieces)
        shards = _shards(local, rank, remote, peer, rp) if dcp else None
        t = (dcp_tile(lr.block_tokens, shards.local, rr.block_tokens, shards.remote) if shards
             else tile(lr.block_tokens, rr.block_tokens))
        key = (lr.fields, rr.fields, lr.block_tokens, rr.block_tokens, pieces, shards)
        if key not in cache:
            cache[key] = tile_runs(lr, rr, pieces, shards=shards)
        out.extend(Entry(lr.name, group, peer, lr.mem, rr.mem, t.tokens, t.a_blocks, t.b_blocks, pieces, cache[key],
                         shards, remote_region=rr.name, remote_group=remote_group) for group, remote_group in rp.links)
    return out


def build_program(local: Plan, remote: Plan, rank: int, direction: str, report: CompatReport) -> TransferProgram:
    """The program of two compatible plans (``report`` has no errors); no checks of its own.

    Regions pair by the region their fields belong to (:mod:`~kvlc.compiler.pairing.match`): one entry
    per (local region, remote region) holding a field of one region, group link and peer rank.
    """
    local_is_consumer = direction == "READ"
    cons, prod = (local, remote) if local_is_consumer else (remote, local)
    pairs = [rp for rp in region_pairs(local, remote) if rp.fields]
    cache: dict = {}
    entries = [e for rp in pairs for e in _entries(rp, local, remote, rank, local_is_consumer, cache)]
    return TransferProgram(local, remote, rank, direction, tuple(entries),
                           _counts(cons, prod, pairs, local_is_consumer), report)


def _counts(cons: Plan, prod: Plan, pairs: list[RegionPair], local_is_consumer: bool) -> dict[int, int]:
    """Per producer rank: how many consumer ranks read from it, over the fields of the region ``pairs``
    (grouped by how each region is sharded: DCP on either side, or TP alone)."""
    by_sharding: dict = {}
    for rp in pairs:
        cr, pr = (rp.local, rp.remote) if local_is_consumer else (rp.remote, rp.local)
        by_sharding.setdefault(_dcp(cons, prod, cr, pr), []).extend(f for f in cr.fields if f.name in rp.fields)
    return reader_counts(by_sharding, cons.parallel, prod.parallel)


# ----------------------------------------------------------------------------- warnings of a built program
def _order(f: PlanField) -> str:
    return "(" + ", ".join(d.name for d in f.dims) + ")"


def _explosion(prog: TransferProgram, e: Entry, name: str) -> int:
    """Descriptors per tile of one field of an entry (0 where it cannot explode)."""
    lr, rr = prog.local.region(e.region), prog.remote.region(e.remote_region)
    lf = lr.field(name)
    if lf.dim("token") is None or lf.dim("head") is None:
        return 0
    n = len(tile_runs(lr, rr, tuple(p for p in e.pieces if p.field == name), shards=e.shards))
    return n if n >= e.tile_tokens // lr.tokens_per_entry else 0   # one run per token (entry) of the tile


def explosions(prog: TransferProgram) -> list[Finding]:
    """Warn where a field needs about one descriptor per token per tile (token-major + hetero TP)."""
    seen: dict[tuple, tuple[int, list[str], PlanField, PlanField, int]] = {}
    for e in prog.entries:
        lr, rr = prog.local.region(e.region), prog.remote.region(e.remote_region)
        if e.tile_tokens // max(lr.tokens_per_entry, 1) < 2:
            continue
        for name in dict.fromkeys(p.field for p in e.pieces):
            lf, rf = lr.field(name), rr.field(name)
            key = (name, lf, rf, lr.block_tokens, rr.block_tokens, e.tile_tokens, e.shards)
            if key not in seen:
                seen[key] = (_explosion(prog, e, name), [], lf, rf, e.tile_tokens)
            seen[key][1].append(e.region)
    return [_explosion_finding(n, list(dict.fromkeys(regions)), lf, rf, tt)
            for n, regions, lf, rf, tt in seen.values() if n]


def _explosion_finding(n: int, regions: list[str], lf: PlanField, rf: PlanField, tt: int) -> Finding:
    message = (f"{n} descriptors per {tt}-token tile (about one per token) because a head "
               "slice is not contiguous in a token-major order")
    if len(regions) > 1:
        message += f" (and in {len(regions) - 1} more region(s))"
    return Finding("descriptor-explosion", "warning", message, regions[0], lf.name, local=_order(lf),
                   remote=_order(rf), fix=f"order dims {head_major_order(lf)} on both engines (HND)")


def _with_warnings(report: CompatReport, prog: TransferProgram) -> CompatReport:
    return replace(report, findings=report.findings + tuple(explosions(prog)) + tuple(fragmented(prog)))


# ----------------------------------------------------------------------------- public entry points
def check_pair(local_plan: Plan, remote_plan: Plan, *, local_rank: int, direction: str) -> CompatReport:
    """Every compatibility finding of a pairing; never raises for a mismatch."""
    return pair_and_check(local_plan, remote_plan, local_rank=local_rank, direction=direction)[0]


def pair_and_check(local_plan: Plan, remote_plan: Plan, *, local_rank: int, direction: str
                   ) -> tuple[CompatReport, TransferProgram | None]:
    """The report and, when compatible, the program, built once (``kvlc pair`` prints both)."""
    report = check_plans(local_plan, remote_plan, local_rank, direction)
    if not report.ok:
        return report, None
    prog = build_program(local_plan, remote_plan, local_rank, direction, report)
    full = _with_warnings(report, prog)
    return full, replace(prog, report=full)


def pair(local_plan: Plan, remote_plan: Plan, *, local_rank: int, direction: str = "READ") -> TransferProgram:
    """Check two plans and build the transfer program, or raise :class:`CompatError`.

    >>> from kvlc import compile_spec
    >>> a, b = compile_spec("layouts/llama-3.1-70b-tp4.yaml"), compile_spec("layouts/llama-3.1-70b-tp8.yaml")
    >>> pair(a, b, local_rank=0, direction="READ").peer_ranks
    (0, 1)
    """
    report, prog = pair_and_check(local_plan, remote_plan, local_rank=local_rank, direction=direction)
    if prog is None:
        raise CompatError(report)
    return prog
