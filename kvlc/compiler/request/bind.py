"""Per request, step 2 — a program bound to storage addresses, once per connection.

:func:`bind` checks and fixes each storage's base address (and device) on both sides; the
:class:`BoundProgram` it returns is what :func:`kvlc.compiler.request.instantiate.instantiate`
and :mod:`kvlc.compiler.request.prepared` turn into descriptors per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from kvlc.compiler.frozen import FrozenMap, Memo
from kvlc.compiler.pairing.program import TransferProgram
from kvlc.compiler.request.index import Block, program_index
from kvlc.compiler.request.rows import Geometry, Side
from kvlc.errors import TransferError

ADDRESS_LIMIT = 1 << 63  # addresses are computed in int64: base + storage size must stay below


@dataclass(frozen=True, eq=False)
class Bases:
    """One side's storages, in plan order: base address and device of each (int64 arrays)."""

    addr: np.ndarray
    device: np.ndarray


def _address(v, name: str, plan) -> tuple[int, int | None]:
    """``addr`` or ``(addr, device)`` as integers (bool, float, str refused)."""
    if type(v) is int:  # the common cases first: plain ints need no further checks
        return v, None
    if type(v) is tuple and len(v) == 2 and type(v[0]) is int and type(v[1]) is int:
        return v
    addr, dev = (v[0], v[1]) if isinstance(v, (tuple, list)) and len(v) == 2 else (v, None)
    where = f"storage '{name}' of plan '{plan.name}'"
    return _integer(addr, "address", where), None if dev is None else _integer(dev, "device", where)


def _integer(x, what: str, where: str) -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise TransferError(f"{where}: base {what} must be an integer, found {x!r}")
    return int(x)


def bases_of(bases: Mapping[str, object], plan) -> Bases:
    """Base address (and device) of every storage of ``plan``, from ``name -> addr | (addr, device)``.

    Every storage must lie in ``[0, 2**63)`` from its base: addresses are int64 and must not wrap.
    """
    addrs, devs = [], []
    for s in plan.storages:
        v = bases.get(s.name)
        if v is None:
            raise TransferError(f"no base address for storage '{s.name}' of plan '{plan.name}'")
        a, d = _address(v, s.name, plan)
        if not 0 <= a < ADDRESS_LIMIT:
            _wraps(plan, s, a)
        addrs.append(a)
        devs.append(s.device if d is None else d)
    addr = np.array(addrs, dtype=np.int64)
    dev = np.array(devs, dtype=np.int64)
    room = ADDRESS_LIMIT - np.array([s.size for s in plan.storages], dtype=np.uint64)  # sizes < 2**63 (checked)
    over = np.flatnonzero(addr.view(np.uint64) > room)
    if len(over):
        _wraps(plan, plan.storages[int(over[0])], int(addr[over[0]]))
    return Bases(addr, dev)


def _wraps(plan, s, addr: int) -> None:
    raise TransferError(f"storage '{s.name}' of plan '{plan.name}': base address {addr:#x} + size {s.size:,} "
                        "leaves [0, 2**63); addresses would wrap")


def bind(prog: TransferProgram, local_bases: Mapping[str, object],
         remote_bases: Mapping[int, Mapping[str, object]]) -> BoundProgram:
    """Fix storage base addresses once (per connection); then instantiate per request.

    Bases map storage name → address or (address, device); remote bases are per peer rank.

    >>> from kvlc import compile_spec, pair
    >>> plan = compile_spec("layouts/llama-3.1-8b.yaml")
    >>> prog = pair(plan, plan, local_rank=0, direction="READ")
    >>> bound = bind(prog, {s.name: 1 << 40 for s in plan.storages}, {0: {s.name: 2 << 40 for s in plan.storages}})
    >>> sorted(bound.remote), int(bound.local.addr[0]) == 1 << 40
    ([0], True)
    """
    local = bases_of(local_bases, prog.local)
    remote = {}
    for peer in prog.peer_ranks:
        if peer not in remote_bases:
            raise TransferError(f"no remote bases for peer rank {peer} "
                                f"(the program reads from ranks {list(prog.peer_ranks)})")
        remote[peer] = bases_of(remote_bases[peer], prog.remote)
    return BoundProgram(prog, local, FrozenMap(remote))


@dataclass(frozen=True, eq=False)
class BoundProgram:
    """A program with storage bases fixed (see :func:`bind`): the per-request hot path's input."""

    program: TransferProgram
    local: Bases
    remote: FrozenMap[int, Bases]
    memo: Memo = field(default_factory=Memo, init=False, repr=False)

    def sides(self, b: Block) -> Geometry:
        """Both sides' operands of a block's entries (stride, base, device), stacked."""
        rb = self.remote[b.key.peer_rank]
        lg, rg = b.local, b.remote
        return Geometry.of(Side(lg.stride, self.local.addr[lg.storage] + lg.offset, self.local.device[lg.storage]),
                           Side(rg.stride, rb.addr[rg.storage] + rg.offset, rb.device[rg.storage]))

    def geometries(self) -> list[Geometry]:
        """:meth:`sides` of every block of the program, in order (fixed per binding: made once)."""
        return self.memo.get("sides", lambda: [self.sides(b) for b in program_index(self.program).blocks])
