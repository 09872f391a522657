"""What one staged chunk's WRITE moves: its gathered slot, or its source ranges straight into the peer's slot.

A chunk is *gathered* by default: its ranges are copied into a slot of the sender's outbox and
ONE descriptor writes that slot (data, then the destination ranges behind it) into the peer's
slot. A chunk of few, large ranges that all lie on the outbox's own memory (the sender's KV
storages in VRAM of the outbox's GPU, or DRAM with a DRAM outbox) goes *direct*: the WRITE
takes each source range to its packed place in the peer's slot, and only the destination
ranges come from the outbox. The peer's slot then holds exactly what a gather would have put
there, so the receiver cannot tell the two apart; the sender saves a device copy per chunk (on
one GPU shared by two engines, a turn of its context: benchmarks/README.md, "Mixed memory:
slot depth and direct chunks"). Many small ranges are still gathered: UCX posts each
descriptor serially, which is what staging avoids.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvlc.runtime.staging.buffers import DIRECT_MIN_BYTES, BounceBuffer, _align8, _Chunk
from kvlc.runtime.staging.copy import Regions
from kvlc.runtime.staging.wire import BounceInfo

__all__ = ["DIRECT_MIN_BYTES", "chunk_rows", "goes_direct"]


def goes_direct(regions: Regions, c: _Chunk, outbox: BounceBuffer, min_mean: int) -> bool:
    """Whether chunk ``c`` is written from its sources: ranges of ``min_mean`` bytes or more on average,
    every one in a region on the outbox's memory and device (one NIXL list: one memory type)."""
    if not min_mean or int(c.local[:, 1].sum()) < min_mean * len(c.local):
        return False
    return all(_on(regions.regions[i].tensor, outbox) for i in set(regions.locate(c.local).tolist()))


def _on(tensor: Any, outbox: BounceBuffer) -> bool:
    if outbox.mem == "VRAM":
        return tensor.is_cuda and tensor.device.index == outbox.device
    return not tensor.is_cuda


def chunk_rows(c: _Chunk, outbox: BounceBuffer, info: BounceInfo) -> tuple[np.ndarray, np.ndarray]:
    """The (N, 3) local and remote descriptor rows of chunk ``c``'s WRITE into the peer's slot ``c.remote_slot``.

    Gathered: one row, the outbox slot's data and ranges. Direct: one row per source range (to
    its offset among the packed data) and one for the ranges, which lie behind the data in both slots.
    """
    at = _align8(c.nbytes)
    trailer = 16 * len(c.remote)
    mine, theirs = outbox.addr + c.slot * outbox.stride, info.slot_addr(c.remote_slot)
    if not c.direct:
        return (np.array([[mine, at + trailer, outbox.device]], dtype=np.uint64),
                np.array([[theirs, at + trailer, info.device]], dtype=np.uint64))
    n = len(c.local)
    lens = c.local[:, 1].astype(np.uint64)
    local = np.empty((n + 1, 3), dtype=np.uint64)
    remote = np.empty((n + 1, 3), dtype=np.uint64)
    local[:n, 0], local[n, 0] = c.local[:, 0], mine + at
    remote[:n, 0] = theirs + np.cumsum(lens) - lens
    remote[n, 0] = theirs + at
    local[:n, 1] = remote[:n, 1] = lens
    local[n, 1] = remote[n, 1] = trailer
    local[:, 2], remote[:, 2] = outbox.device, info.device
    return local, remote
