"""Across hosts: engines in their own network and PID namespaces, joined by veth links, UCX over TCP.

Contracts:
- every transfer mode moves the right bytes between hosts (2 producers x 2 consumers on 4 hosts,
  TP1 and TP2, different block sizes), each agent serving and advertising its host's own address;
- a fence that holds over TCP: a request is reported failed (blocks reusable) only once no byte of it
  can land any more. With the link slowed (tbf) or cut mid-transfer, zero bytes change in the
  consumer's memory after its request was reported failed or finished, in every mode;
- a session lost in an outage, and a host killed (kill -9) and started again on its address, are seen
  by the other host's peers, reported once, and repaired by connecting again;
Skipped, with the reason, where network namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("nixl")

from runtime_engines import check_bytes, check_from_many, config, flip, move, settle, tiny_plans  # noqa: E402

from kvlc import compile_spec  # noqa: E402
from kvlc.demo.procs import stop_engines  # noqa: E402
from testkit.netns import Network, engine_on, unavailable  # noqa: E402

pytestmark = [pytest.mark.runtime, pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))]
LAYOUTS = Path(__file__).resolve().parent / "layouts"
MODES = ("direct", "prepped", "pull_via_push", "push")


@pytest.fixture(scope="module")
def plans():
    return tiny_plans()


@pytest.fixture(scope="module")
def four_hosts(plans):
    """X (TP1) on host 1, Y (TP2, both ranks in one process) on host 2: content-coded producers;
    Z (TP1, 256 blocks) on host 3 and W (the same) on host 4: consumers."""
    with Network(4, subnet=78) as net:
        h1, h2, h3, h4 = net.hosts
        procs = {n: engine_on(h) for n, h in (("x", h1), ("y", h2), ("z", h3), ("w", h4))}
        asks = {"x": procs["x"].add_async(config(plans["x"], 0, "content", host=h1.ip, engine_id="xh-x")),
                "y0": procs["y"].add_async(config(plans["y"], 0, "content", host=h2.ip, engine_id="xh-y")),
                "y1": procs["y"].add_async(config(plans["y"], 1, "content", host=h2.ip, engine_id="xh-y")),
                "z": procs["z"].add_async(config(plans["z"], 0, "random", seed=7, host=h3.ip, engine_id="xh-z")),
                "w": procs["w"].add_async(config(plans["z"], 0, "random", seed=8, host=h4.ip, engine_id="xh-w"))}
        eng = {}
        try:
            for name, ask in asks.items():
                eng[name] = ask.ready(120)
            yield net, eng
        finally:
            stop_engines(list(eng.values()) or [a for a in asks.values()])


def test_agents_advertise_their_hosts_address(four_hosts):
    """Each agent's side-channel address is its own host's, never a loopback or wildcard address."""
    net, eng = four_hosts
    ips = [h.ip for h in net.hosts]
    assert [eng[n].address.rsplit(":", 1)[0] for n in ("x", "y0", "y1", "z", "w")] == \
        [ips[0], ips[1], ips[1], ips[2], ips[3]]


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_between_four_hosts(four_hosts, plans, mode):
    """Both consumers take requests from both producers (TP1 same layout; TP2 HND 32-token blocks) in
    ``mode``; every destination byte is its content code, no other byte of the consumers changed."""
    net, eng = four_hosts
    base = 40 * MODES.index(mode)
    for ci, cname in enumerate(("z", "w")):
        cons = eng[cname]
        before = cons.call("dump")
        from_x = [(f"{mode}-{cname}-x{i}", {"full": [base + 2 * i, base + 2 * i + 1]},
                   {"full": [3 + i + ci, 40 + i]}, 20 + 5 * i) for i in range(3)]
        from_y = [(f"{mode}-{cname}-y{i}", {"full": [base + 10 + 4 * i + j for j in range(4)]},
                   {"full": [2 * i + ci, 2 * i + ci + 9]}, 50 + i) for i in range(2)]
        for prods, reqs, tag in ((["x"], from_x, "x"), (["y0", "y1"], from_y, "y")):
            peer_id = f"{mode}-{cname}-{tag}"
            if mode == "push":
                for p in prods:
                    eng[p].connect([cons.address], "WRITE", "direct", peer_id)
                for p in prods:
                    move(eng[p], peer_id, "write", flip(reqs))
                got = cons.call("wait", [r[0] for r in reqs], 30.0)
                assert got["failed"] == {} and got["open"] == [], got
            else:
                cons.connect([eng[p].address for p in prods], "READ", mode, peer_id)
                move(cons, peer_id, "read", reqs)
        check_from_many(cons, plans["z"], before, [(plans["x"], from_x), (plans["y"], from_y)])


@pytest.fixture()
def big_pair():
    """A producer and a consumer of 8 MiB requests on two hosts of their own, for link faults."""
    plan = compile_spec(LAYOUTS / "dense-8m.yaml")
    with Network(2, subnet=79) as net:
        a, b = net.hosts
        pp, cp = engine_on(a), engine_on(b)
        prod = pp.add(config(plan, 0, "content", host=a.ip, engine_id="big-p"))
        cons = cp.add(config(plan, 0, "random", seed=3, host=b.ip, engine_id="big-c"))
        try:
            yield net, plan, prod, cons
        finally:
            stop_engines([prod, cons])


def _start(prod, cons, mode: str, req, timeout: float) -> None:
    if mode == "push":
        prod.connect([cons.address], "WRITE", "direct", "f")
        cons.call("expect", req[0], timeout)
        assert prod.call("submit", "f", "write", flip([req]), timeout) == {}
    else:
        cons.connect([prod.address], "READ", mode, "f")
        assert cons.call("submit", "f", "read", [req], timeout) == {}


# Every mode on a slow link; a cut link (12 s each) in the two modes where bytes landed after `failed`
# before the fence held (direct: 7.9 MB, prepped: 8 KB; pull_via_push and push: none in those runs).
FAULTS = [(m, "slow") for m in MODES] + [("direct", "cut"), ("prepped", "cut")]


@pytest.mark.parametrize("mode, fault", FAULTS)
def test_no_byte_lands_after_a_request_ends(big_pair, mode, fault):
    """An 8 MiB request with a 1 s deadline on a link slowed to 16 Mbit/s ("slow": ~4 s of data queued
    in TCP, four times the deadline) or slowed and then cut mid-transfer for 12 s ("cut": TCP backs off
    its retransmissions meanwhile and resends after the link is back): the request is held while bytes
    may still land, ends failed (or finished with every byte right), and afterwards not one byte of the
    consumer's memory changes — also not after the link comes back."""
    net, plan, prod, cons = big_pair
    ids = list(range(8, 72))
    req = ("big", {"full": ids}, {"full": ids}, len(ids) * 16)  # 16-token blocks
    before = cons.call("dump")
    net.rate_limit(net.hosts[1], "16mbit")
    _start(prod, cons, mode, req, 1.0)
    if fault == "cut":
        time.sleep(0.5)
        net.link_down(net.hosts[1])
        time.sleep(12)
        net.link_up(net.hosts[1])
    out, snap = settle(cons, "big", timeout=90.0)
    if out["finished"]:
        check_bytes(cons, plan, plan, before, [req])
    else:
        assert "big" in out["failed"], out
    net.unlimit(net.hosts[1])
    time.sleep(2)
    again = cons.call("dump")
    late = sum(int((snap[k] != again[k]).sum()) for k in snap)
    assert late == 0, f"{late} bytes landed after the request ended"



PEER_TIMEOUT = 3.0  # the side channel's peer_timeout in the outage test (default 30 s)


def _until(pred, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not pred() and time.monotonic() < end:
        time.sleep(0.2)
    return pred()


def test_a_session_lost_in_an_outage_is_seen_reported_once_and_repaired(plans):
    """Issue 27 item 4: a consumer on its own host with a direct, a prepped and a pull-via-push peer to a
    producer on another; the consumer's link goes down for longer than the side channel's
    ``peer_timeout`` (3 s here), with no request in flight. The producer ends every session of it
    during the outage. After the link is back, each peer's next request sees the loss, reports it once
    and connects again by itself (the engine does not call connect()), and moves every byte right; a
    second round loses nothing more. The producer then holds only the three new sessions (no stale
    one), one remote NIXL agent and one record of the consumer."""
    plan = plans["x"]
    modes = ("direct", "prepped", "pull_via_push")
    limits = {"peer_timeout": PEER_TIMEOUT}
    with Network(2, subnet=80) as net:
        a, b = net.hosts
        prod = engine_on(a).add(config(plan, 0, "content", host=a.ip, engine_id="out-p", limits=limits))
        cons = engine_on(b).add(config(plan, 0, "random", seed=5, host=b.ip, engine_id="out-c", limits=limits))
        try:
            for mode in modes:
                cons.connect([prod.address], "READ", mode, mode)
                move(cons, mode, "read", _outage_reqs(f"{mode}-0"))
            assert prod.call("resources")["sessions"] == 3
            net.link_down(b)
            try:
                ended = _until(lambda: prod.call("resources")["sessions"] == 0, 4 * PEER_TIMEOUT)
                time.sleep(PEER_TIMEOUT)  # the consumer's side gives its connections up too
            finally:
                net.link_up(b)
            assert ended, prod.call("resources")
            _two_rounds_after_the_loss(cons, plan, modes, "")
            res = prod.call("resources")
            assert (res["sessions"], res["remotes"], res["records"]) == (3, 1, 1), res
        finally:
            stop_engines([prod, cons])


def _two_rounds_after_the_loss(cons, plan, modes, prefix: str) -> None:
    """Two rounds of requests on each of ``cons``'s peers after it lost its sessions: every byte right, the
    loss reported once per peer in round 1 and nothing more in round 2, no byte flipped."""
    for rnd in (1, 2):
        for mode in modes:
            before = cons.call("dump")
            move(cons, mode, "read", _outage_reqs(f"{prefix}{mode}-{rnd}"))
            check_bytes(cons, plan, plan, before, _outage_reqs(f"{prefix}{mode}-{rnd}"))
        assert cons.call("stats").get("sessions_lost") == len(modes)  # once per peer, round 2: none
    assert cons.call("events")["flips"] == []


def _outage_reqs(tag: str) -> list:
    return [(f"{tag}-a", {"full": [1, 2]}, {"full": [5, 6]}, 30), (f"{tag}-b", {"full": [9]}, {"full": [3]}, 16)]


def test_a_host_killed_and_restarted_on_its_address_is_reached_again(plans):
    """A producer host's engine killed (kill -9; PID 1 of its own PID namespace) and started again on the
    same address: the consumer on another host, one peer per pull mode, sees the loss once per peer,
    connects again by itself, and every byte of every request after the restart is right (as the new
    engine's content codes say). Each engine lives in a PID namespace of its own, neither the test's
    nor the other's."""
    plan, port = plans["x"], 47311
    modes = ("direct", "prepped", "pull_via_push")
    with Network(2, subnet=81) as net:
        a, b = net.hosts
        pproc, cproc = engine_on(a), engine_on(b)
        prod = pproc.add(config(plan, 0, "content", host=a.ip, engine_id="kr-p", port=port))
        cons = cproc.add(config(plan, 0, "random", seed=5, host=b.ip, engine_id="kr-c"))
        try:
            spaces = {os.readlink(f"/proc/{p.engine_pid()}/ns/pid") for p in (pproc, cproc)}
            assert len(spaces) == 2 and os.readlink("/proc/self/ns/pid") not in spaces
            for mode in modes:
                cons.connect([prod.address], "READ", mode, mode)
                move(cons, mode, "read", _outage_reqs(f"kr-{mode}-0"))
            pproc.kill()
            pproc = engine_on(a)
            prod = pproc.add(config(plan, 0, "content", host=a.ip, engine_id="kr-p", port=port))
            _two_rounds_after_the_loss(cons, plan, modes, "kr-")
        finally:
            stop_engines([prod, cons])
