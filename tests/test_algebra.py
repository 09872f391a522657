"""The layout algebra and the TP mapping, against brute force.

* :func:`strided_runs` describes exactly the byte map (local byte → remote byte) that
  element-by-element enumeration of the strided copy gives;
* :func:`merge_runs` and :func:`coalesce_rows` keep the byte map and leave no two runs
  (rows) that could merge;
* :func:`heads_of` / :func:`assign`: every consumer head is read exactly once, from a producer
  rank that holds it; replicas are spread over the consumer ranks that need them;
  ``consumer_counts`` equals an independent count of readers per producer rank.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvlc
from kvlc.compiler.algebra.copies import SUB_SHIFT, coalesce_dims, coalesce_rows, merge_runs, strided_runs
from kvlc.compiler.pairing.pair import pair
from kvlc.compiler.pairing.tp import assign, heads_of

PROPS = settings(deadline=None, max_examples=150, suppress_health_check=list(HealthCheck))


# ============================================================================ strided copies
@st.composite
def strided_copy(draw):
    """A copy of a sub-box of one dense array between two layouts of it (dim orders, padding)."""
    n = draw(st.integers(1, 4))
    sizes = [draw(st.integers(1, 4)) for _ in range(n)]
    itemsize = draw(st.sampled_from((1, 2, 4)))

    def layout():
        order = draw(st.permutations(range(n)))
        strides = [0] * n
        acc = itemsize
        for i in reversed(order):           # last in ``order`` innermost
            strides[i] = acc
            acc *= sizes[i] + draw(st.sampled_from((0, 0, 0, 1, 3)))   # padding after a dim
        return strides

    sl, sr = layout(), layout()
    dims, off_l, off_r = [], draw(st.integers(0, 9)), draw(st.integers(0, 9))
    for size, a, b in zip(sizes, sl, sr):
        lo = draw(st.integers(0, size - 1))
        hi = draw(st.integers(lo + 1, size))
        off_l += lo * a
        off_r += lo * b
        dims.append((hi - lo, a, b))
    return dims, off_l, off_r, itemsize


def enumerate_bytes(dims, off_l, off_r, itemsize) -> set:
    out = set()
    for idx in itertools.product(*(range(d[0]) for d in dims)):
        l = off_l + sum(i * d[1] for i, d in zip(idx, dims))
        r = off_r + sum(i * d[2] for i, d in zip(idx, dims))
        out.update((l + b, r + b) for b in range(itemsize))
    return out


def run_bytes(lo, ro, n) -> list:
    lens = np.broadcast_to(np.asarray(n), np.shape(lo))
    return [(int(a) + j, int(b) + j) for a, b, m in zip(lo, ro, lens) for j in range(int(m))]


@PROPS
@given(strided_copy())
def test_strided_runs_equal_enumeration(copy):
    """strided_runs covers exactly the element-by-element byte map, each byte once."""
    dims, off_l, off_r, itemsize = copy
    lo, ro, n = strided_runs(dims, off_l, off_r, itemsize)
    got = run_bytes(lo, ro, n)
    assert len(got) == len(set(got))
    assert set(got) == enumerate_bytes(dims, off_l, off_r, itemsize)
    assert n % itemsize == 0 and len(lo) == len(ro)


@PROPS
@given(strided_copy())
def test_strided_runs_are_maximal_and_dims_coalesced(copy):
    """No two runs of strided_runs continue each other on both sides; coalesce_dims keeps the element set."""
    dims, off_l, off_r, itemsize = copy
    lo, ro, n = strided_runs(dims, off_l, off_r, itemsize)
    start = {int(a): int(b) for a, b in zip(lo, ro)}
    for a, b in zip(lo.tolist(), ro.tolist()):
        assert start.get(a + n) != b + n, "two runs that continue each other"
    merged = coalesce_dims(dims)
    assert enumerate_bytes(merged, off_l, off_r, itemsize) == enumerate_bytes(dims, off_l, off_r, itemsize)
    assert all(size > 1 for size, _, _ in merged)


def test_strided_runs_docstring_cases():
    """Hand-checked: a head slice of HND is one run; NHD with a head slice is one run per token."""
    # HND (head, token, dim): heads 2-3 of 4 locally, 2 heads remotely; 16 tokens, dim 8, bf16
    lo, ro, n = strided_runs([(2, 256, 256), (16, 16, 16), (8, 2, 2)], 512, 0, 2)
    assert (lo.tolist(), ro.tolist(), n) == ([512], [0], 512)
    # HND with different token counts per block (16 local, 8 remote): one run per head
    lo, ro, n = strided_runs([(2, 256, 128), (8, 16, 16), (8, 2, 2)], 512, 0, 2)
    assert (lo.tolist(), ro.tolist(), n) == ([512, 768], [0, 128], 128)
    # NHD (token, head, dim): 4 heads locally, a 2-head slice remotely: one run per token
    lo, ro, n = strided_runs([(16, 64, 32), (2, 16, 16), (8, 2, 2)], 0, 0, 2)
    assert n == 32 and len(lo) == 16


# ============================================================================ merge_runs
@st.composite
def run_sets(draw):
    """Non-overlapping runs over a few sub-blocks, split into random pieces and shuffled."""
    runs = []
    for kl in range(draw(st.integers(1, 3))):
        dims, off_l, off_r, item = draw(strided_copy())
        kr = draw(st.integers(0, 2))
        lo, ro, n = strided_runs(dims, off_l, off_r, item)
        for a, b in zip(lo.tolist(), ro.tolist()):
            cut = sorted(set(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=2))) - {n})
            edges = [0, *[c for c in cut if c < n], n]
            for x, y in zip(edges, edges[1:]):
                runs.append((kl, a + x, kr, b + x, y - x))
    runs = draw(st.permutations(runs))
    return [np.array(col, dtype=np.int64) for col in zip(*runs)]


def virtual_bytes(kl, ol, kr, orr, n) -> list:
    vl = (np.asarray(kl, np.int64) << SUB_SHIFT) + ol
    vr = (np.asarray(kr, np.int64) << SUB_SHIFT) + orr
    return sorted(run_bytes(vl, vr, n))


@PROPS
@given(run_sets())
def test_merge_runs_keeps_map_and_is_minimal(runs):
    """merge_runs keeps the (sub-block, offset) byte map and leaves no two runs that could merge."""
    out = merge_runs(*runs)
    assert virtual_bytes(*out) == virtual_bytes(*runs)
    kl, ol, kr, orr, n = (a.tolist() for a in out)
    ends = {(a, b + m): (c, d + m) for a, b, c, d, m in zip(kl, ol, kr, orr, n)}
    for a, b, c, d in zip(kl, ol, kr, orr):
        assert ends.get((a, b)) != (c, d), "a run continues another on both sides but was not merged"
    vl = [(a << SUB_SHIFT) + b for a, b in zip(kl, ol)]
    assert vl == sorted(vl), "runs sorted by local position"


def test_merge_runs_never_across_sub_blocks_and_refuses_overlap():
    """Runs in different sub-blocks stay apart even if offsets continue; overlapping local runs raise."""
    a = [np.array(v) for v in ([0, 1], [0, 0], [0, 1], [0, 0], [8, 8])]
    out = merge_runs(*a)
    assert len(out[4]) == 2
    with pytest.raises(ValueError):
        merge_runs(*(np.array(v) for v in ([0, 0], [0, 4], [0, 0], [0, 100], [8, 8])))


# ============================================================================ coalesce_rows
@st.composite
def row_lists(draw):
    """Descriptor rows whose neighbours often continue each other (sometimes on one side only)."""
    n = draw(st.integers(0, 40))
    local, remote = [], []
    la, ra = 1000, 50_000
    for _ in range(n):
        length = draw(st.integers(1, 16))
        how = draw(st.sampled_from(("both", "both", "local", "remote", "jump", "dev")))
        ld = rd = 0
        if local:
            pla, pn, pld = local[-1]
            pra, _, prd = remote[-1]
            la = pla + pn if how in ("both", "local", "dev") else pla + pn + draw(st.integers(1, 64))
            ra = pra + pn if how in ("both", "remote", "dev") else pra + pn + draw(st.integers(1, 64))
            ld, rd = (pld, prd) if how != "dev" else (1 - pld, prd)
        local.append((la, length, ld))
        remote.append((ra, length, rd))
    to = lambda rows: np.array(rows, dtype=np.uint64).reshape(-1, 3)  # noqa: E731
    return to(local), to(remote)


def row_bytes(rows) -> list:
    return [(int(a) + j, int(d)) for a, n, d in rows.tolist() for j in range(int(n))]


@PROPS
@given(row_lists())
def test_coalesce_rows_keeps_order_and_map(rows):
    """coalesce_rows keeps both byte sequences (with devices) and leaves no mergeable neighbours."""
    local, remote = rows
    keep_l, keep_r = local.copy(), remote.copy()
    lo, ro = coalesce_rows(local, remote)
    assert np.array_equal(local, keep_l) and np.array_equal(remote, keep_r), "inputs not modified"
    assert lo.dtype == np.uint64 and ro.dtype == np.uint64
    assert row_bytes(lo) == row_bytes(local) and row_bytes(ro) == row_bytes(remote)
    assert np.array_equal(lo[:, 1], ro[:, 1])
    for i in range(len(lo) - 1):
        a, b = lo[i].tolist(), lo[i + 1].tolist()
        c, d = ro[i].tolist(), ro[i + 1].tolist()
        assert not (a[0] + a[1] == b[0] and c[0] + c[1] == d[0] and a[2] == b[2] and c[2] == d[2])


# ============================================================================ TP mapping
def valid_tp(heads: int) -> list[int]:
    return [t for t in range(1, 17) if heads % t == 0 or t % heads == 0]


@st.composite
def tp_pairs(draw):
    heads = draw(st.sampled_from((1, 2, 3, 4, 6, 8)))
    return heads, draw(st.sampled_from(valid_tp(heads))), draw(st.sampled_from(valid_tp(heads)))


@PROPS
@given(tp_pairs())
def test_heads_of_partitions_or_replicates(case):
    """heads_of: tp <= heads shards every head to one rank; tp > heads gives each head tp/heads replicas."""
    heads, tp, _ = case
    held = [heads_of(r, heads, tp) for r in range(tp)]
    assert all(0 <= a < b <= heads for a, b in held)
    count = np.zeros(heads, int)
    for a, b in held:
        count[a:b] += 1
    assert (count == max(1, tp // heads)).all()
    assert all(b - a == max(1, heads // tp) for a, b in held)


@PROPS
@given(tp_pairs())
def test_assign_reads_each_head_once_from_a_holder(case):
    """assign: slices tile the consumer's heads in order, each from a producer rank that holds them."""
    heads, ctp, ptp = case
    for c in range(ctp):
        a, b = heads_of(c, heads, ctp)
        slices = assign(c, heads, ctp, ptp)
        assert [h for _, h0, h1 in slices for h in range(h0, h1)] == list(range(a, b))
        for p, h0, h1 in slices:
            assert 0 <= p < ptp
            pa, pb = heads_of(p, heads, ptp)
            assert pa <= h0 and h1 <= pb, f"producer {p} does not hold heads {h0}:{h1}"
        for (p, _, e), (q, s, _) in zip(slices, slices[1:]):
            assert p != q or e != s, "neighbour slices from one producer are merged"


@PROPS
@given(tp_pairs())
def test_assign_spreads_replicas(case):
    """Consumer ranks that hold the same head read it from different replicas, as evenly as possible."""
    heads, ctp, ptp = case
    for h in range(heads):
        replicas = [p for p in range(ptp) if heads_of(p, heads, ptp)[0] <= h < heads_of(p, heads, ptp)[1]]
        readers = [c for c in range(ctp) if heads_of(c, heads, ctp)[0] <= h < heads_of(c, heads, ctp)[1]]
        chosen = [next(p for p, h0, h1 in assign(c, heads, ctp, ptp) if h0 <= h < h1) for c in readers]
        load = [chosen.count(p) for p in replicas]
        assert max(load) - min(load) <= 1, f"head {h}: readers {readers} -> producers {chosen} of {replicas}"


def tp_spec(heads: int, tp: int, latent: bool, ssm_heads: int | None) -> str:
    fields = [{"name": "k", "dtype": "bf16",
               "dims": [{"name": "head", "role": "head"}, {"name": "token", "role": "token"},
                        {"name": "head_dim"}]}]
    if latent:
        fields.append({"name": "latent", "dtype": "bf16", "dims": [{"name": "token", "role": "token"},
                                                                   {"name": "lat", "size": 3}]})
    spec = {"kvlc": 1, "name": f"tp{tp}", "model": {"name": "m", "num_layers": 1, "num_kv_heads": heads,
                                                     "head_dim": 2},
            "parallel": {"tp_size": tp}, "block_size": 4,
            "groups": [{"name": "full", "kind": "full_attention"}],
            "storages": [{"name": "s", "mem": "VRAM"}],
            "layouts": {"kv": {"fields": fields}},
            "regions": [{"name": "a", "storage": "s", "layout": "kv", "num_blocks": 2, "groups": ["full"]}]}
    if ssm_heads:
        spec["groups"].append({"name": "mamba", "kind": "mamba"})
        spec["layouts"]["st"] = {"fields": [{"name": "ssm", "dtype": "fp32", "dims": [
            {"name": "ssm_head", "role": "head", "size": ssm_heads}, {"name": "d", "size": 2}]}]}
        spec["regions"].append({"name": "s0", "storage": "s", "layout": "st", "num_blocks": 1,
                                "groups": ["mamba"]})
    return yaml.safe_dump(spec, sort_keys=False)


@settings(PROPS, max_examples=40)
@given(tp_pairs(), st.booleans(), st.sampled_from((None, 1, 2, 4, 8, 16)))
def test_consumer_counts_equal_independent_count(case, latent, ssm_heads):
    """consumer_counts[p] (ranks reading from p) equals an independent count and the READ programs' peers."""
    heads, ctp, ptp = case
    if ssm_heads and not all(ssm_heads % t == 0 or t % ssm_heads == 0 for t in (ctp, ptp)):
        ssm_heads = None
    cons = kvlc.compile_spec(tp_spec(heads, ctp, latent, ssm_heads))
    prod = kvlc.compile_spec(tp_spec(heads, ptp, latent, ssm_heads))
    readers: dict[int, set] = {p: set() for p in range(ptp)}
    for c in range(ctp):
        for hcount in [heads] + ([ssm_heads] if ssm_heads else []):
            lo, hi = heads_of(c, hcount, ctp)          # consumer's heads, from the documented rule
            for h in range(lo, hi):
                cands = [p for p in range(ptp)
                         if heads_of(p, hcount, ptp)[0] <= h < heads_of(p, hcount, ptp)[1]]
                readers[cands[c % len(cands)]].add(c)
        if latent:
            readers[c % ptp].add(c)
    want = {p: len(cs) for p, cs in readers.items()}
    peers: dict[int, int] = {p: 0 for p in range(ptp)}
    for c in range(ctp):
        prog = pair(cons, prod, local_rank=c, direction="READ")
        assert dict(prog.consumer_counts) == want
        for p in prog.peer_ranks:
            peers[p] += 1
    assert peers == want
    for p in range(ptp):
        prog = pair(prod, cons, local_rank=p, direction="WRITE")
        assert dict(prog.consumer_counts) == want
        assert len(prog.peer_ranks) == want[p], "a producer pushes to exactly the ranks that count on it"
