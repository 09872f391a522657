"""Per request, the rules — what each group's block ids must satisfy, derived once per program.

:func:`request_rules` turns a program's plans and regions into one :class:`GroupRule` per
group (each side's block size, DCP size, kernel blocks per block, the region that bounds its
ids, which side receives, the sliding window, the regions whose per-block fields a range may
not split) and keeps them in the program's memo, so that
:func:`kvlc.compiler.request.check.check_request` does no lookup per request.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlc.compiler.pairing.program import TransferProgram
from kvlc.compiler.plan.model import PlanRegion
from kvlc.compiler.request import native
from kvlc.compiler.request.index import program_index


@dataclass(frozen=True)
class SideRule:
    """What one side's ids of one group must satisfy, fixed per program (built once, used per request).

    ``bound``: the side's region of the group with the fewest blocks (it bounds every id);
    ``receiving``: the side written to (its ids must be distinct).
    """

    group: str
    side: str
    where: str
    block_size: int
    dcp: int
    kernel_blocks: int
    bound: PlanRegion
    receiving: bool


@dataclass(frozen=True)
class WholeBlock:
    """A region whose field ``field`` has no token dim: a range must start on a multiple of ``per`` tokens there."""

    region: str
    per: int
    field: str


@dataclass(frozen=True)
class GroupRule:
    """One group link's request rules (``name``: the link, :attr:`~kvlc.compiler.pairing.program.Entry.link`;
    each side's group is its :class:`SideRule`'s): state or tokens, the receiver's sliding window or
    chunked-local chunk (None: the whole range moves), and the regions a range may not start inside a block of."""

    name: str
    state: bool
    window: int | None
    window_block: int
    local: SideRule
    remote: SideRule
    whole_blocks: tuple[WholeBlock, ...] = ()
    chunk: int | None = None


@dataclass(frozen=True)
class RequestRules:
    """Every group link's rules in program order, the local groups of the links (``names``: the keys of a
    per-group token range), the group names each side knows, whether pools alias."""

    groups: tuple[GroupRule, ...]
    names: tuple[str, ...]
    local_names: frozenset
    remote_names: frozenset
    aliased: bool


def request_rules(prog: TransferProgram) -> RequestRules:
    """The program's :class:`RequestRules`, derived on first use and kept in its memo."""
    return prog.memo.get("request_rules", lambda: _rules_of(prog))


def prepare(prog: TransferProgram) -> TransferProgram:
    """Derive the per-request lookup structures now (the program's index and request rules) and load the C
    reader of block ids, not in the first request (a pull-via-push consumer checks its requests but never
    binds); returns the program. A runtime calls it when it pairs.

    >>> from kvlc import compile_spec, pair
    >>> p = compile_spec("layouts/llama-3.1-8b.yaml")
    >>> prog = prepare(pair(p, p, local_rank=0))
    >>> prog.memo.get("request_rules", lambda: None).names
    ('full',)
    """
    request_rules(prog)  # builds the index on the way
    native.ids_library()  # the C reader of the engine's id lists that check_request uses, loaded now
    return prog


def _rules_of(prog: TransferProgram) -> RequestRules:
    local_receives = prog.direction == "READ"
    recv = prog.local if local_receives else prog.remote
    links = {e.link: (e.group, e.remote_group) for e in prog.entries}
    groups = []
    for name, regions in program_index(prog).groups.items():
        lname, rname = links[name]
        sides = [SideRule(group, side, f"{side} block ids of group '{group}'", plan.group(group).block_size,
                          plan.group_dcp(group), plan.group(group).kernel_blocks_per_block,
                          regions.smallest(side),
                          receiving)
                 for side, plan, group, receiving in (("local", prog.local, lname, local_receives),
                                                      ("remote", prog.remote, rname, not local_receives))]
        g = recv.group(lname if local_receives else rname)  # the receiver's window (pairing checked the sender)
        window = g.window if g.kind == "sliding_window" else None
        per_id = g.block_size * recv.group_dcp(g.name)
        chunk = g.window if g.kind == "chunked_local" else None   # the plan keeps a chunk as the group's window
        groups.append(GroupRule(name, regions.is_state, window, per_id,
                                *sides, () if regions.is_state else _whole_blocks(prog, regions.local), chunk))
    return RequestRules(tuple(groups), tuple(dict.fromkeys(links[n][0] for n in program_index(prog).groups)),
                        frozenset(g.name for g in prog.local.groups),
                        frozenset(g.name for g in prog.remote.groups), any(r.aliases for r in recv.regions))


def _whole_blocks(prog, regions) -> tuple[WholeBlock, ...]:
    """The local regions of a token group with a per-block field (no token dim), in program order."""
    out = []
    for r in regions:  # DCP: a block covers block_tokens x dcp_size tokens (unless DCP leaves it whole)
        flat = [f.name for f in r.fields if f.dim("token") is None]
        if flat:
            out.append(WholeBlock(r.name, r.block_tokens * prog.local.region_parallel(r).dcp_size, flat[0]))
    return tuple(out)
