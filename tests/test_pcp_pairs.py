"""Prefill context parallelism around the pairing: the rank rule, plans, requests, refusals, `kvlc pair`, cost.

The byte-level proofs are in ``test_dcp_properties.py`` (``test_random_pcp_pairs_move_exact_bytes``,
``test_pcp_issue_cases``); these pin the rank rule against vLLM's group construction and the numbers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

import kvlc
from kvlc import bind, instantiate
from kvlc.cli import main
from kvlc.compiler.pairing.pair import check_pair, pair
from kvlc.compiler.plan.model import Plan, PlanParallel

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ROOT / "layouts"
V3_PCP = LAYOUTS / "deepseek-v3-tp8-pcp2.yaml"
V3_DCP8 = LAYOUTS / "deepseek-v3-tp8-dcp8.yaml"
V32_PCP_DCP = LAYOUTS / "deepseek-v3.2-tp8-pcp2-dcp2.yaml"
V32_TP8 = LAYOUTS / "deepseek-v3.2-tp8.yaml"


def vllm_groups(tp: int, pcp: int, dcp: int) -> dict[str, list[list[int]]]:
    """TP, PCP and DCP groups as vLLM's ``initialize_model_parallel`` builds them for one DP rank and PP stage:
    ranks shaped ``(pcp, tp)``; TP groups are rows, PCP groups columns, DCP groups the ``(tp, pcp)``
    transpose cut into runs of ``dcp`` (the untransposed ranks when DCP is 1)."""
    ranks = np.arange(pcp * tp).reshape(pcp, tp)
    d = ranks.T if dcp > 1 else ranks
    return {"tp": ranks.reshape(-1, tp).tolist(), "pcp": ranks.T.reshape(-1, pcp).tolist(),
            "dcp": d.reshape(-1, dcp).tolist()}


def variant(path: Path, name: str, **parallel) -> Plan:
    spec = yaml.safe_load(path.read_text())
    spec["name"], spec["parallel"] = name, {**spec["parallel"], **parallel}
    return kvlc.compile_spec(yaml.safe_dump(spec, sort_keys=False))


# ---------------------------------------------------------------- the rank rule
@pytest.mark.parametrize("tp,pcp,dcp", [(8, 1, 8), (8, 1, 2), (4, 1, 1), (8, 2, 1), (8, 2, 2), (8, 2, 16),
                                        (2, 4, 4), (2, 4, 8), (1, 2, 2), (4, 2, 8)])
def test_rank_rule_matches_vllm_groups(tp, pcp, dcp):
    """Engine rank r: TP rank, PCP rank and DCP rank are r's index in the groups vLLM's parallel_state builds."""
    par = PlanParallel(tp_size=tp, pcp_size=pcp, dcp_size=dcp, layers=(0, 1))
    groups = vllm_groups(tp, pcp, dcp)
    assert par.ranks == tp * pcp == sum(len(g) for g in groups["tp"])
    for r in range(par.ranks):
        assert par.tp_rank(r) == next(g.index(r) for g in groups["tp"] if r in g)
        assert r // tp == next(g.index(r) for g in groups["pcp"] if r in g)
        assert par.dcp_rank(r) == next(g.index(r) for g in groups["dcp"] if r in g)


# ---------------------------------------------------------------- plans and requests
def test_plan_without_pcp_hashes_as_before_and_with_pcp_round_trips():
    """pcp_size 1 is not serialized (digests of every other plan unchanged); 2 is, round-trips, and is printed."""
    assert "pcp_size" not in kvlc.compile_spec(V3_DCP8).to_json()
    plan = kvlc.compile_spec(V3_PCP)
    assert '"pcp_size":2' in plan.to_json() and Plan.from_json(plan.to_json()) == plan
    assert " tp=8 pcp=2 dcp=1 " in plan.text().splitlines()[0]
    assert variant(V3_PCP, "same", pcp_size=1).to_json() == variant(V3_DCP8, "same", dcp_size=1).to_json()


def test_pcp_does_not_scale_block_ids():
    """The scheduler's virtual block is block_size * dcp_size: PCP alone keeps 64-token ids, PCP x DCP2 128."""
    assert kvlc.compile_spec(V3_PCP).blocks_for("mla", 4096) == 64
    assert kvlc.compile_spec(V32_PCP_DCP).blocks_for("mla", 4096) == 32


def test_local_rank_spans_tp_times_pcp():
    """A PCP engine has tp_size * pcp_size ranks: rank 15 of TP8 x PCP2 pairs, rank 16 is refused with the range."""
    cons, prod = kvlc.compile_spec(V3_PCP), kvlc.compile_spec(V3_DCP8)
    assert check_pair(cons, prod, local_rank=15, direction="READ").ok
    rep = check_pair(cons, prod, local_rank=16, direction="READ")
    (f,) = [f for f in rep.findings if f.code == "rank"]
    assert "tp_size x pcp_size" in f.message and f.fix == "use a rank in [0, 16)"


# ---------------------------------------------------------------- who serves whom
def test_replicated_pcp_is_read_from_one_replica():
    """PCP alone into DCP8: decode rank c reads its tokens from prefill rank c; PCP rank 1's replicas stay silent."""
    cons, prod = kvlc.compile_spec(V3_DCP8), kvlc.compile_spec(V3_PCP)
    for c in range(8):
        prog = pair(cons, prod, local_rank=c, direction="READ")
        assert prog.peer_ranks == (c,)
    assert dict(prog.consumer_counts) == {**{p: 1 for p in range(8)}, **{p: 0 for p in range(8, 16)}}
    assert pair(prod, cons, local_rank=8, direction="WRITE").peer_ranks == ()
    assert pair(prod, cons, local_rank=3, direction="WRITE").peer_ranks == (3,)


def test_pcp_consumer_fills_every_replica():
    """PCP on the decode role: each of the 16 PCP ranks keeps a whole replica, so each reads all 8 DCP ranks."""
    cons, prod = kvlc.compile_spec(V3_PCP), kvlc.compile_spec(V3_DCP8)
    for c in (0, 9, 15):
        assert pair(cons, prod, local_rank=c, direction="READ").peer_ranks == tuple(range(8))
    push = pair(prod, cons, local_rank=0, direction="WRITE")
    assert push.peer_ranks == tuple(range(16)) and dict(push.consumer_counts) == {p: 16 for p in range(8)}


def test_pcp_dcp_producer_names_its_shards():
    """`kvlc pair` says which tokens each PCP x DCP peer holds: DCP rank = PCP rank with DCP along the PCP axis."""
    out = CliRunner().invoke(main, ["pair", str(V32_PCP_DCP), str(V32_TP8), "--rank", "0"])
    assert out.exit_code == 0, out.output
    assert ("remote DCP 2 (TP 8 x PCP 2: peer p is TP rank p % 8): peer 0: tokens t with (t // 64) % 2 == 0; "
            "peer 8: tokens t with (t // 64) % 2 == 1" in out.output)


# ---------------------------------------------------------------- what stays refused
def _gqa(**parallel) -> Plan:
    spec = {"kvlc": 1, "name": "gqa", "model": {"name": "m", "num_layers": 1, "num_kv_heads": 4, "head_dim": 2},
            "parallel": parallel, "block_size": 4, "groups": [{"name": "full", "kind": "full_attention"}],
            "storages": [{"name": "s", "mem": "VRAM"}],
            "layouts": {"kv": {"fields": [{"name": n, "dtype": "bf16", "dims": [
                {"name": "head", "role": "head"}, {"name": "token", "role": "token"}, {"name": "head_dim"}]}
                for n in ("k", "v")]}},
            "regions": [{"name": "attn.0", "storage": "s", "layout": "kv", "num_blocks": 8, "groups": ["full"]}]}
    return kvlc.compile_spec(yaml.safe_dump(spec, sort_keys=False))


def test_dcp_over_every_rank_with_sharded_heads_refused():
    """GQA at TP4 x PCP2 with DCP over all 8 ranks: a DCP group spans other heads, 'dcp-heads' with the fix."""
    bad, plain = _gqa(tp_size=4, pcp_size=2, dcp_size=8), _gqa(tp_size=4)
    rep = check_pair(plain, bad, local_rank=0, direction="READ")
    (f,) = [f for f in rep.findings if f.code == "dcp-heads"]
    assert not rep.ok and f.remote == "tp_size 4, pcp_size 2, dcp_size 8, 4 heads"
    assert "held by 2 rank(s) (1 TP rank(s) x pcp_size 2)" in f.message
    assert f.fix.startswith("use dcp_size 2 (DCP along the PCP ranks")
    assert check_pair(plain, _gqa(tp_size=4, pcp_size=2, dcp_size=2), local_rank=0, direction="READ").ok


# ---------------------------------------------------------------- descriptor cost of the checked-in pairs
def _request(cons: Plan, prod: Plan, rank: int, scattered: bool) -> tuple[int, int]:
    """(descriptors, bytes) consumer rank ``rank`` pulls for a 4,096-token request."""
    def ids(plan, seed):
        rng = np.random.default_rng(seed)
        return {g.name: (rng.permutation(2000)[:plan.blocks_for(g.name, 4096)] * 2).tolist() if scattered
                else list(range(plan.blocks_for(g.name, 4096))) for g in plan.groups}

    def bases(plan, r):
        return {s.name: ((r + 1) << 44) + i * (1 << 36) for i, s in enumerate(plan.storages)}

    prog = pair(cons, prod, local_rank=rank, direction="READ")
    parts = instantiate(bind(prog, bases(cons, rank), {p: bases(prod, p) for p in prog.peer_ranks}),
                        ids(cons, 1), ids(prod, 2), 4096)
    return sum(len(p) for p in parts.values()), sum(int(p.local[:, 1].sum()) for p in parts.values())


@pytest.mark.parametrize("prod,cons,want", [
    (V32_PCP_DCP, V32_TP8, (7808, 7808, 61 * 4096 * (1152 + 132))),  # latent + indexer, whole 64-token blocks
    (V3_PCP, V3_DCP8, (31744, 31744, 62 * 512 * 1152)),  # 1/8 of 62 layers x 4,096 tokens, one run per token
])
def test_descriptors_per_4096_token_request(prod, cons, want):
    """Descriptors and bytes consumer rank 0 pulls for 4,096 tokens, contiguous and scattered block ids."""
    c, p = kvlc.compile_spec(cons), kvlc.compile_spec(prod)
    contiguous, scattered = _request(c, p, 0, False), _request(c, p, 0, True)
    assert (contiguous[0], scattered[0], contiguous[1], scattered[1]) == (*want[:2], want[2], want[2])


# ---------------------------------------------------------------- kvlc init --pcp-size
def test_init_pcp_specs_pair_with_the_decode_layouts():
    """`kvlc init --pcp-size` writes PCP specs (alone, and x DCP) that pair with DeepSeek-V3 TP8 DCP8, both ways."""
    import json
    from kvlc.init import EngineOptions, init_checked
    cfg = json.loads((LAYOUTS / "configs" / "deepseek-v3.config.json").read_text())
    dcp8 = kvlc.compile_spec(V3_DCP8)
    for extra in ({}, {"dcp_size": 2, "dcp_interleave": 64}, {"dcp_size": 16}):
        spec = kvlc.compile_spec(init_checked(cfg, EngineOptions(tp_size=8, pcp_size=2, block_size=64, num_blocks=64,
                                                                 model_name="deepseek-ai/DeepSeek-V3", **extra)))
        assert spec.parallel.pcp_size == 2 and spec.parallel.ranks == 16 and "-tp8-pcp2" in spec.name
        assert check_pair(dcp8, spec, local_rank=0, direction="READ").ok
        assert check_pair(spec, dcp8, local_rank=15, direction="READ").ok


def test_init_refuses_pcp_dcp_sizes_vllm_refuses():
    """--dcp-size outside {1, pcp, tp x pcp}, or over all ranks with sharded GQA heads: an InitError with the fix."""
    import json
    from kvlc.init import EngineOptions, InitError, init_yaml
    ds = json.loads((LAYOUTS / "configs" / "deepseek-v3.config.json").read_text())
    qwen = json.loads((LAYOUTS / "configs" / "qwen3-235b-a22b.config.json").read_text())
    with pytest.raises(InitError, match=r"--dcp-size 4 with --pcp-size 2 and --tp-size 8.*\[1, 2, 16\]"):
        init_yaml(ds, EngineOptions(tp_size=8, pcp_size=2, dcp_size=4))
    with pytest.raises(InitError, match=r"--dcp-size 16 over all 8 x 2 ranks with 4 KV heads.*--dcp-size 2"):
        init_yaml(qwen, EngineOptions(tp_size=8, pcp_size=2, dcp_size=16))
    out = CliRunner().invoke(main, ["init", str(LAYOUTS / "configs" / "deepseek-v3.config.json"), "--tp-size", "8",
                                    "--pcp-size", "2", "--block-size", "64", "--num-blocks", "8"])
    assert out.exit_code == 0 and "pcp_size: 2" in out.output and "TP8 PCP2" in out.output
