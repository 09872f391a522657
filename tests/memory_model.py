"""A content-coded memory model that executes transfer programs with numpy copies.

Each (engine, rank) owns one uint8 buffer per storage at a made-up base address;
descriptor rows are resolved back to (buffer, offset) and copied byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvlc.demo.content import expected_bytes, fill
from kvlc.compiler.plan.model import Plan

SPACE = 1 << 36


@dataclass
class Engine:
    """All ranks of one engine: buffers per (rank, storage) with distinct fake bases."""

    plan: Plan
    tag: int
    coded: bool
    buffers: dict = field(default_factory=dict)
    bases: dict = field(default_factory=dict)

    def __post_init__(self):
        rng = np.random.default_rng(1234 + self.tag)
        for rank in range(self.plan.parallel.ranks):  # tp_size * pcp_size
            bufs = {}
            for i, s in enumerate(self.plan.storages):
                bufs[s.name] = rng.integers(0, 256, s.size, dtype=np.uint8)
                self.bases[(rank, s.name)] = (self.tag * 64 + rank) * SPACE * 16 + i * SPACE
            if self.coded:
                fill(self.plan, rank, bufs)
            self.buffers[rank] = bufs

    def rank_bases(self, rank: int) -> dict:
        return {s.name: (self.bases[(rank, s.name)], s.device) for s in self.plan.storages}

    def resolve(self, rank: int, addr: int, length: int):
        for s in self.plan.storages:
            base = self.bases[(rank, s.name)]
            if base <= addr and addr + length <= base + s.size:
                return self.buffers[rank][s.name], addr - base
        raise AssertionError(f"address {addr:#x}+{length} outside every storage of rank {rank}")


def execute(parts, local: Engine, local_rank: int, remote: Engine, direction: str) -> int:
    """Copy every descriptor row; READ copies remote→local, WRITE local→remote. Returns rows."""
    rows = 0
    for key, part in parts.items():
        for (la, n, _), (ra, n2, _) in zip(part.local.tolist(), part.remote.tolist()):
            assert n == n2
            lb, lo = local.resolve(local_rank, la, n)
            rb, ro = remote.resolve(key.peer_rank, ra, n)
            if direction == "READ":
                lb[lo:lo + n] = rb[ro:ro + n]
            else:
                rb[ro:ro + n] = lb[lo:lo + n]
            rows += 1
    return rows


def verify(dst: Engine, dst_rank: int, src: Engine, dst_ids, src_ids, num_tokens, before, tokens=None) -> int:
    """Assert every requested byte holds its content code and every other byte is unchanged."""
    bufs = dst.buffers[dst_rank]
    touched = {name: np.zeros(len(b), bool) for name, b in bufs.items()}
    checked = 0
    for storage, idx, vals in expected_bytes(dst.plan, dst_rank, src.plan, dst_ids, src_ids, num_tokens,
                                                  tokens=tokens):
        got = bufs[storage][idx]
        bad = np.flatnonzero(got != vals)
        assert bad.size == 0, (f"{bad.size} wrong bytes in storage {storage} of rank {dst_rank}, "
                               f"first at byte {int(idx[bad[0]])}")
        touched[storage][idx] = True
        checked += idx.size
    for name, b in bufs.items():
        other = ~touched[name]
        changed = np.flatnonzero(b[other] != before[name][other])
        assert changed.size == 0, f"{changed.size} bytes written outside the request in {name}"
    return checked
