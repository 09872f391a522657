"""The same-host copy kernel (kvlc.runtime.ipc.kernel), run by Triton's interpreter on the CPU.

The kernel a GPU runs for every same-host request, with the row table the runtime builds for it
(:func:`kvlc.runtime.ipc.copy.row_table`: long rows cut into chunks, 8-byte words when every
address and length allows, bytes otherwise), on random rows between two buffers: every
destination row must equal its source, every other byte stay as it was.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kvlc.runtime.ipc.copy import row_table  # noqa: E402

KERNEL = Path(__file__).resolve().parents[2] / "kvlc" / "runtime" / "ipc" / "kernel.py"


@pytest.fixture(scope="module")
def interpreted():
    """kernel.py loaded with TRITON_INTERPRET=1 (its @jit then runs on the CPU), under another name."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        spec = importlib.util.spec_from_file_location("kvlc_ipc_kernel_interpreted", KERNEL)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    return mod


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_kernel_copies_random_rows(interpreted, data):
    size = 1 << 14
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    src = torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8))
    dst = torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8))
    unit = data.draw(st.sampled_from([1, 8, 16]))  # alignment of every offset and length
    slot = 1024
    n = data.draw(st.integers(1, 12))
    s_slots = data.draw(st.permutations(range(size // slot)))[:n]
    d_slots = data.draw(st.permutations(range(size // slot)))[:n]
    lens = [unit * data.draw(st.integers(1, (slot // 2) // unit)) for _ in range(n)]
    s_off = [unit * data.draw(st.integers(0, (slot // 2) // unit - 1)) for _ in range(n)]
    d_off = [unit * data.draw(st.integers(0, (slot // 2) // unit - 1)) for _ in range(n)]
    chunk = data.draw(st.sampled_from([64, 256, 1 << 18]))  # small chunks: long rows are cut
    srcs = np.array([src.data_ptr() + s * slot + o for s, o in zip(s_slots, s_off)], dtype=np.uint64)
    dsts = np.array([dst.data_ptr() + d * slot + o for d, o in zip(d_slots, d_off)], dtype=np.uint64)
    want = dst.numpy().copy()
    for s, so, d, do, ln in zip(s_slots, s_off, d_slots, d_off, lens):
        want[d * slot + do:d * slot + do + ln] = src.numpy()[s * slot + so:s * slot + so + ln]
    table, align = row_table(srcs, dsts, np.array(lens, dtype=np.uint64), chunk)
    values = [int(v) for v in np.concatenate([srcs, dsts, lens])]
    assert align == (16 if all(v % 16 == 0 for v in values) else 8 if all(v % 8 == 0 for v in values) else 1)
    rows = len(table) // 3
    interpreted.copy_rows[(rows,)](torch.from_numpy(table), rows, BLOCK=16 if align >= 8 else 128,
                                   WIDE=align >= 8, VEC=align >= 16)
    assert (dst.numpy() == want).all()


def _cpu_over(addr: int, words: int):
    """A CPU int64 tensor over memory at ``addr`` (what ``over`` makes on a GPU)."""
    import ctypes

    return torch.from_numpy(np.ctypeslib.as_array(ctypes.cast(addr, ctypes.POINTER(ctypes.c_int64)), (words,)))


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_chunk_kernel_copies_rows_cut_into_equal_chunks(interpreted, data):
    """Rows whose lengths share a chunk size go by copy_chunks: offsets from two 16-byte bases, one
    program per chunk; rows that do not cut so (an odd length, an unaligned address) are left to
    the general kernel (chunk_table says None)."""
    from kvlc.runtime.ipc.copy import CHUNKS, chunk_table

    size = 1 << 17
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    src = torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8))
    dst = torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8))
    chunk = data.draw(st.sampled_from(CHUNKS[1:]))  # 4 KiB and 1 KiB chunks keep the interpreter quick
    slot = 4 * chunk
    n = data.draw(st.integers(1, 6))
    lens = [chunk * data.draw(st.integers(1, 2)) for _ in range(n)]
    unit = data.draw(st.sampled_from([8, 16]))
    s_slots = data.draw(st.permutations(range(size // slot)))[:n]
    d_slots = data.draw(st.permutations(range(size // slot)))[:n]
    s_off = [unit * data.draw(st.integers(0, chunk // unit)) for _ in range(n)]
    d_off = [unit * data.draw(st.integers(0, chunk // unit)) for _ in range(n)]
    srcs = np.array([src.data_ptr() + s * slot + o for s, o in zip(s_slots, s_off)], dtype=np.uint64)
    dsts = np.array([dst.data_ptr() + d * slot + o for d, o in zip(d_slots, d_off)], dtype=np.uint64)
    want = dst.numpy().copy()
    for s, so, d, do, ln in zip(s_slots, s_off, d_slots, d_off, lens):
        want[d * slot + do:d * slot + do + ln] = src.numpy()[s * slot + so:s * slot + so + ln]
    c = chunk_table(srcs, dsts, np.array(lens, dtype=np.uint64))
    assert c is not None and c.words * 8 in (chunk, 2 * chunk)
    assert c.vec == all(int(v) % 16 == 0 for v in np.concatenate([srcs, dsts]))
    m = len(c.table) // 2
    assert m * c.words * 8 == sum(lens)
    interpreted.copy_chunks[(m,)](torch.from_numpy(c.table), m, _cpu_over(c.src_base, c.src_span),
                                  _cpu_over(c.dst_base, c.dst_span), CHW=c.words, VEC=c.vec)
    assert (dst.numpy() == want).all()
    assert chunk_table(srcs, dsts, np.array(lens, dtype=np.uint64) + np.uint64(8)) is None or chunk < 1024
    assert chunk_table(srcs + np.uint64(4), dsts, np.array(lens, dtype=np.uint64)) is None
