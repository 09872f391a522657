"""Token-range requests between real NIXL (UCX) agents in separate processes: ``tokens=(start, stop)``.

A decode-side prefix-cache hit of ``start`` tokens (ending mid-block) must leave the consumer's
tokens ``[0, start)`` in the shared block as they were, and fill ``[start, stop)`` exactly —
pull, push and pull-via-push (the range travels in the pull request; the producer checks it
again), with different block sizes and TP on each side, and a sliding window that moves only
the blocks it keeps (the ids of the others are placeholders, repeated).
Every test checks every destination byte against its content code and that no other byte changed.
"""

from __future__ import annotations

import pytest
from runtime_engines import TEST_LAYOUTS, check_bytes, config, flip, move

from kvlc import compile_spec
from kvlc.runtime.settings import AgentSettings
from kvlc.demo.procs import EngineProcess, start_engines, stop_engines

pytest.importorskip("torch")
pytest.importorskip("nixl")
pytestmark = pytest.mark.runtime
L = TEST_LAYOUTS


@pytest.fixture(scope="module")
def eng(plans):
    handles = start_engines([config(plans["x"], 0, "content"), config(plans["y"], 0, "content"),
                             config(plans["y"], 1, "content"), config(plans["z"], 0, "random", seed=7)])
    x, y0, y1, z = handles
    yield {"x": x, "y0": y0, "y1": y1, "z": z}
    stop_engines(handles)


# Requests are (id, consumer ids, producer ids, (start, stop)): each side lists its blocks the range touches.


def _same_block_requests(tag: str):
    return [
        (f"{tag}-1", {"full": [40, 41]}, {"full": [3, 9]}, (20, 40)),         # blocks 1..2: hit ends mid-block 1
        (f"{tag}-2", {"full": [50]}, {"full": [60]}, (35, 41)),               # inside one block (block 2)
        (f"{tag}-3", {"full": [70, 71, 72, 73]}, {"full": [5, 6, 7, 8]}, (1, 64)),
        (f"{tag}-4", {"full": [80, 81]}, {"full": [12, 13]}, (32, 64)),      # whole blocks 2..3
    ]


@pytest.mark.parametrize("mode", ["pull", "push", "pull_via_push"])
def test_range_same_block_size(eng, plans, mode):
    """X (16-token blocks) -> Z (16-token blocks): ranges that start and end mid-block, every mode."""
    x, z = eng["x"], eng["z"]
    reqs = _same_block_requests(f"same-{mode}")
    before = z.call("dump")
    if mode == "push":
        x.connect([z.address], "WRITE", "direct", f"z-{mode}")
        move(x, f"z-{mode}", "write", flip(reqs), waiters=[z])
    else:
        z.connect([x.address], "READ", "direct" if mode == "pull" else mode, f"x-{mode}")
        move(z, f"x-{mode}", "read", reqs)
    check_bytes(z, plans["z"], plans["x"], before, reqs)


@pytest.mark.parametrize("mode", ["pull", "pull_via_push"])
def test_range_hetero_tp_and_block_size(eng, plans, mode):
    """Y (TP2, HND, 32-token blocks, two processes) -> Z (TP1, NHD, 16-token blocks): ids differ in count."""
    y0, y1, z = eng["y0"], eng["y1"], eng["z"]
    reqs = [
        (f"het-{mode}-1", {"full": [100, 101, 102, 103]}, {"full": [0, 1, 2]}, (20, 70)),   # Z 1..4, Y 0..2
        (f"het-{mode}-2", {"full": [110]}, {"full": [5]}, (40, 47)),                       # Z 2, Y 1
        (f"het-{mode}-3", {"full": [120, 121]}, {"full": [7]}, (33, 64)),                  # Z 2..3, Y 1
    ]
    before = z.call("dump")
    z.connect([y0.address, y1.address], "READ", "direct" if mode == "pull" else mode, f"y-{mode}")
    move(z, f"y-{mode}", "read", reqs)
    check_bytes(z, plans["z"], plans["y"], before, reqs)


def test_pull_via_push_range_is_checked_by_the_producer(plans):
    """A pull request whose range and ids disagree (sent raw, past the consumer's own check) is refused by the
    producer with the located message, and nothing moves."""
    import time

    from kvlc.runtime import KvAgent, allocate
    from kvlc.runtime.channel.wire import PullRequest, decode, encode
    from runtime_engines import SECRET

    prod = KvAgent(plans["x"], 0, allocate(plans["x"]), AgentSettings(secret=SECRET, engine_id="range-producer"))
    cons = KvAgent(plans["z"], 0, allocate(plans["z"]), AgentSettings(secret=SECRET, engine_id="range-consumer"))
    with prod, cons:
        prod.serve()
        peer = cons.connect(prod.address, mode="pull_via_push")
        client = next(iter(peer._clients.values()))
        msg = PullRequest(req="bad-range", consumer_blocks={"full": (1,)}, producer_blocks={"full": (2, 3)},
                          start=20, stop=30, until=time.monotonic() + 10, budget_s=10.0)
        reply = decode(client.request(encode(msg)))
        assert not reply.ok and reply.error == (
            "group 'full': 2 local block ids for tokens [20, 30); expected 1, one per block the range touches "
            "(block size 16: logical blocks 1..1)")
        assert not prod.executor.active and not prod.tallies


def test_pulls_in_one_frame_are_answered_each_on_its_own(plans):
    """Several pull requests in one frame (what a consumer's sender does with requests queued together):
    the producer answers each in order; a refused one refuses only itself, the others start."""
    import time

    from kvlc.runtime import KvAgent, allocate
    from kvlc.runtime.channel.wire import PullRequest, Pulls, Replies, decode, encode
    from runtime_engines import SECRET

    prod = KvAgent(plans["x"], 0, allocate(plans["x"]), AgentSettings(secret=SECRET, engine_id="pulls-producer"))
    cons = KvAgent(plans["z"], 0, allocate(plans["z"]), AgentSettings(secret=SECRET, engine_id="pulls-consumer"))
    with prod, cons:
        prod.serve()
        peer = cons.connect(prod.address, mode="pull_via_push")
        client = next(iter(peer._clients.values()))
        until = time.monotonic() + 10

        def pull(req, cblocks, pblocks, start, stop):
            return PullRequest(req=req, consumer_blocks={"full": cblocks}, producer_blocks={"full": pblocks},
                               start=start, stop=stop, until=until, budget_s=10.0)

        frame = Pulls(items=(pull("bad-1", (1,), (2, 3), 20, 30), pull("good", (4,), (5,), 0, 16),
                             pull("bad-2", (1, 2, 3), (2,), 0, 16)))
        reply = decode(client.request(encode(frame)))
        assert isinstance(reply, Replies) and [r.ok for r in reply.items] == [False, True, False]
        assert "2 local block ids for tokens [20, 30); expected 1" in reply.items[0].error
        assert "3 " in reply.items[2].error and "expected 1" in reply.items[2].error
        assert prod.stats["requests"] == 1  # only the good one was started


def test_sliding_window_moves_only_kept_blocks():
    """Hybrid TP2 producer -> TP1 consumer, 150 tokens: the 64-token window group moves blocks 5..9 only.

    Blocks 0..4 of the window group get placeholder ids (the null block 0, repeated, and ids past the
    pool): kvlc never reads them, so nothing there is written.
    """
    P, C = compile_spec(L / "hybrid-tp2.yaml"), compile_spec(L / "hybrid-tp1.yaml")
    pp, cp = EngineProcess(), EngineProcess()
    prods = [pp.add_async(config(P, r, "content")) for r in range(2)]
    cons = cp.add_async(config(C, 0, "random", seed=9))
    try:
        for h in prods + [cons]:
            h.ready()
        ph = [0, 0, 999, 0, 0]          # placeholders: vLLM's null block 0 repeated, an id past the pool
        reqs = [   # (0, 150): blocks 0..9; the window keeps blocks 5..9 (token 87 = 150 - 64 + 1 is in block 5)
            ("win-1", {"mamba": [3], "full": list(range(10, 20)), "local": ph + [1, 2, 3, 4, 5]},
             {"mamba": [1], "full": list(range(0, 10)), "local": ph + [10, 11, 12, 13, 14]}, (0, 150)),
            # (20, 130): blocks 1..8; the window keeps blocks 4..8 (token 67)
            ("win-2", {"mamba": [4], "full": list(range(30, 38)), "local": ph[:3] + [6, 7, 8, 9, 10]},
             {"mamba": [2], "full": list(range(20, 28)), "local": ph[:3] + [15, 16, 17, 18, 19]}, (20, 130)),
        ]
        before = cons.call("dump")
        cons.connect([p.address for p in prods], "READ", "pull_via_push")
        move(cons, "default", "read", reqs)
        check_bytes(cons, C, P, before, reqs)
    finally:
        stop_engines([type("H", (), {"proc": p})() for p in (pp, cp)])
