"""The GPU copy of a request's rows: ONE Triton kernel, one program per row (chunk).

The row table is one int64 tensor on the GPU: source addresses, then destination addresses,
then lengths, ``n`` of each. Addresses are plain device addresses (a peer's mapped through CUDA
IPC, or ours), so one launch moves rows between any storages of both sides. ``WIDE``: every
address and length is a multiple of 8, so the program moves 8-byte words; else bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def copy_rows(table, n, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    r = tl.program_id(0)
    src = tl.load(table + r)
    dst = tl.load(table + n + r)
    size = tl.load(table + 2 * n + r)
    offs = tl.arange(0, BLOCK)
    if WIDE:
        s = src.to(tl.pointer_type(tl.int64))
        d = dst.to(tl.pointer_type(tl.int64))
        size = size // 8
    else:
        s = src.to(tl.pointer_type(tl.uint8))
        d = dst.to(tl.pointer_type(tl.uint8))
    for start in range(0, size, BLOCK):
        o = start + offs
        m = o < size
        tl.store(d + o, tl.load(s + o, mask=m), mask=m)
