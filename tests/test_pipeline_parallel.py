"""Pipeline parallelism: a stage (a layer window) pairs with a whole-model engine and with stages of
another split; the program holds the layers both hold; a consumer's layers are covered by the set of
producer stages. Content-coded proofs on the memory model: every requested byte of every covered layer
arrives from exactly one stage, nothing else changes; refusals name the layers each side holds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

import kvlc
from kvlc.compiler.pairing.pair import check_pair, pair
from kvlc.compiler.pairing.pp import cache_layers, coverage, holds_region, region_layer
from kvlc.errors import CompatError
from kvlc.init import EngineOptions, InitError, init_yaml
from kvlc.demo.content import expected_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_model import Engine, execute  # noqa: E402
from kvlc import bind, instantiate
from kvlc.explain.docs import program_summary

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ROOT / "layouts"

# small models (by config fields only), for the memory model
CONFIGS = {
    "dense": {"num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8},
    "sliding": {"num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8,
                "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"] * 3},
    "mamba": {"num_hidden_layers": 6, "hybrid_override_pattern": "M*-M*M", "num_attention_heads": 8,
              "num_key_value_heads": 4, "attention_head_dim": 8, "mamba_num_heads": 4, "mamba_head_dim": 2,
              "n_groups": 2, "ssm_state_size": 2, "conv_kernel": 3},
}


def small(kind: str, tp: int, layers=None, block=4, name="e"):
    opts = EngineOptions(tp_size=tp, layers=layers, block_size=block, num_blocks=6, state_slots=4, name=name,
                         mem="DRAM")
    return kvlc.compile_spec(init_yaml(CONFIGS[kind], opts))


def llama(stem: str):
    return kvlc.compile_spec(LAYOUTS / f"{stem}.yaml")


# ---------------------------------------------------------------- findings
def test_stage_pulls_from_whole_model_engine():
    """A stage consumer pairs with an all-layer producer: a warning says which layers, the program holds them."""
    stage, full = llama("llama-3.1-70b-tp4-pp40-80"), llama("llama-3.1-70b-tp8")
    rep = check_pair(stage, full, local_rank=0, direction="READ")
    assert rep.ok and rep.codes()[0] == "pp-partial"  # then the hetero-TP NHD descriptor warnings
    f = rep.findings[0]
    assert (f.severity, f.message, f.local, f.remote) == (
        "warning", "pairs layers [40, 80) only, the layers both engines hold", "layers [40, 80)", "layers [0, 80)")
    prog = pair(stage, full, local_rank=0, direction="READ")
    assert {region_layer(e.region) for e in prog.entries} == set(range(40, 80))
    assert prog.layers == (40, 80) and program_summary(prog)["layers"] == [40, 80]


def test_whole_model_consumer_told_what_other_stages_give():
    """A consumer holding all layers pairing one producer stage: the rest must come from the other stages."""
    full, stage = llama("llama-3.1-70b-tp8"), llama("llama-3.1-70b-tp4-pp40-80")
    rep = check_pair(full, stage, local_rank=0, direction="READ")
    f = rep.findings[0]
    assert rep.ok and (f.code, f.message, f.local, f.remote, f.fix) == (
        "pp-partial", "pairs layers [40, 80) only, the layers both engines hold; the consumer gets layers "
        "[0, 40) from the producer's other pipeline stages", "layers [0, 80)", "layers [40, 80)",
        "pair the consumer with every producer stage (kvlc.compiler.pairing.pp.coverage)")
    push = check_pair(stage, full, local_rank=0, direction="WRITE")  # the stage pushes: same words
    assert push.findings[0].message == f.message


def test_stages_of_different_splits():
    a, b = small("dense", 2, (0, 4)), small("dense", 1, (2, 6))
    rep = check_pair(a, b, local_rank=1, direction="READ")
    assert rep.ok and rep.findings[0].message == (
        "pairs layers [2, 4) only, the layers both engines hold; the consumer gets layers [0, 2) from the "
        "producer's other pipeline stages")
    assert [e.region for e in pair(a, b, local_rank=0).entries] == ["layer.2", "layer.3"]


def test_disjoint_stages_refused():
    a, b = small("dense", 1, (0, 3)), small("dense", 1, (3, 6))
    with pytest.raises(CompatError) as exc:
        pair(a, b, local_rank=0)
    f = exc.value.report.errors[0]
    assert (f.code, f.message, f.local, f.remote, f.fix) == (
        "pp-layers", "engines hold no layer in common", "layers [0, 3)", "layers [3, 6)",
        "pair each pipeline stage with the stages holding its layers")


def test_region_missing_inside_the_shared_window_still_refused():
    """Only regions outside the other side's window may be absent there."""
    a = small("dense", 1, (0, 4))
    spec = yaml.safe_load(init_yaml(CONFIGS["dense"], EngineOptions(layers=(2, 6), num_blocks=6, block_size=4)))
    spec["regions"] = [r for r in spec["regions"] if r["name"] != "layer.3"]
    b = kvlc.compile_spec(yaml.safe_dump(spec))
    rep = check_pair(a, b, local_rank=0, direction="READ")
    assert [(f.code, f.region, f.message) for f in rep.errors] == [
        ("region-missing", "layer.3", "region exists on the local engine only")]


def test_draft_layer_belongs_to_the_last_stage():
    v3 = kvlc.compile_spec(init_yaml(__import__("json").loads((LAYOUTS / "configs/deepseek-v3.config.json")
                                                              .read_text()),
                                     EngineOptions(block_size=64, layers=(30, 61))))
    assert holds_region(v3, "layer.61") and holds_region(v3, "layer.30") and not holds_region(v3, "layer.29")
    assert holds_region(v3, "indexer.cache")  # a region of no layer belongs to every stage


# ---------------------------------------------------------------- coverage
def test_coverage_of_stages():
    full = llama("llama-3.1-70b-tp8")
    lo, hi = llama("llama-3.1-70b-tp4-pp0-40"), llama("llama-3.1-70b-tp4-pp40-80")
    assert coverage(full, [lo, hi]).complete
    gap = coverage(full, [small_llama((0, 30)), hi])
    assert not gap.complete and gap.missing == ((30, 40),)
    assert gap.text() == ("consumer llama-3.1-70b-tp8 needs layers [0, 80)\n"
                          "  llama-3.1-70b-tp4-pp0-30 gives layers [0, 30)\n"
                          "  llama-3.1-70b-tp4-pp40-80 gives layers [40, 80)\n"
                          "  missing layers [30, 40)")


def small_llama(window):
    import json
    cfg = json.loads((LAYOUTS / "templates/llama-3.1-70b.config.json").read_text())
    start, stop = window
    return kvlc.compile_spec(init_yaml(cfg, EngineOptions(tp_size=4, layers=window, name=f"llama-3.1-70b-tp4-pp{start}-{stop}",
                                                          model_name="meta-llama/Llama-3.1-70B")))


# ---------------------------------------------------------------- content-coded proofs
def request(cons, prods, rng, max_tokens=20):
    """Random ids per group on the consumer and on each producer stage, and a token count per group."""
    cids, tokens, pids = {}, {}, [{} for _ in prods]
    for g in cons.groups:
        if not any(g.name in r.groups for r in cons.regions):
            continue  # a stage may hold no layer of a group (e.g. only sliding layers)
        state = any(r.is_state for r in cons.regions if g.name in r.groups)
        if state:
            n = int(rng.integers(1, 3))
        else:
            tokens[g.name] = int(rng.integers(1, max_tokens))
            n = -(-tokens[g.name] // g.block_size)
        cap = min(r.capacity for r in cons.regions if g.name in r.groups)
        cids[g.name] = rng.choice(cap, n, replace=False).tolist()
        for k, p in enumerate(prods):
            pcap = min([r.capacity for r in p.regions if g.name in r.groups] or [cap])
            pn = n if state else -(-tokens[g.name] // p.group(g.name).block_size)
            pids[k][g.name] = rng.choice(pcap, pn, replace=False).tolist()
    return cids, pids, tokens


def prove(cons, prods, direction: str, seed: int) -> int:
    """Every consumer rank gets every layer from the stages; no byte from two stages; nothing else changes."""
    rng = np.random.default_rng(seed)
    cids, pids, tokens = request(cons, prods, rng)
    C = Engine(cons, 0, False)
    P = [Engine(p, 1 + k, True) for k, p in enumerate(prods)]
    before = {c: {n: b.copy() for n, b in C.buffers[c].items()} for c in range(cons.parallel.tp_size)}
    for k, (prod, eng) in enumerate(zip(prods, P)):
        for rank in range(cons.parallel.tp_size if direction == "READ" else prod.parallel.tp_size):
            if direction == "READ":
                prog = pair(cons, prod, local_rank=rank, direction="READ")
                parts = instantiate(bind(prog, C.rank_bases(rank), {p: eng.rank_bases(p) for p in prog.peer_ranks}),
                                    cids, pids[k], tokens)
                execute(parts, C, rank, eng, "READ")
            else:
                prog = pair(prod, cons, local_rank=rank, direction="WRITE")
                parts = instantiate(bind(prog, eng.rank_bases(rank), {c: C.rank_bases(c) for c in prog.peer_ranks}),
                                    pids[k], cids, tokens)
                execute(parts, eng, rank, C, "WRITE")
    checked = 0
    for c in range(cons.parallel.tp_size):
        touched = {n: np.zeros(len(b), bool) for n, b in C.buffers[c].items()}
        regions = set()
        for prod, ids in zip(prods, pids):
            for storage, idx, vals in expected_bytes(cons, c, prod, cids, ids, tokens):
                assert np.array_equal(C.buffers[c][storage][idx], vals), f"wrong bytes in {storage} rank {c}"
                assert not touched[storage][idx].any(), "a byte covered by two stages"
                touched[storage][idx] = True
                checked += idx.size
            regions |= {r.name for r in prod.regions}
        assert {r.name for r in cons.regions} <= regions, "a consumer layer no stage holds"
        for n, b in C.buffers[c].items():
            assert np.array_equal(b[~touched[n]], before[c][n][~touched[n]]), f"bytes written outside in {n}"
    return checked


def holds_cache(kind: str, window: tuple[int, int]) -> bool:
    """Whether a stage of ``window`` holds a cache layer (a hybrid's MLP-only layers hold none)."""
    pattern = CONFIGS[kind].get("hybrid_override_pattern")
    return pattern is None or any(c != "-" for c in pattern[window[0]:window[1]])


def test_stage_without_cache_layers_refused():
    """A stage of MLP-only layers has nothing to transfer: kvlc init says so instead of writing an empty spec."""
    with pytest.raises(InitError, match=r"layers \[2, 3\) hold no KV-cache or state layer"):
        small("mamba", 1, (2, 3))


def test_mlp_only_layers_need_no_producer():
    """A whole hybrid consumer, its producer split so one stage holds only an MLP layer (no cache, so no
    spec): the other stages cover every layer that holds a region, and the MLP layer is not missing."""
    cons = small("mamba", 1, name="whole")
    prods = [small("mamba", 1, (0, 2), name="s0"), small("mamba", 1, (3, 6), name="s1")]
    cov = coverage(cons, prods)
    assert cov.complete and cov.missing == () and cov.needs == (0, 6), cov.text()
    assert 2 not in cache_layers(cons) and cache_layers(cons) == [0, 1, 3, 4, 5]
    assert coverage(cons, prods[:1]).missing == ((3, 6),)


def split(n: int, cuts) -> list[tuple[int, int]]:
    edges = [0, *sorted(set(cuts)), n]
    return [(a, b) for a, b in zip(edges, edges[1:]) if a < b]


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("direction", ["READ", "WRITE"])
def test_whole_consumer_from_two_stages(kind, direction):
    cons = small(kind, 2, name="whole")
    prods = [small(kind, 1, (0, 2), name="s0"), small(kind, 4, (2, 6), block=8, name="s1")]
    assert coverage(cons, prods).complete
    assert prove(cons, prods, direction, 7) > 0


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(sorted(CONFIGS)), ctp=st.sampled_from([1, 2, 4]), ptp=st.sampled_from([1, 2, 4]),
       ccuts=st.lists(st.integers(1, 5), max_size=2), pcuts=st.lists(st.integers(1, 5), max_size=2),
       stage=st.integers(0, 2), blocks=st.sampled_from([(4, 4), (4, 8), (8, 4)]),
       direction=st.sampled_from(["READ", "WRITE"]), seed=st.integers(0, 2 ** 16))
@example(kind="mamba", ctp=1, ptp=1, ccuts=[], pcuts=[2, 3], stage=0, blocks=(4, 4), direction="READ", seed=0)
def test_random_stage_splits(kind, ctp, ptp, ccuts, pcuts, stage, blocks, direction, seed):
    """A consumer stage of one split pairs with every producer stage of another; together they cover it."""
    cwin = split(6, ccuts)
    cwin = cwin[stage % len(cwin)]
    assume(holds_cache(kind, cwin))
    cons = small(kind, ctp, cwin, blocks[0], name="c")
    stages = [small(kind, ptp, w, blocks[1], name=f"p{w[0]}") for w in split(6, pcuts) if holds_cache(kind, w)]
    useful = [p for p in stages if coverage(cons, [p]).stages[0].layers]
    for p in stages:
        if p not in useful:
            assert check_pair(cons, p, local_rank=0, direction="READ").codes() == ("pp-layers",)
    assert coverage(cons, useful).complete
    prove(cons, useful, direction, seed)


def test_docstring_examples():
    import doctest
    import os

    import kvlc.compiler.pairing.pp as pp
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        result = doctest.testmod(pp)
    finally:
        os.chdir(cwd)
    assert result.attempted and result.failed == 0
