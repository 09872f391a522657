"""Discovery with leases: engines announce their side-channel addresses in a real etcd, are found,
lost when killed (the lease runs out) and found again under a new epoch; a forged entry leads to a
failed handshake; with the registry down, connected engines keep moving bytes and callers hear why.
"""

from __future__ import annotations

import time

import pytest
from runtime_engines import TEST_LAYOUTS, check_bytes, config, move

from kvlc import compile_spec
from kvlc.demo.procs import EngineProcess, RemoteError, stop_engines
from kvlc.runtime.discovery import EngineAddress, Registry, RegistryError
from testkit.etcd import Etcd, unavailable

pytestmark = [pytest.mark.runtime, pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))]
TTL = 2  # seconds: etcd's shortest lease


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    server = Etcd(tmp_path_factory.mktemp("etcd")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def plan():
    return compile_spec(TEST_LAYOUTS / "dense-tp1.yaml")


def _gone(registry: Registry, engine_id: str, timeout: float) -> float:
    """Seconds until ``engine_id`` has no entry left (fails after ``timeout``)."""
    t0 = time.monotonic()
    while registry.lookup(engine_id):
        assert time.monotonic() - t0 < timeout, f"{engine_id} still registered after {timeout}s"
        time.sleep(0.2)
    return time.monotonic() - t0


def _producer(plan, etcd, engine_id: str):
    proc = EngineProcess()
    h = proc.add(config(plan, 0, "content", engine_id=engine_id))
    h.call("announce", [etcd.url], TTL)
    return proc, h


def _pull(consumer, registry, engine_id, plan, tag: str) -> int:
    """Connect the consumer to ``engine_id`` as the registry names it, pull two requests, check every byte."""
    consumer.connect(registry.addresses(engine_id), peer_id=tag)
    before = consumer.call("dump")
    reqs = [(f"{tag}-a", {"full": [1, 2]}, {"full": [3, 4]}, 20), (f"{tag}-b", {"full": [5]}, {"full": [9]}, 16)]
    move(consumer, tag, "read", reqs)
    return check_bytes(consumer, plan, plan, before, reqs)


def test_an_engine_is_found_lost_when_killed_and_found_again(etcd, plan):
    registry = Registry(etcd.url, ttl=TTL)
    cproc = EngineProcess()
    consumer = cproc.add(config(plan, 0, "random", seed=3, engine_id="disc-c"))
    pproc, producer = _producer(plan, etcd, "disc-p")
    try:
        (first,) = registry.lookup("disc-p")
        assert first.address == producer.address and first.rank == 0
        assert _pull(consumer, registry, "disc-p", plan, "first") > 0

        pproc.kill()  # kill -9: nobody revokes the lease
        took = _gone(registry, "disc-p", timeout=TTL + 8)
        assert took >= 0.5, "the entry went before its lease could have run out"

        pproc, producer = _producer(plan, etcd, "disc-p")
        (again,) = registry.lookup("disc-p")
        assert again.epoch != first.epoch and again.address == producer.address
        assert _pull(consumer, registry, "disc-p", plan, "again") > 0
    finally:
        stop_engines([consumer, producer])


def test_a_forged_entry_fails_the_handshake(etcd, plan):
    """Someone writes an address into etcd for an engine id: the records still come over the
    authenticated side channel, so a server without the shared secret is refused and nothing is added."""
    registry = Registry(etcd.url, ttl=TTL)
    stranger_proc, consumer_proc = EngineProcess(), EngineProcess()
    stranger = stranger_proc.add(config(plan, 0, "content", engine_id="disc-stranger", secret="x" * 64))
    consumer = consumer_proc.add(config(plan, 0, "random", engine_id="disc-c2"))
    host, port = stranger.address.rsplit(":", 1)
    try:
        with registry.announce(EngineAddress(engine_id="disc-victim", rank=0, host=host, port=int(port),
                                             epoch="forged")):
            with pytest.raises(RemoteError) as err:
                consumer.connect(registry.addresses("disc-victim"), peer_id="forged")
            assert err.value.kind in ("AuthError", "HandshakeError", "ChannelError"), err.value
            assert consumer.call("stats")["remotes"] == 0
    finally:
        stop_engines([stranger, consumer])


def test_registry_down_connected_engines_keep_working_and_callers_hear_it(etcd, plan):
    registry = Registry(etcd.url, ttl=TTL, timeout=0.5)
    cproc = EngineProcess()
    consumer = cproc.add(config(plan, 0, "random", seed=5, engine_id="disc-c3"))
    pproc, producer = _producer(plan, etcd, "disc-p3")
    try:
        assert _pull(consumer, registry, "disc-p3", plan, "up") > 0
        etcd.stop()
        with pytest.raises(RegistryError, match=r"unreachable .*127\.0\.0\.1"):
            registry.lookup("disc-p3")
        deadline = time.monotonic() + 10
        while producer.call("announced")["error"] is None:  # the keep-alive noticed
            assert time.monotonic() < deadline, "the announcement never reported the registry down"
            time.sleep(0.3)
        assert "unreachable" in producer.call("announced")["error"]
        # The connection made while the registry was up keeps working.
        before = consumer.call("dump")
        reqs = [("down-a", {"full": [7, 8]}, {"full": [10, 11]}, 32)]
        move(consumer, "up", "read", reqs)
        assert check_bytes(consumer, plan, plan, before, reqs) > 0
        # Back up (the lease ran out meanwhile): the announcement puts the address again. etcd may
        # restore the old lease on restart (the record is then visible before the announcer's next
        # keep-alive), so wait for both: the address found and the announcement's error cleared.
        time.sleep(TTL + 1)
        etcd.start()
        deadline = time.monotonic() + 15
        while not registry.lookup("disc-p3") or producer.call("announced")["error"] is not None:
            assert time.monotonic() < deadline, (
                f"not announced again after the registry came back: {producer.call('announced')}")
            time.sleep(0.3)
        assert [a.engine_id for a in registry.lookup("disc-p3")] == ["disc-p3"]
    finally:
        if etcd.proc is None:
            etcd.start()
        stop_engines([consumer, producer])


def test_what_the_registry_refuses():
    with pytest.raises(ValueError, match="bind-all address"):
        EngineAddress(engine_id="e", rank=0, host="0.0.0.0", port=1, epoch="x")
    with pytest.raises(ValueError, match="bind-all address"):
        EngineAddress(engine_id="e", rank=0, host="::", port=1, epoch="x")
    with pytest.raises(RegistryError, match="no registry endpoint"):
        Registry([])
    with pytest.raises(RegistryError, match="expected an http"):
        Registry("10.0.0.1:2379")
    with pytest.raises(RegistryError, match="at least 2 seconds"):
        Registry("http://127.0.0.1:1", ttl=float("nan"))


def test_lookup_skips_foreign_entries_and_names_missing_ranks(etcd):
    registry = Registry(etcd.url, ttl=TTL)
    # Something else wrote under kvlc's prefix: not an engine address, skipped.
    key = "/kvlc/engines/disc-odd/0"
    import base64

    registry._call("kv/put", {"key": base64.b64encode(key.encode()).decode(),
                              "value": base64.b64encode(b"{\"nixl\": \"metadata\"}").decode()})
    assert registry.lookup("disc-odd") == []
    with registry.announce(EngineAddress(engine_id="disc-gap", rank=1, host="10.1.0.2", port=7, epoch="e1")):
        with pytest.raises(RegistryError, match=r"ranks \[1\] announced; expected 0..n-1"):
            registry.addresses("disc-gap")
    with pytest.raises(RegistryError, match="not in the registry"):
        registry.addresses("disc-none")
