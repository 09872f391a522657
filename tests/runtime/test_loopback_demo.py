"""The loopback demo: CPU variants of checked-in layouts, the byte checker it relies on, one real run."""

from __future__ import annotations

import numpy as np
import pytest
from runtime_engines import LAYOUTS, TEST_LAYOUTS

from kvlc import compile_spec
from kvlc.demo.content import expected_bytes
from kvlc.compiler.pairing.pair import pair
from kvlc.demo.run import DemoError, cpu_plan, make_workload, scaled_plan, verify

pytestmark = pytest.mark.runtime


def test_cpu_variant_keeps_layouts_ratios_and_pairing():
    """DRAM everywhere, pools scaled by one factor, block layouts untouched: the variants still pair."""
    full = compile_spec(LAYOUTS / "gemma-3-27b-tp2-b16.yaml")
    small = cpu_plan(LAYOUTS / "gemma-3-27b-tp2-b16.yaml", 8 << 20)
    assert small.mem_types == ("DRAM",) and sum(s.size for s in small.storages) <= 8 << 20
    by_name = {r.name: r for r in small.regions}
    for r in full.regions:
        s = by_name[r.name]
        assert (s.fields, s.block_bytes, s.groups, s.block_tokens) == (
            r.fields,
            r.block_bytes,
            r.groups,
            r.block_tokens,
        )
    local, glob = by_name["layer.0"].num_blocks, by_name["layer.5"].num_blocks
    assert 4 <= glob / local <= 5  # global:local pools stay about 4:1
    other = cpu_plan(LAYOUTS / "gemma-3-27b-tp2-b32.yaml", 8 << 20)
    assert pair(other, small, local_rank=1, direction="READ").peer_ranks == (1,)
    kept = scaled_plan(LAYOUTS / "deepseek-v3.2-hisparse-tp8.yaml", 64 << 20, to_dram=False)
    assert kept.mem_types == ("DRAM", "VRAM")


@pytest.mark.parametrize("pattern", ["random", "scattered", "contiguous"])
def test_workload_rounds_have_disjoint_destinations(pattern):
    """Within a round no two requests share a destination block; every id fits its pool; each pattern
    draws the ids it says (runs where it says contiguous, scattered ones where it says random)."""
    c = cpu_plan(LAYOUTS / "gemma-3-27b-tp2-b32.yaml", 128 << 20)
    p = cpu_plan(LAYOUTS / "gemma-3-27b-tp2-b16.yaml", 128 << 20)
    rounds = make_workload(c, p, 10, 96, ids=pattern)
    assert sum(len(b) for b in rounds) == 10
    runs = {"consumer": [], "producer": []}
    for batch in rounds:
        for g in ("local", "global"):
            ids = [i for _, cids, _, _ in batch for i in cids[g]]
            assert len(ids) == len(set(ids))
            assert all(0 <= i < c.group_capacity(g) for i in ids)
            assert all(0 <= i < p.group_capacity(g) for _, _, pids, _ in batch for i in pids[g])
            for _, cids, pids, _ in batch:
                for side, got in (("consumer", cids[g]), ("producer", pids[g])):
                    runs[side].append(got == list(range(got[0], got[0] + len(got))))
    assert all(runs["consumer"]) == (pattern != "scattered")
    assert all(runs["producer"]) == (pattern == "contiguous")


def test_workload_refuses_an_unknown_pattern():
    c = cpu_plan(LAYOUTS / "gemma-3-27b-tp2-b32.yaml", 32 << 20)
    with pytest.raises(DemoError, match="ids 'striped': use one of random, scattered, contiguous"):
        make_workload(c, c, 2, 32, ids="striped")


def test_verify_catches_wrong_and_stray_bytes():
    """The checker passes exact content, names a wrong requested byte and a changed byte elsewhere."""
    plan = compile_spec(TEST_LAYOUTS / "dense-tp1.yaml")
    rng = np.random.default_rng(0)
    before = {s.name: rng.integers(0, 256, s.size, dtype=np.uint8) for s in plan.storages}
    batch = [("r", {"full": [3, 4]}, {"full": [9, 1]}, 20)]
    after = {k: v.copy() for k, v in before.items()}
    for storage, idx, vals in expected_bytes(plan, 0, plan, batch[0][1], batch[0][2], 20):
        after[storage][idx] = vals
    checked, problems = verify(plan, 0, plan, before, after, batch)
    assert checked == 20 * 256 * 2 and problems == []
    after["kv.1"][3 * 4096 + 5] ^= 1
    after["kv.0"][10 * 4096] ^= 1
    _, problems = verify(plan, 0, plan, before, after, batch)
    assert any("r: rank 0 storage kv.1: 1 wrong bytes" in p for p in problems)
    assert any("storage kv.0: 1 bytes outside the requested blocks changed" in p for p in problems)


def test_run_demo_end_to_end():
    """Two processes, pull-via-push, every byte checked, progress reported after every round."""
    pytest.importorskip("nixl")
    seen = []
    from kvlc.demo.run import run_demo

    res = run_demo(
        TEST_LAYOUTS / "hybrid-tp1.yaml",
        mode="pull_via_push",
        requests=6,
        max_bytes=1 << 20,
        progress=lambda *a: seen.append(a),
    )
    assert res.ok, (res.mismatches, res.failed)
    assert res.requests == 6 and res.checked_bytes > 0 and res.gbps > 0 and res.descriptors_per_request > 0
    assert seen and seen[-1][0] == 6 and seen[-1][1] == 6


@pytest.mark.parametrize("prod,cons,mode", [("mla-pcp2-dcp2", "mla-tp1", "pull"), ("mla-tp1", "mla-tp2-pcp2", "pull"),
                                            ("mla-pcp2-dcp2", "mla-tp2-pcp2", "push"),
                                            ("mla-tp2-pcp2", "mla-tp1", "pull_via_push")])
def test_pcp_engines_move_every_byte(prod, cons, mode):
    """Engines of tp_size x pcp_size ranks (an agent per rank, PCP ranks from tp_size up): a PCP x DCP
    producer's tokens split over its DCP ranks, a replicated PCP engine on either side; real NIXL agents,
    every byte of every consumer rank checked."""
    pytest.importorskip("nixl")
    from kvlc.demo.run import run_demo

    res = run_demo(TEST_LAYOUTS / f"{prod}.yaml", TEST_LAYOUTS / f"{cons}.yaml", mode=mode, requests=6,
                   max_bytes=1 << 20)
    assert res.ok and res.requests == 6 and res.verified_requests == 6, (res.mismatches, res.failed)
    # every consumer rank holds the whole latent (64 bytes per token and layer, 2 layers): a PCP consumer's
    # 4 ranks are 4 replicas, each filled and checked; every byte moved was checked
    ranks = 4 if cons == "mla-tp2-pcp2" else 1
    assert res.checked_bytes == res.nbytes and res.nbytes % (ranks * 6 * 2 * 64) == 0


def _shared_pool_specs() -> tuple[str, str]:
    """A TP2 producer and a TP1 consumer whose attention blocks and two Mamba groups' states share each
    layer's pages (declared aliases: a hybrid engine's one pool), as YAML."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_alias_properties import pool_spec

    return pool_spec("p", 2, 4, 12, 6), pool_spec("c", 1, 8, 9, 6)


def _shared_pool_plans():
    return tuple(compile_spec(text) for text in _shared_pool_specs())


def test_shared_page_pools_hold_each_groups_content_on_its_own_pages():
    """fill() puts a group's codes on the pages page_shares gives it (nothing else there), and the workload
    gives each group only those: three groups share each pool, so group i gets the pages p % 3 == i."""
    from kvlc.demo.content import fill, own_pages, page_shares

    prod, cons = _shared_pool_plans()
    assert page_shares(prod) == {"full": (3, 0), "ssm_a": (3, 1), "ssm_b": (3, 2)}
    assert own_pages(prod, "ssm_b").tolist() == [2, 5, 8, 11]
    whole = {s.name: np.zeros(s.size, np.uint8) for s in prod.storages}
    fill(prod, 0, whole)
    for r in prod.regions:  # each region alone, on a scratch copy: its group's pages must match the whole fill
        alone = {s.name: np.zeros(s.size, np.uint8) for s in prod.storages}
        fill(prod.model_copy(update={"regions": (r,)}), 0, alone)
        (group,) = r.groups
        m = 1 if r.is_state else prod.group(group).kernel_blocks_per_block
        for page in own_pages(prod, group).tolist():
            for k in range(page * m, page * m + m):
                lo = r.offset + k * r.block_stride
                assert np.array_equal(whole[r.storage][lo:lo + r.block_bytes], alone[r.storage][lo:lo + r.block_bytes])
    for ids in ("random", "scattered", "contiguous"):
        for batch in make_workload(cons, prod, 6, 9, ids=ids):
            for _, cids, pids, _ in batch:
                for side, plan, got in (("consumer", cons, cids), ("producer", prod, pids)):
                    for g, blocks in got.items():
                        assert set(blocks) <= set(own_pages(plan, g).tolist()), (ids, side, g, blocks)


@pytest.mark.parametrize("mode", ["pull", "push", "pull_via_push"])
def test_run_demo_checks_shared_page_pools(tmp_path, mode):
    """Two processes, hybrid pools on both sides (TP2 -> TP1, 4- and 8-token blocks), every byte checked:
    the demo's own check of such layouts (each group's pages hold its content) passes in every mode."""
    pytest.importorskip("nixl")
    from kvlc.demo.run import run_demo

    prod, cons = _shared_pool_specs()
    (tmp_path / "p.yaml").write_text(prod)
    (tmp_path / "c.yaml").write_text(cons)
    res = run_demo(tmp_path / "p.yaml", tmp_path / "c.yaml", mode=mode, requests=4, tokens=13, ids="scattered",
                   check="all", timeout=30.0)
    assert res.ok, (res.failed, res.mismatches[:3])
    assert res.requests == 4 and res.verified_requests == 4 and res.checked_bytes > 0


def test_workload_gives_each_side_the_groups_pairing_links():
    """An MTP layer in its own group on the TP8 producer and in the main group on the TP1 consumer: a request
    carries the consumer's 'mla' ids and the producer's 'mla' and 'mtp' ids (as many as the tokens need)."""
    from kvlc.demo.workload import linked_groups

    prod = cpu_plan(LAYOUTS / "deepseek-v3-tp8-mtp.yaml", 16 << 20)
    cons = cpu_plan(LAYOUTS / "deepseek-v3-tp1-mtp.yaml", 16 << 20)
    assert linked_groups(cons, prod) == (["mla"], ["mla", "mtp"])
    assert linked_groups(prod, cons) == (["mla", "mtp"], ["mla"])
    for _, cids, pids, n in make_workload(cons, prod, 3, 100, ids="scattered")[0]:
        assert set(cids) == {"mla"} and set(pids) == {"mla", "mtp"}
        assert len(pids["mtp"]) == prod.blocks_for("mtp", n) and len(cids["mla"]) == cons.blocks_for("mla", n)


def test_run_demo_checks_a_layer_in_another_group():
    """The same pair end to end (pull): every byte of the MTP layer checked against the producer's 'mtp' blocks."""
    pytest.importorskip("nixl")
    from kvlc.demo.run import run_demo

    res = run_demo(LAYOUTS / "deepseek-v3-tp8-mtp.yaml", LAYOUTS / "deepseek-v3-tp1-mtp.yaml", mode="pull",
                   requests=2, max_bytes=16 << 20, ids="scattered", check="all", timeout=30.0)
    assert res.ok, (res.failed, res.mismatches[:3])
    assert res.verified_requests == 2 and res.checked_bytes > 0
