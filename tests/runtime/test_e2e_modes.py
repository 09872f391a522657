"""Real NIXL (UCX) agents in separate processes move content-coded bytes: pull, push and pull-via-push,
same layout and heterogeneous TP / block size / capacity, many requests in flight.

Engines (one process each):
  X   tiny dense, TP1, NHD, 16-token blocks, 64 blocks      (content-coded; a producer)
  Y0  tiny dense, TP2 rank 0, HND, 32-token blocks, 40 blocks (content-coded; producer, and consumer
  Y1  tiny dense, TP2 rank 1                                    into blocks 20-39 only)
  Z   tiny dense, TP1, NHD, 16-token blocks, 256 blocks       (noise; a consumer)
Every test checks every destination byte against its content code and that no other byte changed.
"""

from __future__ import annotations

import numpy as np
import pytest
from runtime_engines import check_bytes, flip, move, xyz_engines

from kvlc.demo.procs import stop_engines

pytest.importorskip("torch")
pytest.importorskip("nixl")
pytestmark = pytest.mark.runtime


@pytest.fixture(scope="module")
def eng(plans):
    engines = xyz_engines(plans, seed=5)
    yield engines
    stop_engines(list(engines.values()))


def _events(h):
    return h.call("events")


def test_pull(eng, plans):
    """READ: the consumer pulls, then each producer rank hears 'done' once and may free the blocks."""
    x, z = eng["x"], eng["z"]
    z.connect([x.address], "READ", "direct", "x-pull")
    _events(x), _events(z)
    reqs = [
        ("pull-1", {"full": [0]}, {"full": [7]}, 1),
        ("pull-2", {"full": [1]}, {"full": [3]}, 16),
        ("pull-3", {"full": [2, 3, 4]}, {"full": [63, 0, 9]}, 40),
        ("pull-4", {"full": list(range(5, 12))}, {"full": [11, 12, 13, 14, 15, 16, 17]}, 100),
    ]
    before = z.call("dump")
    move(z, "x-pull", "read", reqs)
    check_bytes(z, plans["z"], plans["x"], before, reqs)
    ev = _events(x)
    assert sorted(ev["freeable"]) == sorted(r[0] for r in reqs) and ev["failed"] == {}
    assert z.call("stats")["xfers"] == 0


def test_push(eng, plans):
    """WRITE: the producer pushes; the consumer finishes a request when the producer's notification lands."""
    x, z = eng["x"], eng["z"]
    x.connect([z.address], "WRITE", "direct", "z-push")
    _events(x), _events(z)
    reqs = [
        ("push-1", {"full": [20, 21]}, {"full": [5, 6]}, 30),
        ("push-2", {"full": [22, 23, 24]}, {"full": [60, 61, 62]}, 33),
    ]
    before = z.call("dump")
    move(x, "z-push", "write", flip(reqs), waiters=[z])
    check_bytes(z, plans["z"], plans["x"], before, reqs)
    assert sorted(_events(x)["freeable"]) == ["push-1", "push-2"]


def test_pull_via_push(eng, plans):
    """The consumer asks over the side channel; the producer WRITEs, then notifies; blocks become freeable."""
    x, z = eng["x"], eng["z"]
    z.connect([x.address], "READ", "pull_via_push", "x-pvp")
    _events(x), _events(z)
    reqs = [
        (f"pvp-{i}", {"full": [30 + 2 * i, 31 + 2 * i]}, {"full": [i, 63 - i]}, 17 + 5 * i) for i in range(4)
    ]
    before = z.call("dump")
    move(z, "x-pvp", "read", reqs)
    check_bytes(z, plans["z"], plans["x"], before, reqs)
    assert sorted(_events(x)["freeable"]) == sorted(r[0] for r in reqs)
    assert z.call("stats")["xfers"] == 0 and x.call("stats")["xfers"] == 0


def test_push_consumer_times_out_a_request_that_never_comes(eng):
    """A push-mode consumer can set a deadline for a request; with no notification it fails, named."""
    z = eng["z"]
    z.call("expect", "ghost", 0.3)
    got = z.call("wait", ["ghost"], 10.0)
    assert got["finished"] == [] and "timed out" in got["failed"]["ghost"]


HETERO = [
    ("h-1", {"full": [40, 41, 42, 43]}, {"full": [0, 1]}, 50),
    ("h-2", {"full": list(range(44, 51))}, {"full": [19, 2, 18, 3]}, 100),
    ("h-3", {"full": [51, 52, 53]}, {"full": [5, 6]}, 33),
]


@pytest.mark.parametrize("mode", ["pull", "push", "pull_via_push", "pull_prepped", "push_prepped"])
def test_hetero_tp_from_two_producer_processes(eng, plans, mode):
    """TP2 (HND, 32-token blocks, 40 blocks) → TP1 (NHD, 16-token blocks, 256 blocks) in every mode:
    each producer process moves its heads; the request ends only when both ranks are done."""
    y0, y1, z = eng["y0"], eng["y1"], eng["z"]
    reqs = [(f"{mode}-{r}", c, p, n) for r, c, p, n in HETERO]
    for h in (y0, y1, z):
        _events(h)
    before = z.call("dump")
    if mode.startswith("push"):  # push_prepped: indices into strided lists prepared at connect
        for y in (y0, y1):
            y.connect([z.address], "WRITE", "prepped" if mode == "push_prepped" else "direct", f"z-{mode}")
        for y in (y0, y1):
            move(y, f"z-{mode}", "write", flip(reqs))
        got = z.call("wait", [r[0] for r in reqs], 30.0)
        assert got["failed"] == {} and got["open"] == []
    else:
        wire = {"pull": "direct", "pull_prepped": "prepped"}.get(mode, mode)
        z.connect([y0.address, y1.address], "READ", wire, f"y-{mode}")
        move(z, f"y-{mode}", "read", reqs)
    check_bytes(z, plans["z"], plans["y"], before, reqs)
    for y in (y0, y1):
        assert sorted(_events(y)["freeable"]) == sorted(r[0] for r in reqs)


def test_one_producer_two_consumer_ranks(eng, plans):
    """TP1 → TP2: the producer may free a request's blocks only after both consumer ranks report done."""
    x, y0, y1 = eng["x"], eng["y0"], eng["y1"]
    for y in (y0, y1):
        y.connect([x.address], "READ", "direct", "x-pull")
    _events(x)
    reqs = [
        ("two-1", {"full": [20, 21]}, {"full": [1, 2, 3, 4]}, 64),
        ("two-2", {"full": [22, 23, 24]}, {"full": [10, 11, 12, 13, 14]}, 70),
    ]
    before = [y.call("dump") for y in (y0, y1)]
    move(y0, "x-pull", "read", reqs)
    ev = _events(x)
    assert ev["freeable"] == [] and ev["finished"] == []
    move(y1, "x-pull", "read", reqs)
    x.call("wait", ["two-1", "two-2"], 10.0)
    ev = _events(x)
    assert sorted(ev["freeable"]) == ["two-1", "two-2"] and sorted(ev["finished"]) == ["two-1", "two-2"]
    for y, b in zip((y0, y1), before):
        check_bytes(y, plans["y"], plans["x"], b, reqs)


@pytest.mark.parametrize("mode, count", [("direct", 128), ("prepped", 128), ("pull_via_push", 100)])
def test_many_concurrent_requests(eng, plans, mode, count):
    """100+ requests submitted before any is waited for all land, byte-exact, and all handles are released."""
    x, z = eng["x"], eng["z"]
    peer = f"many-{mode}"
    z.connect([x.address], "READ", mode, peer)
    rng = np.random.default_rng(count)
    reqs = []
    for i in range(count):
        n = int(rng.integers(17, 33))
        reqs.append(
            (
                f"{peer}-{i}",
                {"full": [2 * i, 2 * i + 1]},
                {"full": rng.choice(64, 2, replace=False).tolist()},
                n,
            )
        )
    before = z.call("dump")
    move(z, peer, "read", reqs)
    check_bytes(z, plans["z"], plans["x"], before, reqs)
    assert z.call("stats")["xfers"] == 0 and x.call("stats")["xfers"] == 0
    assert len(_events(x)["freeable"]) >= count
