"""The per-request path in C (kvlc/compiler/request/native) against its Python reference.

Hypothesis draws the same random engine pairs as test_pair_properties (TP, block sizes, dim
orders, MLA, Mamba state, sliding windows, shared regions, fp4) and a request over a random
token range; the rows the C library writes (``emit_native``) must equal the reference's
(``emit`` with the library off) part by part, row by row, and both must refuse the same ids
with the same words. The library must be built wherever a C compiler is (CI is such a machine).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import kvlc
from kvlc import bind
from kvlc.compiler.pairing.pair import pair
from kvlc.compiler.request import native
from kvlc.compiler.request.check import check_request
from kvlc.compiler.request.instantiate import emit
from kvlc.compiler.request.native_rows import emit_native
from kvlc.errors import TransferError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_model import Engine  # noqa: E402
from test_pair_properties import PROPS, pair_case  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

needs_native = pytest.mark.skipif(native.library() is None, reason=f"kvlc's C path: {native.status()}")


def test_built_where_a_compiler_is():
    """`pip install -e .` builds the library on a machine with a C compiler; a missing build is a CI failure."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: the Python reference runs")
    if os.environ.get("KVLC_NATIVE") == "0":
        pytest.skip("KVLC_NATIVE=0: the reference is asked for")
    assert native.library() is not None, native.status()
    assert native.status().startswith("native")


def test_switched_off_by_environment():
    """KVLC_NATIVE=0 runs the reference, and says so."""
    code = "from kvlc.compiler.request import native; print(native.library() is None, native.status())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KVLC_NATIVE": "0"}, cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("True off (KVLC_NATIVE=0)")


def _reference(bound, req):
    with pytest.MonkeyPatch.context() as m:
        m.setattr(native, "library", lambda: None)
        return emit(bound, req)


def _same(got: dict, want: dict) -> None:
    assert list(got) == list(want), "parts differ (or their order)"
    for key in want:
        assert got[key].local.dtype == want[key].local.dtype == np.uint64
        assert np.array_equal(got[key].local, want[key].local), f"part {key}: local rows differ"
        assert np.array_equal(got[key].remote, want[key].remote), f"part {key}: remote rows differ"
        assert got[key].nbytes == want[key].nbytes == int(want[key].local[:, 1].sum())


def _ranged(plan, ids: dict, start: int) -> dict:
    """The ids of blocks that tokens [start, ...) touch, per group, from the ids of [0, ...)."""
    out = {}
    for g, got in ids.items():
        group = plan.group(g)
        bs = group.block_size if group.kind != "mamba" else None
        out[g] = list(got) if bs is None else list(got)[start // bs:]
    return out


def _request(prog, lids, rids, tokens):
    try:
        return check_request(prog, lids, rids, tokens=tokens) if isinstance(tokens, tuple) else \
            check_request(prog, lids, rids, tokens)
    except TransferError:
        return None


def pair_requests(case, data):
    """Each rank's bound program of a drawn pair, both directions, with the case's request over a drawn
    token range: (bound, checked request, local ids, remote ids, tokens); requests refused are left out."""
    cons, prod = kvlc.compile_spec(case.cons.text), kvlc.compile_spec(case.prod.text)
    ranged = data.draw(st.booleans()) and not isinstance(case.tokens_arg, dict)
    start = data.draw(st.integers(0, case.tokens_arg - 1)) if ranged else 0
    tokens = (start, case.tokens_arg) if ranged else case.tokens_arg
    C, P = Engine(cons, 0, False), Engine(prod, 1, True)
    for local, remote, L, R, direction, lids, rids in (
            (cons, prod, C, P, "READ", case.cids, case.pids), (prod, cons, P, C, "WRITE", case.pids, case.cids)):
        lids, rids = (_ranged(local, lids, start), _ranged(remote, rids, start)) if ranged else (lids, rids)
        for rank in range(local.parallel.tp_size):
            prog = pair(local, remote, local_rank=rank, direction=direction)
            bound = bind(prog, L.rank_bases(rank), {p: R.rank_bases(p) for p in prog.peer_ranks})
            req = _request(prog, lids, rids, tokens)
            if req is not None:
                yield bound, req, lids, rids, tokens


@needs_native
@settings(PROPS, max_examples=150)
@given(case=pair_case(), data=st.data())
def test_native_rows_equal_the_reference(case, data):
    """Every part's rows, for every rank and both directions, with counts and token ranges."""
    checked = 0
    for bound, req, lids, rids, tokens in pair_requests(case, data):
        _same(emit_native(bound, req), _reference(bound, req))
        again = _request(bound.program, _reversed(lids), _reversed(rids), tokens)  # same shape: its cached layout
        if again is not None:
            _same(emit_native(bound, again), _reference(bound, again))
        checked += 1
    assume(checked)


def _reversed(ids: dict) -> dict:
    """Other ids of the same counts (each group's in reverse order): a request of the same shape."""
    return {g: list(v)[::-1] for g, v in ids.items()}


@needs_native
@settings(deadline=None, max_examples=60)
@given(data=st.data())
def test_requests_of_one_shape_share_a_layout(data):
    """Requests of one shape (token range, id counts) reuse one piece layout; each one's rows still equal
    the reference's, whatever its ids."""
    plan, bound = _llama()
    cap = plan.regions[0].capacity
    n = data.draw(st.integers(1, 300))
    start = data.draw(st.integers(0, 15))
    stop = data.draw(st.integers(max(start + 1, 16 * (n - 1) + 1), 16 * n))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    for _ in range(3):
        lids, rids = rng.permutation(cap)[:n], rng.permutation(cap)[:n]
        if data.draw(st.booleans()):
            lids = np.arange(n) + int(rng.integers(0, cap - n + 1))
        req = check_request(bound.program, {"full": lids}, {"full": rids}, tokens=(start, stop))
        _same(emit_native(bound, req), _reference(bound, req))


def _llama():
    plan = kvlc.compile_spec(ROOT / "layouts/llama-3.1-8b.yaml")
    prog = pair(plan, plan, local_rank=0, direction="WRITE")
    return plan, bind(prog, {s.name: 1 << 40 for s in plan.storages}, {0: {s.name: 2 << 40 for s in plan.storages}})


@needs_native
@settings(deadline=None, max_examples=60)
@given(data=st.data())
def test_large_scattered_requests(data):
    """Thousands of ids in pool order (what an engine hands out after warm-up): C and reference agree."""
    plan, bound = _llama()
    cap = plan.regions[0].capacity
    n = data.draw(st.integers(129, 1024))
    stop = data.draw(st.integers(16 * (n - 1) + 1, 16 * n))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    lids = rng.permutation(cap)[:n]
    rids = np.sort(rng.permutation(cap)[:n]) if data.draw(st.booleans()) else rng.permutation(cap)[:n]
    req = check_request(bound.program, {"full": lids}, {"full": rids}, stop)
    _same(emit_native(bound, req), _reference(bound, req))


@needs_native
def test_a_table_keeps_a_bounded_number_of_shapes(monkeypatch):
    """Past SHAPES request shapes the oldest layout is forgotten; rows stay the reference's."""
    from kvlc.compiler.request import native_rows

    monkeypatch.setattr(native_rows, "SHAPES", 4)
    plan, bound = _llama()
    for n in list(range(1, 10)) + [2, 3]:
        req = check_request(bound.program, {"full": list(range(n))}, {"full": list(range(5, 5 + n))}, 16 * n - 3)
        _same(emit_native(bound, req), _reference(bound, req))
        assert len(native_rows.native_table(bound).shapes) <= 4


@needs_native
@pytest.mark.parametrize("bad, words", [
    (lambda ids, cap: ids + [cap], "out of range"),
    (lambda ids, cap: [-1] + ids, "out of range"),
    (lambda ids, cap: ids + [ids[7]], "appears 2 times"),
])
def test_refusals_are_the_reference_words(monkeypatch, bad, words):
    """Above the size checked in Python the C check decides; the refusal is still the reference's sentence."""
    plan, bound = _llama()
    cap = plan.regions[0].capacity
    ids = bad(list(range(3, 3 + 200)), cap)
    tokens = 16 * len(ids)
    with pytest.raises(TransferError, match=words) as native_err:
        check_request(bound.program, {"full": list(range(len(ids)))}, {"full": ids}, tokens)
    with monkeypatch.context() as m:
        m.setattr(native, "library", lambda: None)
        with pytest.raises(TransferError) as ref_err:
            check_request(bound.program, {"full": list(range(len(ids)))}, {"full": ids}, tokens)
    assert str(native_err.value) == str(ref_err.value)


needs_ids = pytest.mark.skipif(native.ids_library() is None, reason=f"ids.c: {native.ids_status()}")


def _outcome(prog, lids, rids, tokens):
    """check_request's kernel ids per side and link, or its refusal's words."""
    try:
        req = check_request(prog, lids, rids, tokens=tokens)
    except TransferError as exc:
        return str(exc)
    return {side: {k: v.tolist() for k, v in getattr(req, side).items()} for side in ("local", "remote")}


_ITEM = st.one_of(st.sampled_from([-1, 0, 63, 64, 65, 2**63 - 1, 2**63, -2**63, -2**63 - 1, True, False, 3.0, None,
                                   "7", np.int64(5), np.uint8(64)]), st.integers(-2**66, 2**66))


@needs_ids
@settings(deadline=None, max_examples=150)
@given(data=st.data())
def test_ids_read_in_c_equal_the_reference(data):
    """ids.c reads the engine's lists (or tuples) of block ids: for ids of any value and type (plain ints of
    every size, repeats, bools, numpy ints, floats, None, str), any count and any token range, the kernel ids
    or the refusal's words are the reference's (check.py's, with ids.c off). Both sides, both directions,
    token groups of a sliding-window plan (ids before the window are placeholders) and state groups."""
    name = data.draw(st.sampled_from(["llama-3.1-8b", "gpt-oss-120b-tp4", "nemotron-h-8b-tp2"]))
    plan = kvlc.compile_spec(ROOT / f"layouts/{name}.yaml")
    plan = plan.model_copy(update={"regions": tuple(r.model_copy(update={"num_blocks": 64}) for r in plan.regions)})
    prog = pair(plan, plan, local_rank=0, direction=data.draw(st.sampled_from(["READ", "WRITE"])))
    stop = data.draw(st.integers(1, 64 * min(g.block_size for g in plan.groups if g.block_size)))
    start = data.draw(st.integers(0, stop - 1))
    sides = []
    for _ in range(2):
        ids = {}
        for g in plan.groups:
            n = -(-stop // g.block_size) - start // g.block_size if g.kind != "mamba" else data.draw(st.integers(1, 4))
            n = max(0, n + data.draw(st.sampled_from([0, 0, 0, 0, -1, 1])))
            top = data.draw(st.sampled_from([63, 64]))  # 64 blocks a region: id 64 is the first out of range
            plain = data.draw(st.lists(st.integers(0, top), min_size=n, max_size=n, unique=data.draw(st.booleans())))
            if n and data.draw(st.integers(0, 3)) == 0:  # an odd item somewhere
                plain[data.draw(st.integers(0, n - 1))] = data.draw(_ITEM)
            ids[g.name] = tuple(plain) if data.draw(st.booleans()) else plain
        sides.append(ids)
    got = _outcome(prog, *sides, (start, stop))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(native, "ids_library", lambda: None)
        want = _outcome(prog, *sides, (start, stop))
    assert got == want


@needs_ids
def test_ids_bitmap_is_clear_between_calls():
    """A repeat found early leaves no bit set: the next list with those ids is not taken for a repeat."""
    cap = 1 << 16
    ids = list(range(100, 200)) + [150] + list(range(300, 400))
    assert native.seq_ids(ids, 0, len(ids), cap, True) is None          # 150 twice
    again = list(range(100, 200)) + list(range(300, 400))
    assert native.seq_ids(again, 0, len(again), cap, True).tolist() == again
    assert native.seq_ids(again + [cap], 0, len(again) + 1, cap, True) is None   # out of range
    assert native.seq_ids(again + [cap], 0, len(again), cap, True).tolist() == again + [cap]  # outside [lo, hi)
    # a region of more blocks than the bitmap keeps (2**26): repeats are left to the reference
    assert native.seq_ids(again, 0, len(again), 1 << 30, True) is None
    assert native.seq_ids(again, 0, len(again), 1 << 30, False).tolist() == again


@needs_native
@settings(deadline=None, max_examples=200)
@given(data=st.data())
def test_breaks_in_c_equal_the_reference(data):
    """rows.c's count of a merging slot's row breaks (``BlockCopy.runs``) against its numpy reference, on runs of
    consecutive ids broken at random places (and ids near int64's ends, where +1 wraps), at any offset."""
    from kvlc.compiler.request.blocks import _breaks

    n = data.draw(st.integers(0, 40))
    at = data.draw(st.integers(0, 5))
    start = data.draw(st.sampled_from([0, 7, (1 << 63) - 3, -(1 << 63)]))
    wrap = lambda v: (v + (1 << 63)) % (1 << 64) - (1 << 63)  # noqa: E731 - int64 arithmetic
    ids = [wrap(start + (i % n)) for i in range(2 * n)]
    for i in data.draw(st.lists(st.integers(0, max(0, 2 * n - 1)), max_size=6)) if n else []:
        ids[i] = data.draw(st.integers(-(1 << 63), (1 << 63) - 1))
    arr = np.array([0] * at + ids + [0] * data.draw(st.integers(0, 3)), dtype=np.int64)
    assert native.breaks(arr, at, n) == _breaks(arr, at, n)
    with pytest.raises(ValueError, match="lie outside"):
        native.breaks(arr, at, len(arr) + 1)


@needs_native
@pytest.mark.parametrize("n, cap, distinct, want", [
    (0, 1, True, True), (5, 5, True, True), (5, 4, False, False), (300, 1 << 20, True, True)])
def test_ids_ok(n, cap, distinct, want):
    ids = np.arange(n, dtype=np.int64)
    assert native.ids_ok(ids, cap, distinct) is want
    if n > 1:
        twice = ids.copy()
        twice[-1] = twice[0]
        assert native.ids_ok(twice, cap, True) is False
        assert native.ids_ok(twice, cap, False) is bool(twice.max() < cap)


@needs_native
def test_threads_sharing_a_binding_get_their_own_rows():
    """Requests of one binding from several threads at once (an engine's thread pushing while the side
    channel serves a pull): partial tiles add to the shared table while others read it; every
    request's rows still equal the reference's."""
    import threading

    plan, bound = _llama()
    cap = plan.regions[0].capacity
    rng = np.random.default_rng(7)
    reqs = []
    for k in range(60):
        n = int(rng.integers(2, 64))
        stop = 16 * (n - 1) + int(rng.integers(1, 16))  # a partial last tile: a new tail most times
        reqs.append(check_request(bound.program, {"full": rng.permutation(cap)[:n]},
                                  {"full": rng.permutation(cap)[:n]}, stop))
    want = [_reference(bound, r) for r in reqs]
    problems = []

    def run(which):
        for i in which:
            try:
                _same(emit_native(bound, reqs[i]), want[i])
            except AssertionError as exc:
                problems.append(f"request {i}: {exc}")

    threads = [threading.Thread(target=run, args=(range(t, len(reqs), 4),)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert problems == []


@given(st.integers(0, 64), st.integers(0, 3), st.booleans(), st.sampled_from(["int64", "uint8", "uint64"]))
def test_address_is_the_first_element_of_any_array(n, start, writable, dtype):
    """kvlc.clib.address (the buffer protocol where it can, numpy's ctypes.data where not): the first element's
    address for writable, read-only, empty and offset arrays alike."""
    from kvlc.clib import address

    base = np.arange(n + start, dtype=dtype)
    a = base[start:]
    if not writable:
        a = np.frombuffer(a.tobytes(), dtype=dtype)
    assert address(a) == a.ctypes.data
    if len(a):
        a_copy = np.array(a)
        a_copy[:] = 0
        assert address(a_copy) == a_copy.__array_interface__["data"][0]
