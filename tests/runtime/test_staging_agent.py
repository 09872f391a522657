"""Staging through KvAgent: real NIXL (UCX) agents, DRAM bounce buffers, content-coded bytes.

Engines (two processes; each hosts staged and unstaged agents of the same plan and fill):
  P+  tiny dense TP1, content-coded, StagingPolicy "always", 4 KiB slots (a request is many chunks)
  P-  the same, StagingPolicy "never"
  P*  as P+, but every chunk is written from its source ranges (direct_min_bytes 1: no gather)
  C+  tiny dense TP1 pool 256, seeded noise, "always"      C-  the same noise, "never"
  C*  as C+ (P* writes here)
Contracts: a staged request writes exactly the bytes a direct one writes and nothing else; pull
(READ) stays direct; a staging notification that is not sealed by a live session that may write the
request is dropped without a byte scattered; after a request ends failed (timed out, cancelled, peer
stopped mid-stream), nothing lands in its blocks any more.
"""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest
from runtime_engines import SECRET, TEST_LAYOUTS, check_bytes, config, flip, move, settle

from kvlc import compile_spec
from kvlc.runtime.settings import AgentSettings
from kvlc.errors import KvlcError
from kvlc.demo.procs import EngineProcess, stop_engines

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")
pytestmark = pytest.mark.runtime
ON = {"mode": "always", "slot_bytes": 4096, "slots": 2, "peers": 2}
OFF = {"mode": "never"}
DIRECT = {**ON, "direct_min_bytes": 1}
PAIRS = (("p_on", "c_on"), ("p_off", "c_off"), ("p_dir", "c_dir"))


@pytest.fixture(scope="module")
def plans():
    return {"x": compile_spec(TEST_LAYOUTS / "dense-tp1.yaml"), "z": compile_spec(TEST_LAYOUTS / "dense-tp1-pool256.yaml")}


@pytest.fixture(scope="module")
def eng(plans):
    pp, cp = EngineProcess(), EngineProcess()
    hs = [pp.add_async(config(plans["x"], 0, "content", engine_id="stg-p-on", staging=ON)),
          pp.add_async(config(plans["x"], 0, "content", engine_id="stg-p-off", staging=OFF)),
          cp.add_async(config(plans["z"], 0, "random", seed=3, engine_id="stg-c-on", staging=ON)),
          cp.add_async(config(plans["z"], 0, "random", seed=3, engine_id="stg-c-off", staging=OFF)),
          pp.add_async(config(plans["x"], 0, "content", engine_id="stg-p-dir", staging=DIRECT)),
          cp.add_async(config(plans["z"], 0, "random", seed=3, engine_id="stg-c-dir", staging=ON))]
    for h in hs:
        h.ready()
    yield dict(zip(("p_on", "p_off", "c_on", "c_off", "p_dir", "c_dir"), hs), pp=pp, cp=cp)
    for p in (pp, cp):
        try:
            p.signal(signal.SIGCONT)
        except OSError:
            pass
    stop_engines(hs)


def _reqs(tag: str, first: int):
    rng = np.random.default_rng(first)
    return [(f"{tag}-1", {"full": [first, first + 1, first + 2]}, {"full": [5, 60, 7]}, 40),
            (f"{tag}-2", {"full": list(range(first + 3, first + 23))}, {"full": rng.permutation(64)[:20].tolist()}, 310)]


def _direct(h) -> int:
    """Chunks the agent wrote from their source ranges, without a gather."""
    st = h.call("stats")["staging"]
    return 0 if st is None else st["chunks_direct"]


def _chunks(h) -> int:
    st = h.call("stats")["staging"]
    return 0 if st is None else st["chunks_received"] + st["chunks_sent"]


@pytest.mark.parametrize("mode, first", [("pull_via_push", 40), ("push", 0), ("prepped", 80), ("pull", 120)])
def test_staged_and_direct_write_the_same_bytes(eng, plans, mode, first):
    """Every mode: the staged pairs (chunks gathered, or written from their sources) and the unstaged pair
    write identical destination bytes, each one its content code, nothing else changed; WRITEs went
    through chunks, a pull (READ) stays direct."""
    before = {c: eng[c].call("dump") for _, c in PAIRS}
    assert all((before["c_on"][k] == before[c][k]).all() for _, c in PAIRS for k in before[c])
    chunks0, direct0 = _chunks(eng["c_on"]), _direct(eng["p_dir"])
    for p, c in PAIRS:
        prod, cons, tag = eng[p], eng[c], f"{mode}-{p}"
        reqs = _reqs(tag, first)
        if mode in ("push", "prepped"):
            prod.connect([cons.address], "WRITE", "direct" if mode == "push" else "prepped", tag)
            move(prod, tag, "write", flip(reqs), waiters=[cons])
        else:
            cons.connect([prod.address], "READ", "direct" if mode == "pull" else mode, tag)
            move(cons, tag, "read", reqs)
        check_bytes(cons, plans["z"], plans["x"], before[c], reqs)
    after = {c: eng[c].call("dump") for _, c in PAIRS}
    assert all((after["c_off"][k] == after[c][k]).all() for _, c in PAIRS for k in after[c])
    staged, direct = _chunks(eng["c_on"]) - chunks0, _direct(eng["p_dir"]) - direct0
    assert (staged == 0) if mode == "pull" else (staged > 10), staged
    assert (direct == 0) if mode == "pull" else (direct > 10), direct
    assert _direct(eng["p_on"]) == 0  # 4 KiB slots of small rows: every chunk gathered
    assert eng["c_off"].call("stats")["staging"] is None


def test_prepped_staged_write_moves_exactly_its_token_range(eng, plans):
    """A prepared connection whose WRITE parts are staged: ``Peer.write(..., tokens=(start, stop))`` moves
    exactly tokens [start, stop) (the staged rows are built for that range), through bounce buffers,
    and nothing else in the consumer changes."""
    prod, cons = eng["p_on"], eng["c_on"]
    reqs = [("tok-1", {"full": [200, 201]}, {"full": [20, 21]}, (20, 40)),   # starts mid-block
            ("tok-2", {"full": [202, 203, 204]}, {"full": [22, 23, 24]}, (5, 47))]
    before = cons.call("dump")
    chunks0 = _chunks(cons)
    prod.connect([cons.address], "WRITE", "prepped", "tok-prepped")
    move(prod, "tok-prepped", "write", flip(reqs), waiters=[cons])
    check_bytes(cons, plans["z"], plans["x"], before, reqs)
    assert _chunks(cons) > chunks0  # they went through bounce buffers


def test_a_batch_with_staged_parts_goes_request_by_request_and_moves_the_same_bytes(eng, plans):
    """write_many where the policy stages every WRITE: each request is its own staged send (bounce
    buffers are per request), every destination byte right; the unstaged pair gets one NIXL request."""
    before = {c: eng[c].call("dump") for c in ("c_on", "c_off")}
    for p, c in (("p_on", "c_on"), ("p_off", "c_off")):
        prod, cons, tag = eng[p], eng[c], f"batch-{p}"
        reqs = _reqs(tag, 10)
        prod.connect([cons.address], "WRITE", "direct", tag)
        s0, chunks0 = prod.call("stats"), _chunks(cons)
        move(prod, tag, "write_many", flip(reqs), waiters=[cons])
        check_bytes(cons, plans["z"], plans["x"], before[c], reqs)
        s1 = prod.call("stats")
        assert s1["requests"] - s0["requests"] == 2
        if p == "p_on":
            assert _chunks(cons) - chunks0 > 10 and s1["nixl_requests"] == s0["nixl_requests"]
        else:
            assert s1["nixl_requests"] - s0["nixl_requests"] == 1


def test_policy_comes_from_the_environment_and_is_checked(monkeypatch, plans):
    """KVLC_STAGING=never|always|auto picks the policy of an agent given none; bad values name the variable."""
    from kvlc.runtime import KvAgent, allocate
    from kvlc.runtime.staging.endpoint import StageMode, StagingPolicy

    assert StagingPolicy.from_env({}).mode is StageMode.AUTO
    assert StagingPolicy.from_env({"KVLC_STAGING": "Always"}).mode is StageMode.ALWAYS
    with pytest.raises(KvlcError, match="use one of"):
        StagingPolicy.from_env({"KVLC_STAGING": "sometimes"})
    with pytest.raises(KvlcError, match="KVLC_STAGING_SLOTS"):
        StagingPolicy.from_env({"KVLC_STAGING_SLOTS": "many"})
    monkeypatch.setenv("KVLC_STAGING", "never")
    with KvAgent(plans["x"], 0, allocate(plans["x"]), AgentSettings(secret=SECRET)) as a:
        assert a.stager is None and a.staging.mode is StageMode.NEVER
    with KvAgent(plans["x"], 0, allocate(plans["x"]), AgentSettings(secret=SECRET, staging=StagingPolicy.always(slots=3))) as a:
        assert a.stager is not None and a.stager.pool.slots == 3 * a.staging.peers
    with KvAgent(plans["x"], 0, allocate(plans["x"]), AgentSettings(secret=SECRET, staging=StagingPolicy(slots=3))) as a:
        # auto on DRAM only: nothing can be staged (fragmented DRAM parts are not, by default), so no buffers
        import torch
        assert (a.stager is None) == (not torch.cuda.is_available())
        assert a.stager is None or a.stager.pool.slots == 3 * a.staging.peers
    fragmented = StagingPolicy(fragmented_dram=True)
    assert fragmented.decide(4086, 4086 * 65536, "DRAM", "DRAM") and fragmented.needs_buffers(False)



@pytest.mark.parametrize("mode", ["push", "pull_via_push"])
def test_stopped_producer_mid_stream_fails_and_nothing_lands_late(eng, mode):
    """The producer is stopped while a staged request streams: the consumer holds it at its deadline,
    fails it only once the producer answered (after SIGCONT), and no chunk is scattered after that."""
    prod, cons, pp = eng["p_on"], eng["c_on"], eng["pp"]
    tag = f"stop-{mode}"
    pids, cids = {"full": list(range(64))}, {"full": list(range(100, 164))}
    req = f"{tag}-r"
    base = _chunks(cons)
    if mode == "push":
        prod.connect([cons.address], "WRITE", "direct", tag)
        cons.call("expect", req, 1.0)
        assert prod.call("submit", tag, "write", [(req, pids, cids, 64 * 16)], 30.0) == {}
    else:
        cons.connect([prod.address], "READ", mode, tag)
        assert cons.call("submit", tag, "read", [(req, cids, pids, 64 * 16)], 1.0) == {}
    t0 = time.monotonic()
    while _chunks(cons) == base and time.monotonic() - t0 < 5:  # stop it once chunks flow
        time.sleep(0.001)
    pp.signal(signal.SIGSTOP)
    try:
        got = cons.call("wait", [req], 2.5)
        assert got["finished"] == [] and req in got["held"], got
    finally:
        pp.signal(signal.SIGCONT)
    out, _ = settle(cons, req)
    assert req in out["failed"] and req in out["ever_held"], out
    assert 0 < _chunks(cons) - base < 128  # 512 KiB in 4 KiB chunks: it stopped mid-stream


def _pump(agents, until, timeout=20.0):
    deadline = time.monotonic() + timeout
    seen: dict = {}
    while time.monotonic() < deadline:
        for a in agents:
            c = a.poll()
            for r in c.finished:
                seen[(a.name, r)] = "finished"
            for r in c.failed:
                seen[(a.name, r)] = f"failed: {c.failed[r]}"
        if until(seen):
            return seen
        time.sleep(0.0005)
    raise AssertionError(f"not there in {timeout}s: {seen}")


def test_forged_replayed_and_foreign_chunks_are_dropped_unscattered(plans):
    """In one process, manual progress: a LANDED replayed after its request finished, one sealed with
    a key no session has, and one from another engine's session for a request this side gets from the
    first engine are all dropped; none scatters a byte (the blocks they point at stay as they were)."""
    from kvlc.runtime import KvAgent, allocate
    from kvlc.runtime.staging.endpoint import StagingPolicy
    from kvlc.runtime.staging.wire import Kind, Message, encode, is_staging
    from kvlc.demo.content import expected_bytes, fill

    x, z = plans["x"], plans["z"]
    pol = StagingPolicy(**ON)
    tp = allocate(x)
    fill(x, 0, {n: t.numpy() for n, t in tp.items()})
    tc = allocate(z)
    agents = [KvAgent(x, 0, tp, AgentSettings(secret=SECRET, staging=pol, progress="manual", engine_id="forge-p")),
              KvAgent(z, 0, tc, AgentSettings(secret=SECRET, staging=pol, progress="manual", engine_id="forge-c")),
              KvAgent(x, 0, allocate(x), AgentSettings(secret=SECRET, staging=pol, progress="manual", engine_id="forge-q"))]
    prod, cons, other = agents
    try:
        addr = cons.serve()
        peer, peer2 = prod.connect(addr, direction="WRITE"), other.connect(addr, direction="WRITE")
        sent = []
        real = prod.nixl.send_notif
        prod.nixl.send_notif = lambda to, m: (sent.append(bytes(m)) if is_staging(m) else None, real(to, m))[1]
        real_post = prod.nixl.post  # LANDED rides on each chunk's WRITE
        prod.nixl.post = lambda x, notif=b"": (sent.append(bytes(notif)) if is_staging(notif) else None,
                                               real_post(x, notif))[1]
        peer.write("r1", {"full": [0, 1, 2]}, {"full": [10, 11, 12]}, 40)
        _pump(agents, lambda s: (cons.name, "r1") in s and (prod.name, "r1") in s)
        for t in tc.values():
            t.zero_()
        snap = {n: t.clone() for n, t in tc.items()}
        landed = [m for m in sent if m[4] == Kind.LANDED]
        assert len(landed) > 3
        dropped0 = cons.stats["dropped_notifs"]
        for m in landed:  # replays: the request ended here
            real(cons.name, m)
        fake = Message(Kind.LANDED, "r1", 0, 1, 0, nbytes=4096, nrows=1)  # sealed with a key no session has
        other.nixl.send_notif(cons.name, encode(fake, b"a stranger's key"))
        _pump(agents, lambda s: cons.stats["dropped_notifs"] > dropped0, timeout=5)
        time.sleep(0.2)
        _pump(agents, lambda s: True)
        assert all(torch.equal(snap[n], tc[n]) for n in tc), "a dropped chunk was scattered"
        assert cons.stats["fenced_chunks"] >= len(landed)
        # another engine's session sends a chunk of r2, which this side receives from prod
        peer.write("r2", {"full": [20, 21]}, {"full": [30, 31]}, 32)
        _pump(agents, lambda s: "r2" in cons.incoming and cons.incoming["r2"].engine is not None)
        inbox = cons.stager.endpoint.inboxes[other.name]
        inbox.slot(0, 4096).fill_(0xAB)
        dst = int(tc["kv.0"].data_ptr()) + 30 * 4096
        inbox.ranges(0, 4096, 1).copy_(torch.tensor([dst, 4096], dtype=torch.int64).view(torch.uint8))
        fenced0 = cons.stats["fenced_chunks"]
        other.nixl.send_notif(cons.name, encode(Message(Kind.LANDED, "r2", 0, 1, 0, nbytes=4096, nrows=1),
                                                peer2.sessions[0].notif_key))
        seen = _pump(agents, lambda s: (cons.name, "r2") in s and cons.stats["fenced_chunks"] > fenced0)
        assert seen[(cons.name, "r2")] == "finished", seen
        for storage, idx, vals in expected_bytes(z, 0, x, {"full": [30, 31]}, {"full": [20, 21]}, 32):
            assert (tc[storage].numpy()[idx] == vals).all(), "r2's blocks hold foreign bytes"
    finally:
        for a in agents:
            a.close()


def _manual_pair(plans, tag: str):
    """A content-coded staging producer and a consumer in this process, progressed by poll() only."""
    from kvlc.runtime import KvAgent, allocate
    from kvlc.runtime.staging.endpoint import StagingPolicy
    from kvlc.demo.content import fill

    x, z = plans["x"], plans["z"]
    pol = StagingPolicy(**ON)
    tp = allocate(x)
    fill(x, 0, {n: t.numpy() for n, t in tp.items()})
    prod = KvAgent(x, 0, tp, AgentSettings(secret=SECRET, staging=pol, progress="manual", engine_id=f"{tag}-p"))
    cons = KvAgent(z, 0, allocate(z), AgentSettings(secret=SECRET, staging=pol, progress="manual", engine_id=f"{tag}-c"))
    return prod, cons


def _push_one(prod, cons, req: str):
    """Connect ``prod`` to ``cons`` and push one staged request until both ends saw it end; the peer."""
    peer = prod.connect(cons.serve(), direction="WRITE")
    peer.write(req, {"full": [0, 1, 2]}, {"full": [10, 11, 12]}, 40)
    _pump([prod, cons], lambda s: (cons.name, req) in s and (prod.name, req) in s)
    return peer


def test_trace_records_each_chunk_step_by_step(plans, tmp_path, monkeypatch):
    """KVLC_STAGING_TRACE: every chunk of a staged push has all ten steps, in time order, on one clock."""
    import json

    from kvlc.runtime.staging.trace import LIMIT

    monkeypatch.setenv("KVLC_STAGING_TRACE", str(tmp_path))
    prod, cons = _manual_pair(plans, "trace")
    try:
        _push_one(prod, cons, "t1")
        chunks = prod.stager.endpoint.stats["chunks_sent"]
        paths = [a.stager.endpoint.trace.dump() for a in (prod, cons)]
    finally:
        prod.close()
        cons.close()
    assert chunks > 3 and LIMIT > 1000
    steps: dict = {}
    for p in paths:
        for line in p.read_text().splitlines():
            row = json.loads(line)
            steps.setdefault((row["req"], row["seq"]), []).append((row["t_ns"], row["step"]))
    assert len(steps) == chunks
    want = ["queued", "gather", "gathered", "posted", "landed", "ranges", "scatter", "scattered"]
    for key, seen in steps.items():
        names = [s for _, s in sorted(seen)]
        assert set(names) == set(want) | {"written", "freed"}, (key, names)
        assert [s for s in names if s in want] == want, (key, names)  # written / freed may come in any order
        assert names.index("freed") > names.index("scattered"), (key, names)


def test_progress_thread_comes_back_quickly_while_staging_is_busy():
    """The pump waits ``busy_interval`` instead of ``interval`` while its method says work is in flight."""
    import threading

    from kvlc.runtime.pump import Pump

    class Target:
        def __init__(self, busy):
            self.busy, self.calls = busy, 0

        def turn(self):
            self.calls += 1
            return self.busy

    counts = {}
    for busy in (False, True):
        t, stop = Target(busy), threading.Event()
        pump = Pump(t, "turn", 0.02, stop, f"test-pump-{busy}", busy_interval=0.0005)
        time.sleep(0.3)
        stop.set()
        pump.thread.join(2)
        counts[busy] = t.calls
    assert counts[False] <= 20 and counts[True] >= 5 * counts[False], counts


def test_close_releases_staging_in_nixl_order_and_writes_the_trace(plans, tmp_path, monkeypatch):
    """Closing an agent closes its staging, with a request still being staged: its WRITEs (any still
    in flight), the prepared slot lists and the bounce buffers are released by the stager itself,
    and the trace is written without an explicit dump."""
    monkeypatch.setenv("KVLC_STAGING_TRACE", str(tmp_path))
    prod, cons = _manual_pair(plans, "close")
    try:
        peer = _push_one(prod, cons, "c1")
        peer.write("c2", {"full": [3, 4, 5]}, {"full": [20, 21, 22]}, 40)  # the consumer never polls for it
        for _ in range(20):
            prod.poll()
        ep = prod.stager.endpoint
        held = [ep.outbox.registration, prod.stager.pool.registration] + [h for lists in ep._lists.values()
                                                                           for h in lists[:2]]
        assert ep.stats["chunks_sent"] > 3 and all(not h.released for h in held)
        closed = []
        monkeypatch.setattr(prod.stager, "close", lambda orig=prod.stager.close: (closed.append(1), orig())[1])
    finally:
        prod.close()
        cons.close()
    assert closed == [1] and all(h.released for h in held)
    assert not ep._writing and prod.nixl.closed
    names = sorted(p.name for p in tmp_path.glob("staging-*.jsonl"))
    assert len(names) == 2, names  # one per agent, written at close
