"""Decode context parallelism around the pairing: plans, requests, `kvlc init`, `kvlc pair`, descriptor cost.

The byte-level proofs are in ``test_dcp_properties.py``; these pin the interfaces and numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

import kvlc
from kvlc.cli import main
from kvlc.compiler.algebra.sharding import Shard, ShardPair, dcp_chunks, dcp_tile
from kvlc.compiler.pairing.pair import check_pair, pair
from kvlc.compiler.plan.model import Plan
from kvlc.errors import TransferError
from kvlc.init import EngineOptions, InitError, init_yaml
from kvlc import check_request
from kvlc.explain.docs import program_summary

ROOT = Path(__file__).resolve().parents[1]
DS = ROOT / "layouts" / "deepseek-v3-tp8.yaml"
DS_CONFIG = json.loads((ROOT / "layouts" / "configs" / "deepseek-v3.config.json").read_text())
QWEN_CONFIG = json.loads((ROOT / "layouts" / "configs" / "qwen3-235b-a22b.config.json").read_text())


def variant(path: Path, name: str, **parallel) -> Plan:
    spec = yaml.safe_load(path.read_text())
    spec["name"], spec["parallel"] = name, {**spec["parallel"], **parallel}
    return kvlc.compile_spec(yaml.safe_dump(spec, sort_keys=False))


# ---------------------------------------------------------------- the token map
def test_chunks_cover_each_common_token_once():
    """Every token two ranks both hold lies in exactly one run; runs stay in one kernel block each side."""
    for a, b, ka, kb in ((Shard(8, 1, 3), Shard(1), 64, 16), (Shard(4, 2, 1), Shard(2, 4, 1), 4, 8),
                         (Shard(2, 16, 0), Shard(8, 2, 2), 16, 2)):
        span = dcp_tile(ka, a, kb, b).tokens
        t = np.arange(span)
        want = t[a.holds(t) & b.holds(t)]
        got = []
        for r in dcp_chunks(ka, kb, ShardPair(a, b), span):
            assert r.a_token + r.tokens <= ka and r.b_token + r.tokens <= kb
            ja = r.a_block * ka + r.a_token + np.arange(r.tokens)
            got.extend((ja // a.interleave) * a.period + a.rank * a.interleave + ja % a.interleave)
        assert sorted(got) == want.tolist()


# ---------------------------------------------------------------- plans and requests
def test_plan_without_interleave_hashes_as_before():
    """dcp_interleave 1 is not serialized (plan digests unchanged); another value is, and round-trips."""
    plain = kvlc.compile_spec(DS)
    assert "dcp_interleave" not in plain.to_json()
    inter = variant(DS, "ds-dcp8-i64", dcp_size=8, dcp_interleave=64)
    assert '"dcp_interleave":64' in inter.to_json() and Plan.from_json(inter.to_json()) == inter
    assert "dcp=8 dcp_interleave=64" in inter.text().splitlines()[0]


def test_request_gives_one_id_per_virtual_block():
    """A DCP engine's block id covers block_size * dcp_size tokens; a count for block_size alone is refused."""
    cons, prod = variant(DS, "ds-dcp8", dcp_size=8), kvlc.compile_spec(DS)
    prog = pair(cons, prod, local_rank=0, direction="READ")
    assert cons.blocks_for("mla", 1000) == 2 and prod.blocks_for("mla", 1000) == 16
    check_request(prog, {"mla": [4, 9]}, {"mla": list(range(16))}, 1000)
    with pytest.raises(TransferError, match=r"16 local block ids for 1000 tokens; expected 2 \(block size 64 x "
                                            r"dcp_size 8\)"):
        check_request(prog, {"mla": list(range(16))}, {"mla": list(range(16))}, 1000)


# ---------------------------------------------------------------- descriptor cost
def test_interleave_sets_the_descriptor_count():
    """DeepSeek TP8 DCP8 reading TP8: one run per token at interleave 1, one per block at interleave 64."""
    prod = kvlc.compile_spec(DS)
    fine = pair(variant(DS, "ds-dcp8", dcp_size=8), prod, local_rank=0, direction="READ")
    block = pair(variant(DS, "ds-dcp8-i64", dcp_size=8, dcp_interleave=64), prod, local_rank=0, direction="READ")
    e1, e2 = fine.entries[0], block.entries[0]
    assert (e1.tile_tokens, e1.local_sub, e1.remote_sub, len(e1.runs)) == (512, 1, 8, 64)
    assert (e2.tile_tokens, len(e2.runs), e2.bytes_per_tile) == (512, 1, 64 * 576 * 2)
    assert e1.bytes_per_tile == e2.bytes_per_tile
    assert fine.peer_ranks == (0,) and dict(fine.consumer_counts) == {p: 1 for p in range(8)}


def test_prefill_dcp_to_tp1_reads_every_rank():
    """DCP on the producer side only: a TP1 consumer reads its tokens from all 8 DCP ranks."""
    prog = pair(kvlc.compile_spec(ROOT / "layouts" / "deepseek-v3-tp1.yaml"), variant(DS, "ds-dcp8", dcp_size=8),
                local_rank=0, direction="READ")
    assert prog.peer_ranks == tuple(range(8))
    assert "peer 7: tokens t with t % 8 == 7" in prog.dcp_text() and "dcp" in program_summary(prog)


# ---------------------------------------------------------------- kvlc init and kvlc pair
@pytest.mark.parametrize("config,decode,prefill", [
    (DS_CONFIG, dict(tp_size=8, dcp_size=8, block_size=64), dict(tp_size=8, block_size=64)),
    (DS_CONFIG, dict(tp_size=8, dcp_size=4, dcp_interleave=16, block_size=64), dict(tp_size=2, block_size=16)),
    (QWEN_CONFIG, dict(tp_size=8, dcp_size=2, block_size=16), dict(tp_size=4, block_size=32)),
])
def test_init_dcp_specs_pair(config, decode, prefill):
    """`kvlc init --dcp-size` writes specs that pair with the same model without DCP, both ways."""
    d = kvlc.compile_spec(init_yaml(config, EngineOptions(num_blocks=64, **decode)))
    p = kvlc.compile_spec(init_yaml(config, EngineOptions(num_blocks=64, **prefill)))
    assert d.parallel.dcp_size == decode["dcp_size"] and f"-dcp{decode['dcp_size']}-" in d.name
    for rank in range(d.parallel.tp_size):
        assert check_pair(d, p, local_rank=rank, direction="READ").ok
        assert check_pair(d, p, local_rank=rank, direction="WRITE").ok


def test_init_refuses_dcp_beyond_head_replicas():
    """4 KV heads at TP4: every rank holds its own head, so DCP2 would lose tokens: refused with a fix."""
    with pytest.raises(InitError, match=r"each head is held by 1 rank\(s\).*fix: use a --dcp-size dividing 1"):
        init_yaml(QWEN_CONFIG, EngineOptions(tp_size=4, dcp_size=2, num_blocks=8))


def test_kvlc_pair_names_dcp():
    """`kvlc pair` prints which tokens the local rank and each peer hold."""
    out = CliRunner().invoke(main, ["pair", str(ROOT / "layouts" / "qwen3-235b-a22b-tp4.yaml"),
                                    str(ROOT / "layouts" / "qwen3-235b-a22b-tp8-dcp2.yaml"), "--rank", "1"])
    assert out.exit_code == 0, out.output
    assert "local rank 1 (DCP 2) holds tokens t with t % 2 == 1; remote DCP 1: peer 0: every token" in out.output
    js = CliRunner().invoke(main, ["pair", str(ROOT / "layouts" / "qwen3-235b-a22b-tp4.yaml"),
                                   str(ROOT / "layouts" / "qwen3-235b-a22b-tp8-dcp2.yaml"), "--json"])
    assert js.exit_code == 0 and "decode context parallelism" in js.output


def test_fragmented_tokens_warn_and_block_interleave_does_not():
    """Interleave 1 against whole blocks: a 'dcp-fragmented' warning with the fix; interleave 64: none."""
    prod = kvlc.compile_spec(DS)
    rep = check_pair(variant(DS, "ds-dcp8", dcp_size=8), prod, local_rank=0, direction="READ")
    (w,) = [f for f in rep.findings if f.code == "dcp-fragmented"]
    assert rep.ok and w.severity == "warning" and "64 token runs per 512-token tile" in w.message
    assert "dcp_interleave equal to its kernel block size" in w.fix
    rep = check_pair(variant(DS, "ds-dcp8-i64", dcp_size=8, dcp_interleave=64), prod, local_rank=0,
                     direction="READ")
    assert rep.ok and rep.findings == ()


def test_compressed_cache_under_dcp_refused_with_reason():
    """A compressed cache (entries of k tokens) under DCP: 'dcp-compressed', not a wrong mapping."""
    v4 = ROOT / "layouts" / "deepseek-v4-example-b256.yaml"
    plain = kvlc.compile_spec(v4)
    dcp = variant(v4, "v4-dcp2", tp_size=2, dcp_size=2)
    rep = check_pair(dcp, plain, local_rank=0, direction="READ")
    found = [f for f in rep.findings if f.code == "dcp-compressed"]
    assert not rep.ok and found and found[0].local == "dcp_size 2" and "without DCP" in found[0].fix
