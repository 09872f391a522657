"""Same-host copies (kvlc.runtime.ipc) between real engine processes, on DRAM in shared files.

The engines of test_e2e_modes (X: TP1 producer; Y: TP2 producer; Z: the consumer), each in its
own process with its storages in shared-memory files, so every connection between them maps
the peer's storages and moves requests with one copy per part (a memmove per row on the CPU, the
Triton kernel on a GPU). Every destination byte is checked against its content code and
every other byte of the consumer against its value before; NIXL still carries the handshake's
warm-up, and the initiator rings each ``done`` on the doorbell its peer offered for the session
(kvlc.runtime.ipc.bell; NIXL's notifications where it offered none). A peer whose memory is
private, or an agent with ``ipc="off"``, moves the same requests through NIXL.
"""

from __future__ import annotations

import os
import re
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from runtime_engines import check_bytes, check_from_many, config, flip, move

from kvlc.demo.procs import start_engines, stop_engines

pytest.importorskip("torch")
pytest.importorskip("nixl")
pytestmark = pytest.mark.runtime


@pytest.fixture(scope="module")
def eng(plans):
    """X, Y0, Y1 (content-coded producers) and Z (noise, the consumer), DRAM shared; P: X's plan in
    private memory (NIXL only)."""
    names = ("x", "y0", "y1", "z", "p")
    handles = start_engines([config(plans["x"], 0, "content", shared=True),
                             config(plans["y"], 0, "content", shared=True),
                             config(plans["y"], 1, "content", shared=True),
                             config(plans["z"], 0, "random", seed=3, shared=True),
                             config(plans["x"], 0, "content", engine_id="private-x")])
    yield dict(zip(names, handles))
    stop_engines(handles)


def _ipc(h) -> int:
    return h.call("stats")["ipc_requests"]


def _bells(*hs) -> list[tuple[int, int]]:
    """Per engine: (notifications it rang on peers' doorbells, notifications it took from its own)."""
    return [(st["bell_rung"], st["bell_taken"]) for st in (h.call("stats") for h in hs)]


def _since(before: list[tuple[int, int]], *hs) -> list[tuple[int, int]]:
    """:func:`_bells` of ``hs`` now, less ``before``."""
    return [(r - r0, t - t0) for (r, t), (r0, t0) in zip(_bells(*hs), before)]


@pytest.mark.parametrize("mode", ["direct", "prepped"])
def test_pull_copies_through_the_mapped_producer(eng, plans, mode):
    x, z = eng["x"], eng["z"]
    z.connect([x.address], "READ", mode, f"x-ipc-{mode}")
    reqs = [(f"ipc-pull-{mode}-1", {"full": [0]}, {"full": [7]}, 1),
            (f"ipc-pull-{mode}-2", {"full": [2, 3, 4]}, {"full": [63, 0, 9]}, 40),
            (f"ipc-pull-{mode}-3", {"full": list(range(5, 12))}, {"full": [11, 12, 13, 14, 15, 16, 17]}, 100)]
    before, n, bells = z.call("dump"), _ipc(z), _bells(z, x)
    move(z, f"x-ipc-{mode}", "read", reqs)
    check_bytes(z, plans["z"], plans["x"], before, reqs)
    assert _ipc(z) == n + len(reqs)  # every request copied, none through NIXL
    assert sorted(r[0] for r in reqs) == sorted(x.call("events")["freeable"])  # the producer heard done
    (z_rung, _), (_, x_taken) = _since(bells, z, x)
    assert z_rung >= 1 and x_taken == z_rung  # ... rung on the doorbell x offered z: every one taken


def test_push_and_pull_via_push_copy_into_the_mapped_consumer(eng, plans):
    x, z = eng["x"], eng["z"]
    x.connect([z.address], "WRITE", "direct", "z-ipc-push")
    z.connect([x.address], "READ", "pull_via_push", "x-ipc-pvp")
    pushed = [("ipc-push-1", {"full": [20, 21]}, {"full": [5, 6]}, 30)]
    pulled = [("ipc-pvp-1", {"full": [30, 31, 32]}, {"full": [1, 2, 3]}, 48)]
    before, n, bells = z.call("dump"), _ipc(x), _bells(x, z)
    move(x, "z-ipc-push", "write", flip(pushed), waiters=[z])
    errors = z.call("submit", "x-ipc-pvp", "read", pulled, 30.0, 0, None)
    assert not errors, errors
    out = z.call("wait", ["ipc-pvp-1"], 30.0)
    assert out["failed"] == {} and out["open"] == [], out
    check_bytes(z, plans["z"], plans["x"], before, pushed + pulled)
    assert _ipc(x) == n + 2  # the producer moved both (one push, one pull it was asked for)
    (x_rung, _), (_, z_taken) = _since(bells, x, z)
    assert x_rung >= 2 and z_taken == x_rung  # both ``done`` on the doorbells z offered x (reply, pvp hello)


def test_a_doorbell_lives_as_long_as_its_session(eng, plans):
    """Each same-host hello gets a doorbell of its own; when that peer goes (its sessions end), the
    doorbells offered to it are closed; the engine's others stay."""
    z = eng["z"]
    (w,) = start_engines([config(plans["x"], 0, "content", shared=True, engine_id="bell-churn")])
    try:
        open_before = z.call("stats")["bells"]
        w.connect([z.address], "WRITE", "direct", "bell-z")
        assert z.call("stats")["bells"] == open_before + 1
        pushed = [("bell-push-1", {"full": [22]}, {"full": [7]}, 16)]
        before = z.call("dump")
        move(w, "bell-z", "write", flip(pushed), waiters=[z])
        check_bytes(z, plans["z"], plans["x"], before, pushed)
        (w_rung, _), = _since([(0, 0)], w)
        assert w_rung == 1
    finally:
        stop_engines([w])
    deadline = time.monotonic() + 20
    while z.call("stats")["bells"] != open_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert z.call("stats")["bells"] == open_before


def test_tp2_producer_ranks_map_separately(eng, plans):
    """Z (TP1, 16-token blocks) pulls from both ranks of Y (TP2, HND, 32-token blocks): two mapped peers."""
    y0, y1, z = eng["y0"], eng["y1"], eng["z"]
    z.connect([y0.address, y1.address], "READ", "direct", "y-ipc")
    reqs = [("ipc-tp-1", {"full": [40, 41, 42, 43]}, {"full": [2, 3]}, 64)]
    before, n = z.call("dump"), _ipc(z)
    move(z, "y-ipc", "read", reqs)
    check_from_many(z, plans["z"], before, [(plans["y"], reqs)])
    assert _ipc(z) == n + 1


def test_a_batch_to_a_mapped_peer_goes_request_by_request(eng, plans):
    """write_many / read_many where the same-host copy moves every part: one copy per request (each
    starts as soon as its request is built), not one joined copy; every byte right, each request
    reported on its own; no NIXL request."""
    x, z = eng["x"], eng["z"]
    x.connect([z.address], "WRITE", "direct", "z-ipc-batch")
    z.connect([x.address], "READ", "direct", "x-ipc-batch")
    pushed = [(f"ipc-bw-{i}", {"full": [100 + 2 * i, 101 + 2 * i]}, {"full": [40 + i, 50 + i]}, 20 + i)
              for i in range(4)]
    pulled = [(f"ipc-br-{i}", {"full": [120 + i]}, {"full": [60 - i]}, 1 + 5 * i) for i in range(3)]
    before = z.call("dump")
    sx, sz = x.call("stats"), z.call("stats")
    move(x, "z-ipc-batch", "write_many", flip(pushed), waiters=[z])
    move(z, "x-ipc-batch", "read_many", pulled)
    check_bytes(z, plans["z"], plans["x"], before, pushed + pulled)
    for h, s0, n in ((x, sx, len(pushed)), (z, sz, len(pulled))):
        s1 = h.call("stats")
        got = {k: s1[k] - s0[k] for k in ("requests", "ipc_requests", "ipc_copies", "nixl_requests")}
        assert got == {"requests": n, "ipc_requests": n, "ipc_copies": n, "nixl_requests": 0}, got


def test_a_bad_request_refuses_a_batch_to_a_mapped_peer_before_any_copy(eng):
    """Request by request still checks every request first: the last one's bad id refuses the batch,
    naming it, before any request is built or copied; nothing changes in the consumer."""
    x, z = eng["x"], eng["z"]
    z.connect([x.address], "READ", "direct", "x-ipc-refuse")
    bad = [(f"ipc-bad-{i}", {"full": [130 + i]}, {"full": [i]}, 10) for i in range(3)]
    bad[2] = (bad[2][0], bad[2][1], {"full": [64]}, 10)
    before, s0 = z.call("dump"), z.call("stats")
    errors = z.call("submit", "x-ipc-refuse", "read_many", bad, 30.0)
    assert set(errors) == {r[0] for r in bad}
    assert all(re.search(r"batch item 2 \(request 'ipc-bad-2'\): .*out of range", e) for e in errors.values()), errors
    after, s1 = z.call("dump"), z.call("stats")
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert [s1[k] - s0[k] for k in ("requests", "ipc_copies", "in_flight")] == [0, 0, 0]


def test_private_memory_goes_through_nixl(eng, plans):
    """P's storages are private (not in shared files): nothing is offered, NIXL moves the bytes."""
    p, z = eng["p"], eng["z"]
    z.connect([p.address], "READ", "direct", "p-nixl")
    reqs = [("nixl-pull-1", {"full": [50, 51]}, {"full": [8, 9]}, 20)]
    before, n, m = z.call("dump"), _ipc(z), z.call("stats")["nixl_requests"]
    move(z, "p-nixl", "read", reqs)
    check_bytes(z, plans["z"], plans["x"], before, reqs)
    assert _ipc(z) == n and z.call("stats")["nixl_requests"] > m


def test_ipc_off_goes_through_nixl(plans):
    handles = start_engines([config(plans["x"], 0, "content", shared=True, engine_id="off-x"),
                             config(plans["z"], 0, "random", seed=4, shared=True, engine_id="off-z", ipc="off")])
    try:
        x, z = handles
        z.connect([x.address], "READ", "direct", "x-off")
        reqs = [("off-1", {"full": [1, 2]}, {"full": [5, 6]}, 30)]
        before = z.call("dump")
        move(z, "x-off", "read", reqs)
        check_bytes(z, plans["z"], plans["x"], before, reqs)
        assert _ipc(z) == 0 and z.call("stats")["nixl_requests"] >= 1
    finally:
        stop_engines(handles)


# ---------------------------------------------------------------- the route, in one process
def _route_pair(nbytes: int = 1 << 16):
    """A route over one shared DRAM storage of ours, with a peer's shared storage mapped as NIXL agent 'peer'."""
    from kvlc.runtime.channel.wire import Shared, SharedStorage
    from kvlc.runtime.ipc.memory import host_key, open_offer
    from kvlc.runtime.ipc.route import IpcRoute
    from kvlc.runtime.shm import file_of, shared_dram

    mine, theirs = shared_dram(nbytes), shared_dram(nbytes)
    fd, off = file_of(theirs.data_ptr(), nbytes)
    fake_addr = 1 << 40  # the peer's address space differs from ours: rows name its addresses

    offer = Shared(host=host_key(), pid=os.getpid(), storages=(SharedStorage(
        name="kv", addr=fake_addr, size=nbytes, mem="DRAM", device=0, fd=fd, offset=off),))

    from types import SimpleNamespace

    bound = SimpleNamespace(name="kv", mem="DRAM", device=0, tensor=mine, addr=mine.data_ptr(), nbytes=nbytes)
    route = IpcRoute(nixl=None, bindings={"kv": bound})
    route.add(open_offer("peer", offer, route.devices()))
    return route, mine, theirs, fake_addr


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_route_copies_any_rows_like_the_reference(data):
    """Random rows (offsets, lengths, order): the route's copy equals a byte-by-byte reference, and no
    byte outside the rows changes, READ and WRITE."""
    from kvlc.runtime.nixl.core import XferState

    route, mine, theirs, base = _route_pair(4096)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    mine.numpy()[:] = rng.integers(0, 256, 4096, dtype=np.uint8)
    theirs.numpy()[:] = rng.integers(0, 256, 4096, dtype=np.uint8)
    n = data.draw(st.integers(1, 12))
    lens = data.draw(st.lists(st.integers(1, 200), min_size=n, max_size=n))
    slots = data.draw(st.permutations(range(16)))[:n]  # disjoint 256-byte slots on each side
    other = data.draw(st.permutations(range(16)))[:n]
    op = data.draw(st.sampled_from(["READ", "WRITE"]))
    local = np.array([[mine.data_ptr() + 256 * s, ln, 0] for s, ln in zip(slots, lens)], dtype=np.uint64)
    remote = np.array([[base + 256 * s, ln, 0] for s, ln in zip(other, lens)], dtype=np.uint64)
    want_mine, want_theirs = mine.numpy().copy(), theirs.numpy().copy()
    for s, o, ln in zip(slots, other, lens):
        if op == "READ":
            want_mine[256 * s:256 * s + ln] = want_theirs[256 * o:256 * o + ln]
        else:
            want_theirs[256 * o:256 * o + ln] = want_mine[256 * s:256 * s + ln]
    x = route.initialize(op, local, "DRAM", remote, "DRAM", "peer", "rows")
    assert route.in_flight == 0
    assert route.post(x) is XferState.DONE
    assert route.in_flight == 1  # until released: the progress thread keeps its short interval meanwhile
    x.release()
    x.release()
    assert route.in_flight == 0
    assert (mine.numpy() == want_mine).all() and (theirs.numpy() == want_theirs).all()
    route.close()


def test_route_refuses_rows_outside_the_peer_memory():
    from kvlc.runtime.ipc.cuda import IpcError

    route, mine, theirs, base = _route_pair(4096)
    local = np.array([[mine.data_ptr(), 64, 0]], dtype=np.uint64)
    # past the end; before the start; a length that wraps around the address space; one good row, one bad
    for rows in ([(base + 4090, 64)], [(base - 8, 16)], [(base + 64, 2**64 - 32)], [(base, 64), (base + 4064, 64)]):
        with pytest.raises(IpcError, match="outside every storage it shared; nothing moved"):
            route.initialize("WRITE", np.repeat(local, len(rows), axis=0), "DRAM",
                             np.array([[a, n, 0] for a, n in rows], dtype=np.uint64), "DRAM", "peer")
    assert not theirs.any()
    route.close()


def test_route_unmaps_a_dropped_peer_after_its_last_copy():
    route, mine, _, base = _route_pair(4096)
    local = np.array([[mine.data_ptr(), 64, 0]], dtype=np.uint64)
    x = route.initialize("WRITE", local, "DRAM", np.array([[base, 64, 0]], dtype=np.uint64), "DRAM", "peer")
    w = route.peers["peer"]
    route.drop("peer")  # the session ended while a copy is created
    assert not w.mapped.closed and not route.covers("peer", "DRAM", "DRAM")
    route.post(x)
    x.release()
    assert w.mapped.closed and route.retired == []


def test_pinned_dram_to_vram_needs_a_gpu_that_reaches_it():
    """This side's DRAM to a peer's VRAM is copied here only where this side's GPU reads its DRAM in
    place; without a GPU (or with pageable DRAM) NIXL moves such parts."""
    route, _, _, _ = _route_pair(4096)
    route.peers["peer"].mems.add("VRAM")  # as if the peer had shared a VRAM storage
    assert route.gpu is None and not route.covers("peer", "DRAM", "VRAM")
    assert not route.covers("peer", "VRAM", "DRAM")
    route.close()


def test_another_host_is_not_mapped():
    from kvlc.runtime.channel.wire import Shared, SharedStorage
    from kvlc.runtime.ipc.cuda import IpcError
    from kvlc.runtime.ipc.memory import open_offer

    offer = Shared(host="another-boot:1", pid=1, storages=(SharedStorage(
        name="kv", addr=4096, size=4096, mem="DRAM", device=0, fd=3),))
    with pytest.raises(IpcError, match="another host"):
        open_offer("peer", offer, {"DRAM": 0})


def test_few_vram_rows_go_through_nixl_many_through_the_copy():
    """VRAM-to-VRAM parts of fewer than ``min_rows`` rows go through NIXL (UCX moves a few large rows on
    the copy engines without the kernel's start); DRAM parts and parts of more rows are copied here."""
    from types import SimpleNamespace

    from kvlc.runtime.ipc.route import IpcRoute

    calls = []
    nixl = SimpleNamespace(initialize=lambda op, lr, lm, rr, rm, peer, what: calls.append((lm, rm, len(lr))) or "nixl")
    route = IpcRoute(nixl=nixl, bindings={}, min_rows=64)
    route.peers["peer"] = SimpleNamespace(mems={"VRAM", "DRAM"})
    assert not route.copies_part("peer", "VRAM", "VRAM", 63)
    assert route.copies_part("peer", "VRAM", "VRAM", 64)
    assert route.copies_part("peer", "DRAM", "DRAM", 1)
    assert not route.copies_part("elsewhere", "VRAM", "VRAM", 1000)  # not mapped: NIXL whatever the rows
    rows = np.zeros((63, 3), dtype=np.uint64)
    assert route.initialize("WRITE", rows, "VRAM", rows, "VRAM", "peer") == "nixl"
    assert calls == [("VRAM", "VRAM", 63)]
    assert IpcRoute(nixl=nixl, bindings={}).min_rows == 0  # 0: every part of a mapped peer is copied
