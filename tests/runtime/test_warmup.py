"""The connect-time warm-up (kvlc.runtime.nixl.warmup) between real NIXL agents in this process: it READs
the first bytes of every peer storage into a scratch buffer of its own, changes no byte of either
KV cache, releases its handles, and never fails a connection. (On a CPU machine the default warms
nothing, VRAM only; these tests ask for DRAM.)"""

from __future__ import annotations

import pytest
from runtime_engines import SECRET, TEST_LAYOUTS

from kvlc import compile_spec
from kvlc.runtime.settings import AgentSettings
from kvlc.runtime.nixl.core import Registration, Xfer
from kvlc.runtime.nixl.warmup import TOUCH, warm_peers

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")
pytestmark = pytest.mark.runtime
DRAM = frozenset({"DRAM"})


@pytest.fixture
def pair():
    from kvlc.runtime import KvAgent, allocate

    plan = compile_spec(TEST_LAYOUTS / "dense-tp1.yaml")
    tp, tc = allocate(plan), allocate(plan)
    for i, t in enumerate(list(tp.values()) + list(tc.values())):
        t.copy_(torch.randint(0, 256, (t.numel(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(i)))
    prod = KvAgent(plan, 0, tp, AgentSettings(secret=SECRET, engine_id="warm-p"))
    cons = KvAgent(plan, 0, tc, AgentSettings(secret=SECRET, engine_id="warm-c"))
    prod.serve()
    yield plan, prod, cons, tp, tc
    cons.close()
    prod.close()


def test_warm_up_reads_every_peer_storage_and_changes_no_kv_byte(pair):
    """The scratch holds the peer's first bytes of its last storage read (all land in one scratch);
    both sides' KV bytes are unchanged; no transfer handle is left; one scratch registration."""
    plan, prod, cons, tp, tc = pair
    before = {n: t.clone() for n, t in list(tp.items()) + [("c/" + n, t) for n, t in tc.items()]}
    peer = cons.connect(prod.address, direction="READ", warm=False)
    regs = len(cons.nixl.live(Registration))
    problems = warm_peers(cons, [prod.record], DRAM)
    assert problems == {}
    scratch = cons.warmer._scratch["DRAM"][0]
    firsts = [tp[s.name][:TOUCH] for s in prod.record.storages]
    assert any(torch.equal(scratch, f) for f in firsts)
    assert len(cons.nixl.live(Registration)) == regs + 1 and cons.nixl.live(Xfer) == []
    after = {n: t for n, t in list(tp.items()) + [("c/" + n, t) for n, t in tc.items()]}
    assert all(torch.equal(before[n], after[n]) for n in before), "a warm-up changed KV bytes"
    assert warm_peers(cons, [prod.record], DRAM) == {}  # again: the scratch is reused
    assert len(cons.nixl.live(Registration)) == regs + 1
    peer.read("after-warm", {"full": [3]}, {"full": [5]}, 16)
    assert cons.wait(["after-warm"], timeout=20).finished == ("after-warm",)


def test_warm_up_of_memory_the_peer_never_registered_only_reports(pair):
    """A record whose storage lies outside what the peer registered: NIXL refuses the READ; the
    warm-up says why for that peer and raises nothing; no handle is left."""
    plan, prod, cons, *_ = pair
    cons.connect(prod.address, direction="READ", warm=False)
    rec = prod.record
    bad = rec.model_copy(update={"storages": tuple(s.model_copy(update={"addr": s.addr + (1 << 40)})
                                                   for s in rec.storages)})
    problems = warm_peers(cons, [bad], DRAM)
    assert set(problems) == {rec.agent} and problems[rec.agent]
    assert cons.nixl.live(Xfer) == []


def test_default_warm_up_touches_only_vram(pair):
    """With the default memory types (VRAM), a DRAM-only pair connects without any warm-up READ:
    no scratch is registered."""
    plan, prod, cons, *_ = pair
    regs = len(cons.nixl.live(Registration))
    cons.connect(prod.address, direction="READ")
    assert cons.warmer._scratch == {} and len(cons.nixl.live(Registration)) == regs


def test_pull_via_push_producer_warms_the_consumer_it_will_write_to(pair, monkeypatch):
    """Pull via push: the producer moves the bytes, so it warms (on the consumer's hello); the
    consumer's connect still succeeds and its requests land."""
    from kvlc.runtime.nixl.warmup import Warmer

    monkeypatch.setattr(Warmer, "MEMS", DRAM)
    plan, prod, cons, tp, tc = pair
    peer = cons.connect(prod.address, direction="READ", mode="pull_via_push")
    assert "DRAM" in prod.warmer._scratch and cons.warmer._scratch == {}
    assert prod.nixl.live(Xfer) == []
    peer.read("pvp-after-warm", {"full": [2]}, {"full": [4]}, 16)
    assert cons.wait(["pvp-after-warm"], timeout=20).finished == ("pvp-after-warm",)
    assert torch.equal(tc["kv.0"][2 * 4096:3 * 4096], tp["kv.0"][4 * 4096:5 * 4096])


@pytest.mark.parametrize("mode", ["direct", "pull_via_push"])
def test_pairing_prepares_what_the_first_request_would_build(pair, mode):
    """The side that moves the bytes has, right after connect (or, pull via push, after the
    consumer's hello), the program's index and request rules derived and the program bound to both
    sides' bases: the first request builds none of them (on a CPU run they took ~10 ms of it)."""
    plan, prod, cons, *_ = pair
    peer = cons.connect(prod.address, direction="READ", mode=mode, warm=False)
    mover = cons if mode == "direct" else prod
    (eng,) = [e for e in mover.sessions.engines.values()]
    for what in ("index", "request_rules"):
        eng.program.memo.get(what, lambda: pytest.fail(f"{what} left for the first request"))
    assert eng._bound is not None
    peer.read("prepared", {"full": [1]}, {"full": [2]}, 16)
    assert cons.wait(["prepared"], timeout=20).finished == ("prepared",)
