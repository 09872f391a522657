"""Peer.write_many / read_many between real NIXL (UCX) agents in separate processes: several
requests as one NIXL request per part, content-coded bytes checked everywhere, refusals that move nothing.

Engines (one process each): X tiny dense TP1 (content-coded producer), Y0/Y1 tiny dense TP2 HND
with 32-token blocks (content-coded producers), Z tiny dense TP1 with 256 blocks (noise; consumer).
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
from runtime_engines import TIMEOUT, check_bytes, flip, move, xyz_engines

from kvlc.demo.procs import stop_engines

pytest.importorskip("torch")
pytest.importorskip("nixl")
pytestmark = pytest.mark.runtime


@pytest.fixture(scope="module")
def eng(plans):
    engines = xyz_engines(plans, seed=11, prefix="batch")
    yield engines
    stop_engines(list(engines.values()))


def _reqs(tag: str, count: int, seed: int, ranges: bool = False):
    """(id, consumer ids, producer ids, tokens): random distinct blocks on Z, a window of X's 64."""
    rng = np.random.default_rng(seed)
    dest = rng.permutation(256)
    out, at = [], 0
    for i in range(count):
        n = int(rng.integers(1, 60))
        blocks = -(-n // 16)
        span = (n // 2, n) if ranges and i % 2 and n > 1 else n  # a prefix hit on half of them
        first = (span[0] // 16) if isinstance(span, tuple) else 0
        out.append((f"{tag}-{i}", {"full": dest[at:at + blocks - first].tolist()},
                    {"full": rng.permutation(64)[:blocks - first].tolist()}, span))
        at += blocks - first
    return out


def _freeable(h, count: int, within: float = 10.0) -> list[str]:
    """The requests ``h`` reports freeable, once ``count`` of them arrived (or ``within`` seconds passed)."""
    got, deadline = [], time.monotonic() + within
    while len(got) < count and time.monotonic() < deadline:
        got += h.call("events")["freeable"]
        time.sleep(0.01)
    return sorted(got)


def _stats(h):
    return h.call("stats")


def test_pull_batch_is_one_nixl_request_and_moves_every_byte(eng, plans):
    """Z pulls eight requests (some token ranges) from X in one read_many: one NIXL request, every
    destination byte right, nothing else touched; X may free each and hears of all."""
    x, z = eng["x"], eng["z"]
    z.connect([x.address], "READ", "direct", "x-pull")
    reqs = _reqs("bp", 8, 1, ranges=True)
    x.call("events"), z.call("events")
    before, s0 = z.call("dump"), _stats(z)
    move(z, "x-pull", "read_many", reqs)
    check_bytes(z, plans["z"], plans["x"], before, reqs)
    s1 = _stats(z)
    assert s1["requests"] - s0["requests"] == 8 and s1["nixl_requests"] - s0["nixl_requests"] == 1
    assert s1["xfers"] == 0
    assert _freeable(x, len(reqs)) == sorted(r[0] for r in reqs)


def test_push_batch_is_one_nixl_request_and_the_consumer_finishes_each(eng, plans):
    x, z = eng["x"], eng["z"]
    x.connect([z.address], "WRITE", "direct", "z-push")
    reqs = _reqs("bw", 6, 2)
    x.call("events"), z.call("events")
    before, s0 = z.call("dump"), _stats(x)
    move(x, "z-push", "write_many", flip(reqs), waiters=[z])
    check_bytes(z, plans["z"], plans["x"], before, reqs)
    s1 = _stats(x)
    assert s1["requests"] - s0["requests"] == 6 and s1["nixl_requests"] - s0["nixl_requests"] == 1
    assert _freeable(x, len(reqs)) == sorted(r[0] for r in reqs)


def test_pull_batch_from_two_producer_ranks_is_one_nixl_request_per_rank(eng, plans):
    """TP2 (HND, 32-token blocks) → TP1: the batch's rows to each producer rank are one NIXL request;
    every request ends only when both ranks' bytes landed."""
    y0, y1, z = eng["y0"], eng["y1"], eng["z"]
    z.connect([y0.address, y1.address], "READ", "direct", "y-pull")
    reqs = [("by-1", {"full": [100, 101, 102, 103]}, {"full": [0, 1]}, 50),
            ("by-2", {"full": list(range(110, 117))}, {"full": [19, 2, 18, 3]}, 100),
            ("by-3", {"full": [120, 121]}, {"full": [30, 31]}, (20, 40))]
    before, s0 = z.call("dump"), _stats(z)
    move(z, "y-pull", "read_many", reqs)
    check_bytes(z, plans["z"], plans["y"], before, reqs)
    assert _stats(z)["nixl_requests"] - s0["nixl_requests"] == 2
    for y in (y0, y1):
        assert _freeable(y, 3) == ["by-1", "by-2", "by-3"]


def test_pull_via_push_batch_asks_the_producer_for_each(eng, plans):
    x, z = eng["x"], eng["z"]
    z.connect([x.address], "READ", "pull_via_push", "x-pvp")
    reqs = _reqs("bv", 5, 3)
    before = z.call("dump")
    move(z, "x-pvp", "read_many", reqs)
    check_bytes(z, plans["z"], plans["x"], before, reqs)


def test_prepped_batch_goes_request_by_request(eng, plans):
    """On a prepped connection (indices into lists prepared at connect) a batch is checked as one,
    then each request is moved on its own (nothing shared); every byte lands right."""
    x, z = eng["x"], eng["z"]
    z.connect([x.address], "READ", "prepped", "x-prepped")
    reqs = _reqs("bq", 4, 6)
    before, s0 = z.call("dump"), _stats(z)
    move(z, "x-prepped", "read_many", reqs)
    check_bytes(z, plans["z"], plans["x"], before, reqs)
    s1 = _stats(z)
    assert s1["requests"] - s0["requests"] == 4
    # each request its own NIXL requests: the prepared part, plus a rows part for a partial last block
    assert s1["nixl_requests"] - s0["nixl_requests"] >= 4


@pytest.mark.parametrize("flaw", ["id out of range", "twice in the batch", "wrong count"])
def test_one_bad_request_refuses_the_batch_and_nothing_moves(eng, flaw):
    """A refusal names the batch item and request; no request of the batch is created or moved,
    and the same ids go through afterwards once the bad one is fixed."""
    x, z = eng["x"], eng["z"]
    z.connect([x.address], "READ", "direct", f"x-refuse-{flaw}")
    good = _reqs(f"br-{flaw.split()[0]}", 4, 4)
    bad = list(good)
    if flaw == "id out of range":
        bad[2] = (bad[2][0], bad[2][1], {"full": [64] * len(bad[2][2]["full"])}, bad[2][3])
        want = f"batch item 2 \\(request '{bad[2][0]}'\\): .*out of range"
    elif flaw == "twice in the batch":
        bad[3] = (bad[1][0],) + bad[3][1:]
        want = f"batch item 3: request '{bad[1][0]}' appears twice"
    else:
        bad[1] = (bad[1][0], {"full": bad[1][1]["full"] + [250]}, bad[1][2], bad[1][3])
        want = f"batch item 1 \\(request '{bad[1][0]}'\\): .*expected"
    before, s0 = z.call("dump"), _stats(z)
    errors = z.call("submit", f"x-refuse-{flaw}", "read_many", bad, TIMEOUT)
    assert set(errors) == {r[0] for r in bad}
    assert all(re.search(want, e) for e in errors.values()), errors
    after, s1 = z.call("dump"), _stats(z)
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert (s1["requests"], s1["nixl_requests"], s1["in_flight"]) == (s0["requests"], s0["nixl_requests"], 0)
    move(z, f"x-refuse-{flaw}", "read_many", good)


def test_a_batch_on_a_connection_of_the_other_direction_is_refused(eng):
    x, z = eng["x"], eng["z"]
    z.connect([x.address], "READ", "direct", "x-wrong-way")
    errors = z.call("submit", "x-wrong-way", "write_many", _reqs("bx", 2, 5), TIMEOUT)
    assert all("write_many() needs a connection made with direction='WRITE'" in e for e in errors.values())
    errors = z.call("submit", "x-wrong-way", "read_many", [("bad id", {"full": [1]}, {"full": [1]}, 4)], TIMEOUT)
    assert "batch item 0: request id 'bad id'" in errors["bad id"]
    s0 = _stats(z)
    assert z.call("submit", "x-wrong-way", "read_many", [], TIMEOUT) == {}  # an empty batch does nothing
    assert _stats(z)["requests"] == s0["requests"]
