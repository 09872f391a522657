"""Groups that decode context parallelism does not shard (`dcp: replicated`): plan, pairing and refusals."""

from __future__ import annotations

from pathlib import Path

import kvlc
from kvlc.compiler.pairing.pair import check_pair, pair

LAYOUTS = Path(__file__).resolve().parents[1] / "layouts"
DCP_MTP = LAYOUTS / "deepseek-v3-tp8-dcp8-mtp.yaml"
TP8_MTP = LAYOUTS / "deepseek-v3-tp8-mtp.yaml"


def test_replicated_group_counts_block_size_tokens_per_id():
    """A replicated group's block id covers block_size tokens; the DCP-sharded group's covers block_size * dcp."""
    plan = kvlc.compile_spec(DCP_MTP)
    assert (plan.group_dcp("mla"), plan.group_dcp("mtp")) == (8, 1)
    assert (plan.blocks_for("mla", 4096), plan.blocks_for("mtp", 4096)) == (8, 64)
    assert plan.region("layer.61").dcp_replicated and not plan.region("layer.0").dcp_replicated
    assert "dcp=replicated" in plan.text().splitlines()[2]


def test_replicated_without_dcp_changes_nothing():
    """`dcp: replicated` on an engine without DCP is the plan of the same spec without it (same digest)."""
    text = TP8_MTP.read_text()
    with_key = text.replace("{name: mtp, kind: full_attention}", "{name: mtp, kind: full_attention, dcp: replicated}")
    assert with_key != text
    assert kvlc.compile_spec(with_key).digest == kvlc.compile_spec(text).digest


def test_replicated_region_moves_from_one_rank_and_is_written_once():
    """Pull: each DCP rank reads the whole MTP cache from one producer rank. Push: every consumer rank's MTP
    cache is written by exactly one producer rank (never twice), the main cache by all eight."""
    dcp, tp8 = kvlc.compile_spec(DCP_MTP), kvlc.compile_spec(TP8_MTP)
    for c in range(8):
        prog = pair(dcp, tp8, local_rank=c, direction="READ")
        assert [e.peer for e in prog.entries if e.region == "layer.61"] == [c]
        assert all(e.shards is None for e in prog.entries if e.region == "layer.61")
    writers: dict[int, list[int]] = {}
    for p in range(8):
        for e in pair(dcp, tp8, local_rank=p, direction="WRITE").entries:
            if e.region == "layer.61":
                writers.setdefault(e.peer, []).append(p)
    assert writers == {c: [c] for c in range(8)}


def _with_scale(text: str, name: str) -> str:
    """The spec with a per-block field (one scale per block, no token dim) in the latent layout."""
    return text.replace(f"name: {name}", f"name: {name}-scale").replace(
        "          - {name: latent}\n", "          - {name: latent}\n      - name: scale\n        dtype: fp32\n"
        "        dims: [{name: sc, size: 1}]\n", 1)


def test_per_block_field_replicated_vs_sharded_is_refused():
    """A per-block field whose group one side replicates and the other shards by DCP has no counterpart:
    `dcp-per-block`, naming both shardings."""
    dcp = kvlc.compile_spec(_with_scale(DCP_MTP.read_text(), "deepseek-v3-tp8-dcp8-mtp"))
    sharded = kvlc.compile_spec(_with_scale(DCP_MTP.read_text().replace(
        "{name: mtp, kind: full_attention, dcp: replicated}", "{name: mtp, kind: full_attention}"),
        "deepseek-v3-tp8-dcp8-mtp"))
    rep = check_pair(dcp, sharded, local_rank=0, direction="READ")
    codes = {(f.code, f.region) for f in rep.errors}
    assert codes == {("dcp-per-block", "layer.61")}
    f = rep.errors[0]
    assert "replicated under dcp_size 8" in f.local and f.remote.startswith("dcp_size 8, dcp_interleave 1")
    same = check_pair(dcp, dcp, local_rank=0, direction="READ")
    assert same.ok, same.render()
