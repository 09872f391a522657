"""Checked-in layouts (CPU variants: DRAM, smaller pools) moved between real NIXL agents in two
processes — every producer rank in one, every consumer rank in the other — with every byte checked:
heterogeneous TP both ways, HND and NHD, MLA latent replicated over TP8, block-size ratios with two
KV-cache groups, an indexer cache, compressed caches (one entry per 4 and per 128 tokens), sliding windows, FP8 with scale tables and padded strides, and
Mamba state split section by section."""

from __future__ import annotations

import pytest
import yaml
from runtime_engines import LAYOUTS, TEST_LAYOUTS, check_bytes, config, flip, move

from kvlc.compiler.pairing.pair import pair
from kvlc.demo.run import cpu_plan, default_tokens, make_workload
from kvlc.demo.procs import EngineProcess, stop_engines

pytest.importorskip("torch")
pytest.importorskip("nixl")
pytestmark = pytest.mark.runtime

PAIRS_FILE = next(p for p in (LAYOUTS / "pairs" / "pairs.yaml", LAYOUTS / "pairs.yaml") if p.exists())
PAIRS = {p["name"]: p for p in yaml.safe_load(PAIRS_FILE.read_text())["pairs"]}
# Every named pair but the one whose per-request state pools stay large even scaled down (qwen3-next).
CASES = [
    ("llama70b-tp8-to-tp4", "pull"),
    ("llama70b-hnd-tp4-to-tp8", "pull"),
    ("deepseek-v3-tp8-to-tp1", "pull"),
    ("gemma3-b16-to-b32", "pull"),
    ("gemma3-b16-to-b32", "push"),
    ("gemma3-b16-to-b32", "pull_via_push"),
    ("deepseek-v3.2-to-hisparse", "pull"),
    ("gpt-oss-120b-tp4", "pull"),
    ("llama8b-fp8-tp2", "pull"),
    ("nemotron-h-tp4-to-tp2", "pull_via_push"),
    ("deepseek-v3-tp8-dcp8-to-tp1", "pull"),       # DCP8 producer: each rank holds every 8th token
    ("qwen3-235b-tp4-to-tp8-dcp2", "pull"),        # DCP2 consumer, GQA, TP4 -> TP8, 32- vs 16-token blocks
    ("v4-compressed-b256-to-b128", "pull"),
    ("v4-compressed-b128-to-b256", "push"),
]
MAX_BYTES = 4 << 20


@pytest.fixture(scope="module")
def procs():
    prod, cons = EngineProcess(), EngineProcess()
    yield prod, cons
    stop_engines([type("H", (), {"proc": p})() for p in (prod, cons)])


@pytest.mark.parametrize("name, mode", CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_checked_in_layout_pair(procs, name, mode):
    """Consumer rank 0 receives two requests from the producer ranks it pairs with; bytes are exact."""
    pp, cp = procs
    spec = PAIRS[name]
    P = cpu_plan(LAYOUTS / spec["producer"], MAX_BYTES)
    C = cpu_plan(LAYOUTS / spec["consumer"], MAX_BYTES)
    ranks = pair(C, P, local_rank=0, direction="READ").peer_ranks
    if mode == "push":  # every consumer rank the producer ranks write to must serve too
        assert all(pair(P, C, local_rank=r, direction="WRITE").peer_ranks == (0,) for r in ranks)
    prods = [pp.add_async(config(P, r, "content")) for r in ranks]
    cons = cp.add_async(config(C, 0, "random", seed=3))
    for h in prods + [cons]:
        h.ready()
    try:
        rounds = make_workload(C, P, 2, default_tokens(C, P, 64))
        if mode == "push":
            for p in prods:
                p.connect([cons.address], "WRITE", "direct")
        else:
            cons.connect([p.address for p in prods], "READ", "direct" if mode == "pull" else mode)
        for batch in rounds:
            before = cons.call("dump")
            if mode == "push":
                for p in prods:
                    move(p, "default", "write", flip(batch))
                got = cons.call("wait", [b[0] for b in batch], 30.0)
                assert got["failed"] == {} and got["open"] == []
            else:
                move(cons, "default", "read", batch)
            check_bytes(cons, C, P, before, batch)
    finally:
        for h in prods + [cons]:
            h.call("drop")


@pytest.mark.parametrize("mode", ["pull", "push", "pull_via_push"])
def test_hybrid_mamba_hetero_tp(procs, mode):
    """Mamba conv sections x|B|C and SSM state split by TP2, full and sliding-window groups with their own
    block ids and unequal pools: TP2 producer ranks (one process) → TP1 consumer (another), every mode."""
    from kvlc import compile_spec

    pp, cp = procs
    P = compile_spec(TEST_LAYOUTS / "hybrid-tp2.yaml")
    C = compile_spec(TEST_LAYOUTS / "hybrid-tp1.yaml")
    prods = [pp.add_async(config(P, r, "content")) for r in range(2)]
    cons = cp.add_async(config(C, 0, "random", seed=4))
    for h in prods + [cons]:
        h.ready()
    reqs = [
        (
            f"hy-{mode}-1",
            {"mamba": [2], "full": [0, 1, 2], "local": [3, 4, 11]},
            {"mamba": [5], "full": [30, 31, 7], "local": [19, 0, 12]},
            40,
        ),
        (
            f"hy-{mode}-2",
            {"mamba": [7], "full": [10, 11], "local": [5, 6]},
            {"mamba": [0], "full": [3, 4], "local": [8, 9]},
            17,
        ),
    ]
    try:
        before = cons.call("dump")
        if mode == "push":
            for p in prods:
                p.connect([cons.address], "WRITE", "direct")
                move(p, "default", "write", flip(reqs))
            got = cons.call("wait", [r[0] for r in reqs], 30.0)
            assert got["failed"] == {} and got["open"] == []
        else:
            cons.connect([p.address for p in prods], "READ", "direct" if mode == "pull" else mode)
            move(cons, "default", "read", reqs)
        check_bytes(cons, C, P, before, reqs)
    finally:
        for h in prods + [cons]:
            h.call("drop")
