"""The GPU copy of a request's rows: ONE Triton kernel, one program per row (rows cut at 256 KiB);
or, for a part in block form, one program per piece of each entry's row of each block id
(:func:`copy_blocks`: the addresses computed here, from ids, instead of read from a row table; the
partial tiles at a token range's ends are entries of their own, each reading a slot of one tile).

The row table is one int64 tensor: source addresses, then destination addresses, then lengths in
bytes, ``n`` of each. Addresses are plain device addresses (a peer's mapped through CUDA IPC, ours,
or pinned host memory through unified addressing), so one launch moves rows between any storages
of both sides. A program loops over its row ``BLOCK`` units at a time. ``WIDE``: every address and
length is a multiple of 8, so the program moves 8-byte words, else bytes; ``VEC``: of 16 as well,
which the compiler is told, so that a thread moves 16 bytes per load and store. ``n`` is not
specialized on (one compiled kernel serves every row count).

A grid of one program per 8 KiB of a row, tried instead, moved 0.34-0.52 of the device-to-device
copy on an H200 where this kernel moved 0.67-0.83 in the same run (every program of the grid
waits for its row's three table entries before it moves 8 KiB; here one wait serves 256 KiB):
benchmarks/README.md, run 4.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _move(src, dst, size, BLOCK: tl.constexpr, WIDE: tl.constexpr, VEC: tl.constexpr):
    """Copy ``size`` bytes from address ``src`` to ``dst``, ``BLOCK`` units at a time (8-byte words where
    ``WIDE``, 16-byte accesses told to the compiler where ``VEC``, else bytes)."""
    offs = tl.arange(0, BLOCK)
    if WIDE:
        s = src.to(tl.pointer_type(tl.int64))
        d = dst.to(tl.pointer_type(tl.int64))
        size = size // 8
        if VEC:  # told on the pointers and on the word count, so that loads and stores go 16 bytes at a time
            s = tl.multiple_of(s, 16)
            d = tl.multiple_of(d, 16)
            size = tl.multiple_of(size, 2)
    else:
        s = src.to(tl.pointer_type(tl.uint8))
        d = dst.to(tl.pointer_type(tl.uint8))
    for start in range(0, size, BLOCK):
        o = start + offs
        m = o < size
        tl.store(d + o, tl.load(s + o, mask=m), mask=m)


@triton.jit(do_not_specialize=["n"])
def copy_rows(table, n, BLOCK: tl.constexpr, WIDE: tl.constexpr, VEC: tl.constexpr):
    r = tl.program_id(0)
    _move(tl.load(table + r), tl.load(table + n + r), tl.load(table + 2 * n + r), BLOCK, WIDE, VEC)


@triton.jit(do_not_specialize=["write"])  # (one compiled kernel: the direct launch keeps it)
def copy_blocks(entries, ids, write, CHUNK: tl.constexpr, BLOCK: tl.constexpr, WIDE: tl.constexpr,
                VEC: tl.constexpr):
    """A part's rows computed from block ids (:mod:`kvlc.compiler.request.blocks`): program ``(k, e, c)``
    moves piece ``c`` (``CHUNK`` bytes) of entry ``e``'s row of its slot's ``k``-th tile.

    ``entries``: ten int64 per entry (one grid row each): local base and stride, the peer's base (in its mapped
    window) and stride, the row's length, its id slot, then kernel blocks per tile and the run's block in
    its tile, local then remote (tile ``k`` reads the slot's local id ``k * sub + block``). ``ids``: three
    int64 per slot (where its local ids start, where its remote ids start, how many tiles), then the ids.
    ``write`` != 0: the local rows are the sources."""
    k = tl.program_id(0)
    e = tl.program_id(1)
    c = tl.program_id(2)
    start = c.to(tl.int64) * CHUNK
    ent = entries + 10 * e
    slot = tl.load(ent + 5)
    count = tl.load(ids + 3 * slot + 2)
    size = tl.load(ent + 4)
    if (k < count) & (start < size):
        il = tl.load(ids + tl.load(ids + 3 * slot) + k * tl.load(ent + 6) + tl.load(ent + 7))
        ir = tl.load(ids + tl.load(ids + 3 * slot + 1) + k * tl.load(ent + 8) + tl.load(ent + 9))
        a = tl.load(ent) + il * tl.load(ent + 1) + start
        b = tl.load(ent + 2) + ir * tl.load(ent + 3) + start
        _move(tl.where(write != 0, a, b), tl.where(write != 0, b, a), tl.minimum(size - start, CHUNK),
              BLOCK, WIDE, VEC)
