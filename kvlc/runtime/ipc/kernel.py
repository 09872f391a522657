"""The GPU copy of a request's rows: ONE Triton kernel over a grid of (row, chunk) programs.

The row table is one int64 tensor: source addresses, then destination addresses, then lengths in
the kernel's units (8-byte words when ``WIDE``, else bytes), ``n`` of each. Addresses are plain
device addresses (a peer's mapped through CUDA IPC, ours, or pinned host memory through unified
addressing), so one launch moves rows between any storages of both sides.

Program ``(r, c)`` moves units ``[c * BLOCK, (c + 1) * BLOCK)`` of row ``r``: no loop, so every
program is short and the GPU keeps many of them in flight (a program per 8 KiB moved 0.82-0.86
of the device-to-device copy in an H200 probe (benchmarks/README.md), where one program looping over a
whole row moved 0.35-0.63). ``VEC``: every address and length is a multiple of 16 bytes, which
the compiler is told, so that a thread moves 16 bytes per load and store; ``EVEN``: every length
is a multiple of ``BLOCK`` units, so no program needs a mask. ``n`` is not specialized on (one
compiled kernel serves every row count).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n"])
def copy_grid(table, n, BLOCK: tl.constexpr, WIDE: tl.constexpr, VEC: tl.constexpr, EVEN: tl.constexpr):
    r = tl.program_id(0)
    start = tl.program_id(1).to(tl.int64) * BLOCK
    src = tl.load(table + r)
    dst = tl.load(table + n + r)
    size = tl.load(table + 2 * n + r)
    if VEC:
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
        size = tl.multiple_of(size, 2)  # units: 16 bytes are 2 words
    if WIDE:
        s = src.to(tl.pointer_type(tl.int64))
        d = dst.to(tl.pointer_type(tl.int64))
    else:
        s = src.to(tl.pointer_type(tl.uint8))
        d = dst.to(tl.pointer_type(tl.uint8))
    if start < size:
        o = start + tl.arange(0, BLOCK)
        if EVEN:
            tl.store(d + o, tl.load(s + o))
        else:
            m = o < size
            tl.store(d + o, tl.load(s + o, mask=m), mask=m)
