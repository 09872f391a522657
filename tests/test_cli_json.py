"""`--json` on every command that prints results: one document each, exact integers that agree with
the library, and bad input answered with exit 2 (the document says why where there is one)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

import kvlc
from kvlc.cli import main
from kvlc.explain.summary import summarize
from kvlc.explain.size import request_size

ROOT = Path(__file__).resolve().parents[1]
L = ROOT / "layouts"
SPECS = sorted(p for p in L.glob("*.yaml") if re.search(r"^kvlc:", p.read_text(), flags=re.M))


def _run(*args: str, code: int = 0) -> dict:
    res = CliRunner().invoke(main, list(args))
    assert res.exit_code == code, res.output
    return json.loads(res.stdout)


@pytest.mark.parametrize("command", ["explain", "pair", "check", "size"])
def test_every_result_command_has_json(command):
    """explain, pair, check and size take --json (compile prints JSON already; schema is JSON)."""
    res = CliRunner().invoke(main, [command, "--help"])
    assert res.exit_code == 0 and "--json" in res.stdout


@pytest.mark.parametrize("spec", SPECS, ids=lambda p: p.name)
def test_explain_json_agrees_with_summary(spec):
    """explain --json carries every region and the per-rank, engine and token-capacity totals exactly."""
    doc = _run("explain", str(spec), "--json")
    plan = kvlc.compile_spec(spec)
    s = summarize(plan)
    assert (doc["kind"], doc["plan"], doc["digest"]) == ("explain", plan.name, plan.digest)
    assert doc["per_rank"] == {"region_bytes": s.total_bytes, "storage_bytes": s.total_size}
    tp = plan.parallel.tp_size
    assert doc["engine"] == {"ranks": tp, "region_bytes": tp * s.total_bytes, "storage_bytes": tp * s.total_size}
    assert [r["name"] for r in doc["regions"]] == [r.name for r in plan.regions]
    assert sum(r["bytes"] for r in doc["regions"]) == s.total_bytes
    for g, pg in zip(doc["groups"], plan.groups):
        cap = plan.group_capacity(pg.name) if any(pg.name in r.groups for r in plan.regions) else 0
        assert g["capacity"] == cap
        expected = None if pg.is_state else cap * pg.block_size * plan.group_dcp(pg.name)
        assert g["engine_tokens"] == expected
    assert sum(run["count"] for run in doc["runs"]) == len(plan.regions)


def test_explain_json_replicas():
    """A replicated MLA latent at TP8 is held by 8 ranks; Llama-70B's sharded heads by one."""
    ds = _run("explain", str(L / "deepseek-v3-tp8.yaml"), "--json")
    assert {r["replicas"] for r in ds["regions"]} == {8}
    ll = _run("explain", str(L / "llama-3.1-70b-tp8.yaml"), "--json")
    assert {r["replicas"] for r in ll["regions"]} == {1}


def test_pair_json_compatible_and_not(tmp_path):
    """pair --json: a compatible HND pair lists its parts; a pair of two models exits 2 with the finding."""
    doc = _run("pair", str(L / "llama-3.1-70b-hnd-tp8.yaml"), str(L / "llama-3.1-70b-hnd-tp4.yaml"), "--json")
    assert doc["kind"] == "pair" and doc["compatible"] and doc["peer_ranks"] == [0, 1]
    assert [f for f in doc["findings"] if f["severity"] == "warning"] == []
    assert [(p["peer_rank"], p["runs_per_tile"]) for p in doc["parts"]] == [(0, 160), (1, 160)]
    assert [(h["peer_rank"], h["field"], h["heads"]) for h in doc["heads"]] == [
        (0, "k", [0, 1]), (0, "v", [0, 1]), (1, "k", [1, 2]), (1, "v", [1, 2])]
    bad = _run("pair", str(L / "llama-3.1-8b.yaml"), str(L / "deepseek-v3-tp1.yaml"), "--json", code=2)
    assert bad["compatible"] is False and "model-name" in {f["code"] for f in bad["findings"]}


def test_check_json(tmp_path):
    """check --json: ok specs with their digest, a broken one with its located problem; exit 2 if any fails."""
    good = _run("check", str(L / "llama-3.1-8b.yaml"), "--json")
    assert good["ok"] and good["specs"][0]["digest"] == kvlc.compile_spec(L / "llama-3.1-8b.yaml").digest
    bad = tmp_path / "bad.yaml"
    bad.write_text((L / "llama-3.1-8b.yaml").read_text().replace("mem: VRAM", "mem: HBM"))
    doc = _run("check", str(L / "llama-3.1-8b.yaml"), str(bad), "--json", code=2)
    assert [s["ok"] for s in doc["specs"]] == [True, False] and doc["ok"] is False
    (problem,) = doc["specs"][1]["problems"]
    assert problem["file"] == str(bad) and problem["line"] > 1 and "HBM" in problem["text"]


def test_size_json_same_plan():
    """1,024 tokens of Llama-8B: 64 blocks a region; scattered ids 64 descriptors a region, contiguous one."""
    doc = _run("size", str(L / "llama-3.1-8b.yaml"), "--tokens", "1024", "--json")
    assert doc["kind"] == "size" and doc["tokens"] == 1024
    (g,) = doc["groups"]
    assert (g["blocks"], g["bytes"]) == (64, 64 * 32 * 65536)
    (r,) = doc["ranks"]
    assert r["bytes"] == 1024 * 131072 == doc["engine"]["moved"]
    assert (r["descriptors_scattered"], r["descriptors_contiguous"]) == (32 * 64, 32)


def test_size_json_across_tp():
    """TP4 decode pulling from TP8 prefill (HND): each rank reads its 2 heads from 2 peers; the engine all 8."""
    doc = _run("size", str(L / "llama-3.1-70b-hnd-tp4.yaml"), "--peer", str(L / "llama-3.1-70b-hnd-tp8.yaml"),
               "--tokens", "1000", "--json")
    per_token_engine = 80 * 2 * 8 * 128 * 2          # layers x (k, v) x heads x head_dim x bf16
    assert doc["engine"]["moved"] == 1000 * per_token_engine
    assert [r["peers"] for r in doc["ranks"]] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert all(r["bytes"] == 1000 * per_token_engine // 4 for r in doc["ranks"])
    lib = request_size(kvlc.compile_spec(L / "llama-3.1-70b-hnd-tp4.yaml"), 1000,
                       kvlc.compile_spec(L / "llama-3.1-70b-hnd-tp8.yaml"))
    assert doc["engine"]["descriptors_scattered"] == lib.scattered
    assert all(r["descriptors_contiguous"] <= r["descriptors_scattered"] for r in doc["ranks"])
    one = _run("size", str(L / "llama-3.1-70b-hnd-tp4.yaml"), "--peer", str(L / "llama-3.1-70b-hnd-tp8.yaml"),
               "--tokens", "1000", "--rank", "2", "--json")
    assert [r["rank"] for r in one["ranks"]] == [2] and one["ranks"][0] == doc["ranks"][2]


def test_size_push_counts_producer_ranks():
    """--direction push: SPEC writes to PEER; each TP8 producer rank writes its head to one consumer rank."""
    doc = _run("size", str(L / "llama-3.1-70b-hnd-tp8.yaml"), "--peer", str(L / "llama-3.1-70b-hnd-tp4.yaml"),
               "--tokens", "64", "--direction", "push", "--json")
    assert doc["direction"] == "WRITE" and [r["peers"] for r in doc["ranks"]] == [[p // 2] for p in range(8)]


@pytest.mark.parametrize("args, message", [
    (["--tokens", "70000"], "ask for at most 65,536 tokens"),
    (["--tokens", "16", "--rank", "3"], "rank 3 outside plan"),
    (["--tokens", "0"], "0 is not in the range"),
])
def test_size_bad_input_exits_2(args, message):
    """Too many tokens, a rank outside the plan and a non-positive length are refused with the fix."""
    res = CliRunner().invoke(main, ["size", str(L / "llama-3.1-8b.yaml"), *args])
    assert res.exit_code == 2 and message in res.output
    assert "Traceback" not in res.output


def test_size_incompatible_peer_exits_2():
    """A peer that does not pair is a compatibility report, not a traceback."""
    res = CliRunner().invoke(main, ["size", str(L / "llama-3.1-8b.yaml"), "--peer", str(L / "deepseek-v3-tp1.yaml"),
                                    "--tokens", "16"])
    assert res.exit_code == 2 and "model" in res.output and "Traceback" not in res.output


def _pairs():
    import yaml
    return yaml.safe_load((L / "pairs" / "pairs.yaml").read_text())["pairs"]


@pytest.mark.parametrize("p", _pairs(), ids=lambda p: p["name"])
def test_size_for_every_checked_in_pair(p):
    """Every named pairing sizes a 100-token request: bytes move, contiguous ids never need more descriptors."""
    cons, prod = kvlc.compile_spec(L / p["consumer"]), kvlc.compile_spec(L / p["producer"])
    s = request_size(cons, 100, prod)
    assert len(s.ranks) == cons.parallel.tp_size and s.moved > 0
    for r in s.ranks:
        assert r.bytes > 0 and 0 < r.contiguous <= r.scattered
        assert set(r.peers) <= set(range(prod.parallel.ranks))  # tp_size * pcp_size ranks
    assert s.engine_bytes == s.rank_bytes * cons.parallel.tp_size


def test_pair_html_written_only_for_a_pair(tmp_path):
    """pair --html writes the page for a compatible pair, and nothing (saying so) for an incompatible one."""
    good, bad = tmp_path / "good.html", tmp_path / "bad.html"
    res = CliRunner().invoke(main, ["pair", str(L / "llama-3.1-70b-hnd-tp8.yaml"), str(L / "llama-3.1-70b-hnd-tp4.yaml"),
                                    "--html", str(good)])
    assert res.exit_code == 0 and good.read_text().startswith("<!DOCTYPE html>")
    res = CliRunner().invoke(main, ["pair", str(L / "llama-3.1-8b.yaml"), str(L / "deepseek-v3-tp1.yaml"),
                                    "--html", str(bad)])
    assert res.exit_code == 2 and not bad.exists() and "not written" in res.stderr
