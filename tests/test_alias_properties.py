"""Aliased page pools on the content-coded memory model.

An attention region and two state regions (Mamba-like groups) lie over one page pool per
layer, declared with ``aliases``. Each group receives into its own pages; READ and WRITE copy
each requested byte exactly once (content codes on every destination byte, nothing else
written) in exactly the independent minimum of descriptors, across TP, block sizes and attention
kernel blocks smaller than a page (a page is one logical block: m kernel blocks of the attention
region, one state). A request that gives two groups of one pool the same page is refused.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st

import kvlc
from kvlc.compiler.pairing.pair import pair
from kvlc.errors import TransferError
from kvlc.demo.content import fill

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_model import Engine, verify  # noqa: E402
from test_pair_properties import PROPS, check_parts, execute_counting, reference  # noqa: E402
from kvlc import bind, instantiate

HEADS, DIM = 4, 4


def pool_spec(name: str, tp: int, block: int, pages: int, state: int, kernel: int | None = None) -> str:
    """Per layer one pool: attention K/V blocks and two state groups' states on the same pages; with
    ``kernel`` (< block) the attention region's kernel blocks split each page into block / kernel."""
    local = max(HEADS // tp, 1)
    m = block // (kernel or block)
    attn = 2 * (kernel or block) * local * DIM * 2
    st_bytes = local * state * 4
    page = -(-max(m * attn, st_bytes) // m) * m
    kv = [{"name": "token", "role": "token"}, {"name": "head", "role": "head"}, {"name": "head_dim"}]
    regions = []
    for layer in range(2):
        regions.append({"name": f"attn.{layer}", "storage": f"pool.{layer}", "layout": "kv", "offset": 0,
                        "block_stride": page // m, "num_blocks": pages * m, "groups": ["full"]})
        for g in ("ssm_a", "ssm_b"):
            regions.append({"name": f"{g}.{layer}", "storage": f"pool.{layer}", "layout": "state", "offset": 0,
                            "block_stride": page, "num_blocks": pages, "groups": [g],
                            "aliases": [f"attn.{layer}"]})
    return yaml.safe_dump({
        "kvlc": 1, "name": name,
        "model": {"name": "m", "num_layers": 2, "num_kv_heads": HEADS, "head_dim": DIM, "sizes": {"state": state}},
        "parallel": {"tp_size": tp}, "block_size": block,
        "groups": [{"name": "full", "kind": "full_attention", **({"kernel_block_size": kernel} if kernel else {})},
                   {"name": "ssm_a", "kind": "mamba"},
                   {"name": "ssm_b", "kind": "mamba"}],
        "storages": [{"name": f"pool.{i}", "mem": "VRAM"} for i in range(2)],
        "layouts": {"kv": {"fields": [{"name": "k", "dtype": "bf16", "dims": kv},
                                      {"name": "v", "dtype": "bf16", "dims": kv}]},
                    "state": {"fields": [{"name": "ssm", "dtype": "fp32",
                                          "dims": [{"name": "head", "role": "head"}, {"name": "state"}]}]}},
        "regions": regions}, sort_keys=False)


def coded_pool(plan, tag: int, ids: dict) -> Engine:
    """An engine whose pages hold, for each group, that group's content codes on the pages it owns."""
    eng = Engine(plan, tag, False)
    for rank, bufs in eng.buffers.items():
        for r in plan.regions:
            scratch = {k: v.copy() for k, v in bufs.items()}
            fill(plan.model_copy(update={"regions": (r,)}), rank, scratch)
            (group,) = r.groups
            m = plan.group(group).kernel_blocks_per_block if not plan.group(group).is_state else 1
            for b in ids[group]:
                for k in range(b * m, b * m + m):
                    lo = r.offset + k * r.block_stride
                    bufs[r.storage][lo:lo + r.block_bytes] = scratch[r.storage][lo:lo + r.block_bytes]
    return eng


@st.composite
def pool_case(draw):
    tps = (draw(st.sampled_from((1, 2, 4))), draw(st.sampled_from((1, 2, 4))))
    blocks = (draw(st.sampled_from((2, 4, 8))), draw(st.sampled_from((2, 4, 8))))
    kernels = tuple(draw(st.sampled_from([None] + [k for k in (1, 2, 4) if k < b and b % k == 0])) for b in blocks)
    state = draw(st.integers(1, 12))
    tokens = draw(st.integers(1, 20))
    pages, ids = [], []
    for block in blocks:
        need = -(-tokens // block)
        n = need + 2 + draw(st.integers(0, 3))
        order = draw(st.permutations(range(n)))
        ids.append({"full": list(order[:need]), "ssm_a": [order[need]], "ssm_b": [order[need + 1]]})
        pages.append(n)
    return tps, blocks, kernels, state, tokens, pages, ids


@settings(PROPS, max_examples=40)
@given(pool_case())
@example(((1, 2), (8, 4), (2, None), 5, 13, [4, 6], [{"full": [3, 0], "ssm_a": [1], "ssm_b": [2]},
                                                          {"full": [5, 2, 0, 4], "ssm_a": [1], "ssm_b": [3]}]))
def test_aliased_pools_move_exact_bytes(case):
    tps, blocks, kernels, state, tokens, pages, ids = case
    cons = kvlc.compile_spec(pool_spec("c", tps[0], blocks[0], pages[0], state, kernels[0]))
    prod = kvlc.compile_spec(pool_spec("p", tps[1], blocks[1], pages[1], state, kernels[1]))
    cids, pids = ids
    P = coded_pool(prod, 1, pids)
    C = Engine(cons, 0, False)
    for c in range(tps[0]):
        prog = pair(cons, prod, local_rank=c, direction="READ")
        before = {k: v.copy() for k, v in C.buffers[c].items()}
        parts = instantiate(bind(prog, C.rank_bases(c), {p: P.rank_bases(p) for p in prog.peer_ranks}),
                            cids, pids, tokens)
        check_parts(parts, reference(cons, c, prod, C, P, cids, pids, {"full": tokens}), "arbitrary", C, c, P)
        writes: dict = {}
        execute_counting(parts, C, c, P, "READ", writes)
        assert all(w.max(initial=0) <= 1 for w in writes.values()), "a destination byte written twice"
        assert verify(C, c, P, cids, pids, tokens, before) > 0
    C2 = Engine(cons, 2, False)
    befores = {c: {k: v.copy() for k, v in C2.buffers[c].items()} for c in range(tps[0])}
    writes = {}
    for p in range(tps[1]):
        prog = pair(prod, cons, local_rank=p, direction="WRITE")
        parts = instantiate(bind(prog, P.rank_bases(p), {c: C2.rank_bases(c) for c in prog.peer_ranks}),
                            pids, cids, tokens)
        execute_counting(parts, P, p, C2, "WRITE", writes)
    assert all(w.max(initial=0) <= 1 for w in writes.values()), "a destination byte written twice"
    for c in range(tps[0]):
        verify(C2, c, P, cids, pids, tokens, befores[c])


def test_two_groups_on_one_page_are_refused():
    plan = kvlc.compile_spec(pool_spec("c", 1, 4, 6, 3))
    prog = pair(plan, plan, local_rank=0, direction="READ")
    ids = {"full": [0, 1], "ssm_a": [1], "ssm_b": [2]}
    with pytest.raises(TransferError, match="page 1 .* groups 'full' and 'ssm_a'"):
        instantiate(bind(prog, {s.name: (0, 0) for s in plan.storages}, {0: {s.name: (1 << 40, 0) for s in plan.storages}}),
                    ids, {"full": [2, 3], "ssm_a": [4], "ssm_b": [5]}, 8)


def test_aliases_keep_old_plans_identical():
    """A plan without aliases serializes without the key (digests of existing plans unchanged)."""
    root = Path(__file__).resolve().parents[1] / "layouts"
    plain = kvlc.compile_spec(root / "qwen3-next-80b-a3b-tp4.yaml")
    assert '"aliases"' not in plain.to_json()
    pool = kvlc.compile_spec(root / "qwen3-next-80b-a3b-pool-tp4.yaml")
    assert pool.region("layer.0").aliases == ("layer.3",)
    assert kvlc.compiler.plan.model.Plan.from_json(pool.to_json()).digest == pool.digest


def test_kernel_blocks_of_one_page_count_as_that_page():
    """Attention kernel blocks 2 of a 8-token page (4 per page): the attention group's block 1 is kernel
    blocks 4..7, i.e. page 1; a state group given page 1 too is refused, page 2 is not."""
    plan = kvlc.compile_spec(pool_spec("c", 1, 8, 6, 3, kernel=2))
    assert plan.group("full").kernel_blocks_per_block == 4 and plan.region("attn.0").num_blocks == 24
    prog = pair(plan, plan, local_rank=0, direction="READ")
    bases = {s.name: (0, 0) for s in plan.storages}, {0: {s.name: (1 << 40, 0) for s in plan.storages}}
    remote = {"full": [2, 3], "ssm_a": [4], "ssm_b": [5]}
    with pytest.raises(TransferError, match="page 1 .* groups 'full' and 'ssm_a'"):
        instantiate(bind(prog, *bases), {"full": [0, 1], "ssm_a": [1], "ssm_b": [2]}, remote, 16)
    assert instantiate(bind(prog, *bases), {"full": [0, 1], "ssm_a": [2], "ssm_b": [3]}, remote, 16)


def test_an_alias_over_other_pages_names_page_size_and_kernel_blocks():
    """A state region whose page is not the attention region's 4 kernel blocks: refused where it is
    declared, with both page sizes and the kernel blocks per page named."""
    spec = yaml.safe_load(pool_spec("c", 1, 8, 6, 3, kernel=2))
    spec["regions"][1]["block_stride"] *= 2
    with pytest.raises(kvlc.SpecError) as err:
        kvlc.compile_spec(yaml.safe_dump(spec))
    text = str(err.value)
    assert "regions[1].aliases[0]" in text and "does not lie page for page over it (page size differs)" in text
    assert "4 kernel blocks per page" in text and "block_stride = page size / kernel blocks per page" in text
