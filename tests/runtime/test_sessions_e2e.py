"""Engine sessions with real NIXL agents, one process per engine: two producer engines and three consumer
engines of mixed TP (two of them with the same plan), every mode at once, every request's bytes checked;
then one producer engine is killed with requests in flight and restarted under the same engine id.

  P1  tiny dense TP1, 16-token blocks   (content-coded producer engine)
  P2  tiny dense TP2, HND, 32-token blocks (content-coded producer engine, two ranks)
  C1  tiny dense TP1  C2  tiny dense TP2 HND b32  C3  tiny dense TP1 (the same plan as C1)
"""

from __future__ import annotations

import pytest
from runtime_engines import TEST_LAYOUTS, TIMEOUT, check_from_many, config, flip

from kvlc import compile_spec
from kvlc.demo.procs import EngineProcess, stop_engines

pytest.importorskip("torch")
pytest.importorskip("nixl")
pytestmark = pytest.mark.runtime
MODES = ("direct", "prepped", "pull_via_push", "push")


@pytest.fixture(scope="module")
def plans():
    return {"tp1": compile_spec(TEST_LAYOUTS / "dense-tp1.yaml"),
            "tp2": compile_spec(TEST_LAYOUTS / "dense-tp2-hnd-b32.yaml")}


def _engine(proc, plan, engine_id, fill, seed=0):
    hs = [proc.add_async(config(plan, r, fill, seed + r, engine_id=engine_id))
          for r in range(plan.parallel.tp_size)]
    return [h.ready() for h in hs]


@pytest.fixture(scope="module")
def world(plans):
    procs = {n: EngineProcess() for n in ("P1", "P2", "C1", "C2", "C3")}
    spec = {"P1": ("tp1", "content"), "P2": ("tp2", "content"), "C1": ("tp1", "random"),
            "C2": ("tp2", "random"), "C3": ("tp1", "random")}
    eng = {n: _engine(procs[n], plans[p], n, fill, seed=10 * i) for i, (n, (p, fill)) in enumerate(spec.items())}
    yield {"procs": procs, "eng": eng, "plan": {n: plans[p] for n, (p, _) in spec.items()}}
    stop_engines([h for hs in eng.values() for h in hs])
    for p in procs.values():
        p.kill()


def _connect(world, consumers, producers, tag):
    eng = world["eng"]
    for c in consumers:
        for p in producers:
            for mode in MODES:
                if mode == "push":
                    for h in eng[p]:
                        h.connect([x.address for x in eng[c]], "WRITE", "direct", f"{tag}-{c}")
                else:
                    for h in eng[c]:
                        h.connect([x.address for x in eng[p]], "READ", mode, f"{tag}-{p}-{mode}")


def _requests(world, c, p, mode, slot, tag):
    """One request of consumer engine c from producer engine p: 20 tokens into fresh consumer blocks."""
    plan_c, plan_p = world["plan"][c], world["plan"][p]
    nc, np_ = plan_c.blocks_for("full", 20), plan_p.blocks_for("full", 20)
    cids = {"full": list(range(slot * nc, (slot + 1) * nc))}
    pids = {"full": [(7 * slot + 3 * k + (p == "P2")) % 40 for k in range(np_)]}
    return (f"{tag}-{c}-{p}-{mode}", cids, pids, 20)


def _round(world, consumers, producers, tag, first_slot, peer_tag="s"):
    """Every consumer × producer × mode moves one request; returns {consumer: [(producer plan, reqs)]}."""
    eng = world["eng"]
    plan = world["plan"]
    before = {c: [h.call("dump") for h in eng[c]] for c in consumers}
    batches = {c: [] for c in consumers}
    waits = {}
    slot = first_slot
    for c in consumers:
        for p in producers:
            for mode in MODES:
                req = _requests(world, c, p, mode, slot, tag)
                slot += 1
                batches[c].append((plan[p], [req]))
                if mode == "push":
                    for h in eng[p]:
                        assert h.call("submit", f"{peer_tag}-{c}", "write", flip([req]), TIMEOUT) == {}
                        waits.setdefault(id(h), (h, []))[1].append(req[0])
                else:
                    for h in eng[c]:
                        assert h.call("submit", f"{peer_tag}-{p}-{mode}", "read", [req], TIMEOUT) == {}
                for h in eng[c]:
                    waits.setdefault(id(h), (h, []))[1].append(req[0])
    for h, ids in waits.values():
        out = h.call("wait", ids, TIMEOUT + 10)
        assert out["failed"] == {} and out["open"] == [], out
    for c in consumers:
        for h, b in zip(eng[c], before[c]):
            check_from_many(h, plan[c], b, batches[c])
    return batches


def test_two_producers_three_consumers_every_mode_bytes_checked(world):
    """2 producer engines × 3 consumer engines (TP1, TP2, and TP1 again with the same plan as the first),
    4 modes each: every request lands byte-exact in its own consumer engine, none replaces another's
    session, and each producer rank reports every request it served freeable."""
    _connect(world, ("C1", "C2", "C3"), ("P1", "P2"), "s")
    for h in world["eng"]["P1"] + world["eng"]["P2"]:
        h.call("events")
    _round(world, ("C1", "C2", "C3"), ("P1", "P2"), "round1", 0)
    for p in ("P1", "P2"):
        for h in world["eng"][p]:
            ev = h.call("events")
            served = {r for r in ev["freeable"]}
            assert len(served) == 3 * len(MODES) and ev["failed"] == {} and ev["flips"] == []


DOOMED_S = 6.0  # the deadline of requests whose producer is killed (those asked end once its side channel is seen lost)


def test_restarted_producer_replaces_only_its_own_sessions(world, plans):
    """P1 is killed with requests in flight and restarted under the same engine id (a new epoch):
    its old in-flight requests end failed (none open, none finished), consumers reconnect, the new P1
    and the untouched P2 both serve every consumer byte-exact."""
    eng, procs = world["eng"], world["procs"]
    c1 = eng["C1"][0]
    inflight = [(f"old-{i}", {"full": [60, 61]}, {"full": [i, i + 1]}, 20) for i in range(20)]
    c1.call("submit", "s-P1-pull_via_push", "read", inflight, DOOMED_S)
    procs["P1"].kill()
    out = c1.call("wait", [r[0] for r in inflight], DOOMED_S + 10)
    assert out["open"] == [] and len(out["failed"]) + len(out["finished"]) == len(inflight)
    procs["P1"] = EngineProcess()
    eng["P1"] = _engine(procs["P1"], plans["tp1"], "P1", "content")
    _connect(world, ("C1", "C2", "C3"), ("P1",), "r")
    for c in ("C1", "C2", "C3"):
        for h in eng[c]:
            assert h.call("events")["flips"] == []
    # the old connection to P1 is gone for good; P2's sessions are untouched
    errors = c1.call("submit", "s-P1-direct", "read", [("stale", {"full": [62]}, {"full": [1]}, 16)], TIMEOUT)
    assert "restarted or went away" in errors["stale"] or "closed" in errors["stale"]
    _round(world, ("C1", "C2", "C3"), ("P2",), "round2", 20)
    _round_restarted(world)


def _round_restarted(world):
    """Every consumer × mode from the restarted P1, over the new connections."""
    eng, plan = world["eng"], world["plan"]
    for c in ("C1", "C2", "C3"):
        before = [h.call("dump") for h in eng[c]]
        batch = []
        for k, mode in enumerate(MODES):
            req = _requests(world, c, "P1", mode, 28 + k, "round3")
            batch.append((plan["P1"], [req]))
            if mode == "push":
                assert eng["P1"][0].call("submit", f"r-{c}", "write", flip([req]), TIMEOUT) == {}
                assert eng["P1"][0].call("wait", [req[0]], TIMEOUT)["failed"] == {}
            else:
                for h in eng[c]:
                    assert h.call("submit", f"r-P1-{mode}", "read", [req], TIMEOUT) == {}
            for h in eng[c]:
                got = h.call("wait", [req[0]], TIMEOUT)
                assert got["failed"] == {} and got["open"] == [], got
        for h, b in zip(eng[c], before):
            check_from_many(h, plan[c], b, batch)
