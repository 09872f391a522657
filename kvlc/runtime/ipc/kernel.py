"""The GPU copy of a request's rows: ONE Triton kernel, one program per row (chunk).

The row table is one int64 tensor on the GPU: source addresses, then destination addresses,
then lengths, ``n`` of each. Addresses are plain device addresses (a peer's mapped through CUDA
IPC, or ours), so one launch moves rows between any storages of both sides. ``WIDE``: every
address and length is a multiple of 8, so the program moves 8-byte words, else bytes; ``VEC``:
of 16 as well, which the compiler is told, so that it moves 16 bytes per load and store.
``n`` is not specialized on (one compiled kernel serves every row count).

:func:`copy_chunks` cuts rows into equal ``CHW``-word chunks (one program per chunk, no mask, no
loop, offsets in 8-byte words from two 16-byte base pointers). It was meant as the fast case and
measured slower on the H200 (benchmarks/README.md, run 3), so :class:`~kvlc.runtime.ipc.copy.GpuCopy`
does not take it by default; the kernel probe compares both.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n"])
def copy_rows(table, n, BLOCK: tl.constexpr, WIDE: tl.constexpr, VEC: tl.constexpr):
    r = tl.program_id(0)
    src = tl.load(table + r)
    dst = tl.load(table + n + r)
    size = tl.load(table + 2 * n + r)
    if VEC:
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
        size = tl.multiple_of(size, 16)
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


@triton.jit(do_not_specialize=["n"])
def copy_chunks(table, n, src, dst, CHW: tl.constexpr, VEC: tl.constexpr):
    r = tl.program_id(0)
    so = tl.load(table + r)
    do = tl.load(table + n + r)
    if VEC:
        so = tl.multiple_of(so, 2)
        do = tl.multiple_of(do, 2)
    offs = tl.arange(0, CHW)
    tl.store(dst + do + offs, tl.load(src + so + offs))
