"""The same-host copy kernel (kvlc.runtime.ipc.kernel), run by Triton's interpreter on the CPU.

The kernel a GPU runs for every same-host request, with the row table the runtime builds for it
(:func:`kvlc.runtime.ipc.copy.row_table`: long rows cut into chunks, 8-byte words when every
address and length allows, bytes otherwise), on random rows between two buffers: every
destination row must equal its source, every other byte stay as it was.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kvlc.runtime.ipc.copy import row_table  # noqa: E402
from testkit.gpu_standin import TorchStandIn  # noqa: E402


@settings(max_examples=40, deadline=None)
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
    g = row_table(srcs, dsts, np.array(lens, dtype=np.uint64), chunk)
    values = [int(v) for v in np.concatenate([srcs, dsts, lens])]
    assert g.vec == all(v % 16 == 0 for v in values)
    assert g.wide == all(v % 8 == 0 for v in values)
    assert g.rows == sum(-(-ln // chunk) for ln in lens)  # every row cut at ``chunk`` bytes
    interpreted.copy_rows[(g.rows,)](torch.from_numpy(g.table), g.rows, BLOCK=16 if g.wide else 128,
                                     WIDE=g.wide, VEC=g.vec)
    assert (dst.numpy() == want).all()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 1 << 22), min_size=1, max_size=40), st.sampled_from([16, 1 << 18]))
def test_cut_rows_cover_every_byte_once(lens, chunk):
    """The launch's rows (long ones cut) cover each row's bytes exactly once, in order, none longer
    than ``chunk``."""
    lens = np.array(lens, dtype=np.uint64)
    src = np.cumsum(np.concatenate([[0], lens[:-1]])).astype(np.uint64) + np.uint64(1 << 40)
    dst = src + np.uint64(1 << 44)
    g = row_table(src, dst, lens, chunk)
    n = g.rows
    s, d, u = (g.table[i * n:(i + 1) * n].view(np.uint64) for i in range(3))
    assert int(u.sum()) == int(lens.sum()) and int(u.max()) <= chunk
    assert (d - s == np.uint64(1 << 44)).all()
    assert (s[1:] == s[:-1] + u[:-1]).all() and int(s[0]) == 1 << 40  # contiguous source, in order


@pytest.mark.parametrize("name", ["copy_rows", "copy_blocks"])
@pytest.mark.parametrize("wide, vec, want", [(True, True, "v2.b64"), (True, False, "b64"), (False, False, "b8")])
def test_kernel_compiles_to_the_widest_accesses_its_rows_allow(wide, vec, want, name):
    """The kernel compiled for an H100/H200 (sm_90; PTX only, no GPU needed): rows whose addresses and
    lengths are multiples of 16 move 16 bytes per load and store, of 8 eight, else bytes. (The 16-byte
    hints once sat on the integer addresses only and the compiler emitted 8-byte accesses.)"""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvlc.runtime.ipc import kernel

    consts = {"BLOCK": 1024 if wide else 8192, "WIDE": wide, "VEC": vec}
    if name == "copy_rows":
        sig, attrs = {"table": "*i64", "n": "i32"}, {(0,): [["tt.divisibility", 16]]}
    else:  # (the block kernel: both tables 16-byte aligned, the direction a plain int)
        sig = {"entries": "*i64", "ids": "*i64", "write": "i32", "n": "i32", "rows_at": "i32", "rows": "i32"}
        attrs = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}
        sig["CHUNK"], consts["CHUNK"] = "constexpr", 1 << 18
    sig.update({c: "constexpr" for c in ("BLOCK", "WIDE", "VEC")})
    src = ASTSource(fn=getattr(kernel, name), signature=sig, constexprs=consts, attrs=attrs)
    try:
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    except Exception as exc:  # noqa: BLE001 - a Triton build without its NVIDIA backend
        pytest.skip(f"Triton cannot compile for sm_90 here: {exc}")
    stores = set(re.findall(r"st\.global\.([\w.]+)", ptx))
    loads = set(re.findall(r"ld\.global\.([\w.]+)", ptx)) - {"b64"}  # (the tables' entries are b64 loads)
    assert stores == {want}, stores
    assert loads <= {want}, loads


class _Kernel:
    """The interpreted kernel behind ``copy_rows[grid](...)``, counting launches; ``fail_host_table``:
    refuse tables that lie in the (stand-in) pinned ring, as a GPU that cannot read host memory would."""

    def __init__(self, interpreted, ring_of=None):
        self.interpreted, self.launches, self.ring_of = interpreted, 0, ring_of

    @property
    def copy_rows(self):
        return self._kernel("copy_rows")

    @property
    def copy_blocks(self):
        return self._kernel("copy_blocks")

    def _kernel(self, name: str):
        outer = self

        class _Grid:
            def __getitem__(self, grid):
                def run(*args, **kw):
                    kw.pop("num_warps", None)
                    cp = outer.ring_of() if outer.ring_of else None
                    if cp is not None and cp.host_table:
                        raise RuntimeError("pointer argument cannot be accessed from Triton (cpu tensor?)")
                    outer.launches += 1
                    getattr(outer.interpreted, name)[grid](*args, **kw)
                return run
        return _Grid()


@settings(max_examples=8, deadline=None)
@given(st.data())
def test_gpu_copy_moves_every_row_through_its_ring(interpreted, data):
    """GpuCopy's own logic on a CPU (Triton's interpreter as the GPU, torch.cuda stood in for): warm-up,
    the row table written into the ring and read there by the kernel, the ring wrapping around over
    many requests, tables larger than the ring: every destination row equals its source, nothing else
    changes."""
    from kvlc.runtime.ipc.copy import GpuCopy

    class Small(GpuCopy):
        RING_WORDS = 256  # wraps after a few requests; a request of more than 85 rows gets its own table

    kern = _Kernel(interpreted)
    cp = Small(0, block_words=64, torch=TorchStandIn(), kernel=kern)
    cp.warm()
    # two passes over five warm-up lengths (Triton's call, then the direct launch, which the interpreter has
    # no compiled kernel for: Triton's call again), then the block kernel's three checks, twice
    assert cp.host_table and cp.vec and cp.blocks and kern.launches == 16
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    size, slot = 1 << 16, 512
    src = torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8))
    dst = torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8))
    want = dst.numpy().copy()
    sizes = [data.draw(st.integers(1, 60)) for _ in range(data.draw(st.integers(1, 6)))] + [100]  # (100: own table)
    for n in sizes:
        s_slots = rng.choice(size // slot, n, replace=False)
        d_slots = rng.choice(size // slot, n, replace=False)
        unit = data.draw(st.sampled_from([1, 8, 16]))
        lens = rng.integers(1, slot // unit + 1, n) * unit
        for s, d, ln in zip(s_slots, d_slots, lens):
            want[d * slot:d * slot + ln] = src.numpy()[s * slot:s * slot + ln]
        cp.start((src.data_ptr() + s_slots * slot).astype(np.uint64), (dst.data_ptr() + d_slots * slot).astype(np.uint64),
                 lens.astype(np.uint64))
        assert (dst.numpy() == want).all()


class _FlatTiles(_Kernel):
    """A block kernel that reads every tile as one kernel block (the sub-block fields of its entries ignored):
    right for same-layout parts, wrong where a tile spans several blocks."""

    @property
    def copy_blocks(self):
        inner = self._kernel("copy_blocks")

        class _Grid:
            def __getitem__(self, grid):
                def run(entries, *args, **kw):
                    flat = entries.clone().view(-1, 10)
                    flat[:, 6:] = torch.tensor([1, 0, 1, 0])
                    return inner[grid](flat.view(-1), *args, **kw)
                return run
        return _Grid()


def test_gpu_copy_warm_up_turns_the_block_form_off_where_its_kernel_copies_wrong(interpreted):
    """Warm-up checks the block kernel by content, a tile of two kernel blocks included: a kernel that gets
    those wrong is not used (parts move by their rows); the row kernel stays."""
    from kvlc.runtime.ipc.copy import GpuCopy

    cp = GpuCopy(0, block_words=64, torch=TorchStandIn(), kernel=_FlatTiles(interpreted))
    cp.warm()
    assert not cp.blocks and cp.host_table and cp.vec  # (the right kernel keeps it: the ring tests below)


def test_gpu_copy_warm_up_drops_the_host_table_where_the_kernel_cannot_read_it(interpreted):
    """Where the kernel cannot read its table in pinned host memory, warm-up says so once and uploads
    tables instead; copies stay right."""
    from kvlc.runtime.ipc.copy import GpuCopy

    holder = {}
    kern = _Kernel(interpreted, ring_of=lambda: holder.get("cp"))
    cp = GpuCopy.__new__(GpuCopy)
    holder["cp"] = cp
    GpuCopy.__init__(cp, 0, block_words=16, torch=TorchStandIn(), kernel=kern)
    cp.warm()
    assert not cp.host_table and cp.vec
    a = torch.arange(64, dtype=torch.uint8)
    b = torch.zeros(64, dtype=torch.uint8)
    one = lambda v: np.array([v], dtype=np.uint64)  # noqa: E731
    cp.start(one(a.data_ptr()), one(b.data_ptr()), one(48))
    assert (b.numpy()[:48] == a.numpy()[:48]).all() and not b.numpy()[48:].any()


def test_gpu_copy_keeps_the_callers_stream_object_while_the_stream_stays(interpreted):
    """The caller's stream is asked by its raw handle each start; the Stream object is built again only when
    the handle changes (an engine that switched streams gets its new stream waited for)."""
    from types import SimpleNamespace

    from kvlc.runtime.ipc.copy import GpuCopy

    t = TorchStandIn()
    handle = {"now": 7}
    t._C = SimpleNamespace(_cuda_getCurrentRawStream=lambda device: handle["now"])
    built = []
    make = t.cuda.current_stream
    t.cuda.current_stream = lambda device=None: built.append(make(device)) or built[-1]
    cp = GpuCopy(0, block_words=16, torch=t, kernel=_Kernel(interpreted))
    first = cp._caller_stream()
    assert cp._caller_stream() is first and len(built) == 1
    handle["now"] = 9
    second = cp._caller_stream()
    assert second is not first and len(built) == 2 and cp._caller_stream() is second


def _block_case(data, rng, size: int, cell: int):
    """A random part in block form over two buffers of ``size`` bytes: entries in cells of ``cell`` bytes (entry
    ``e``, id ``i``: cell ``e * ids + i`` on each side, so no two rows overlap), one or two id slots, each with
    one or two kernel blocks per tile on each side (an entry reads one of them), of up to five tiles (one: as a
    partial tile's slot at a range's end)."""
    unit = data.draw(st.sampled_from([1, 8, 16]))
    entries = data.draw(st.integers(1, 3))
    nb = size // cell // entries  # ids per side
    slots = data.draw(st.integers(1, 2))
    subs = [(data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2))) for _ in range(slots)]
    counts = [data.draw(st.integers(0, min(nb // 2, 5))) for _ in range(slots)]
    head, ids, at = [], [], 3 * slots
    for n, (ls, rs) in zip(counts, subs):
        loc, rem = rng.permutation(nb)[:n * ls], rng.permutation(nb)[:n * rs]
        head += [at, at + n * ls, n]
        ids += [*loc.tolist(), *rem.tolist()]
        at += n * (ls + rs)
    rows = []
    for e in range(entries):
        lo = unit * data.draw(st.integers(0, (cell // 2) // unit - 1))
        ro = unit * data.draw(st.integers(0, (cell // 2) // unit - 1))
        length = unit * data.draw(st.integers(1, (cell // 2) // unit))
        slot = data.draw(st.integers(0, slots - 1))
        ls, rs = subs[slot]
        rows.append((e * nb * cell + lo, cell, e * nb * cell + ro, cell, length, slot,
                     ls, data.draw(st.integers(0, ls - 1)), rs, data.draw(st.integers(0, rs - 1))))
    return unit, np.array(rows, dtype=np.int64), np.array(head + ids, dtype=np.int64)


def _block_reference(src: np.ndarray, dst: np.ndarray, rows: np.ndarray, ids: np.ndarray, write: bool
                     ) -> np.ndarray:
    """What the block kernel must leave in ``dst``: entry by entry, id by id (local side: offsets into the
    written buffer when ``write`` is false)."""
    out = dst.copy()
    for lb, ls, rb, rs, length, slot, lsub, lblk, rsub, rblk in rows.tolist():
        la, ra, n = ids[3 * slot:3 * slot + 3].tolist()
        for k in range(n):
            il, ir = int(ids[la + k * lsub + lblk]), int(ids[ra + k * rsub + rblk])
            a, b = lb + il * ls, rb + ir * rs
            s, d = (a, b) if write else (b, a)
            out[d:d + length] = src[s:s + length]
    return out


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_block_kernel_copies_random_forms(interpreted, data):
    """copy_blocks on random entries and ids, both directions, rows cut into pieces: every destination row equals
    its source (computed from the ids here, in numpy), every other byte unchanged."""
    size, cell = 1 << 14, 1024
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    src = torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8))
    dst = torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8))
    unit, rows, ids = _block_case(data, rng, size, cell)
    write = data.draw(st.booleans())
    want = _block_reference(src.numpy(), dst.numpy(), rows, ids, write)
    s_base, d_base = src.data_ptr(), dst.data_ptr()
    moved = rows.copy()
    moved[:, 0] += s_base if write else d_base   # the local side: the sources of a write
    moved[:, 2] += d_base if write else s_base
    chunk = data.draw(st.sampled_from([64, 256, 1 << 18]))
    count = max(1, int(ids[2:ids[0]:3].max()))
    pieces = -(-int(rows[:, 4].max()) // chunk)
    interpreted.copy_blocks[(count, len(rows), pieces)](
        torch.from_numpy(moved.reshape(-1)), torch.from_numpy(ids), int(write), CHUNK=chunk,
        BLOCK=16 if unit > 1 else 128, WIDE=unit > 1, VEC=unit == 16)
    assert (dst.numpy() == want).all()


@settings(max_examples=4, deadline=None)
@given(st.data())
def test_gpu_copy_moves_block_forms_through_its_ring(interpreted, data):
    """GpuCopy.start_blocks on a CPU (the interpreter as the GPU): warm-up checks the block kernel, the entries go
    up once per table, each request's ids through the ring; every byte as the numpy reference says."""
    from kvlc.runtime.ipc.copy import ENTRY, BlockLaunch, GpuCopy

    class Small(GpuCopy):
        RING_WORDS = 64

    cp = Small(0, block_words=64, torch=TorchStandIn(), kernel=_Kernel(interpreted))
    cp.warm()
    assert cp.blocks
    size, cell = 1 << 14, 1024
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    src = torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8))
    dst = torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8))
    unit, rows, ids = _block_case(data, rng, size, cell)
    moved = rows.copy()
    moved[:, 0] += src.data_ptr()
    moved[:, 2] += dst.data_ptr()
    assert rows.shape[1] == ENTRY
    kept: dict = {}  # what the route shares between the launches of one table and peer
    count = max(1, int(ids[2:ids[0]:3].max()))
    for _ in range(3):  # the same table again: its entries went up once
        want = _block_reference(src.numpy(), dst.numpy(), rows, ids, True)
        b = BlockLaunch(moved.reshape(-1), ids, count, 1, True, unit % 8 == 0, unit % 16 == 0, kept)
        cp.start_blocks(b).event.synchronize()
        assert (dst.numpy() == want).all()
        assert list(kept) == [0]
        src.copy_(torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8)))
