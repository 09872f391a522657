"""Helpers for the multi-process runtime tests: start engine processes, move requests, check bytes."""

from __future__ import annotations

import socket
from pathlib import Path

from kvlc.runtime.channel.auth import resolve_secret
from kvlc.demo.run import verify
from kvlc.demo.procs import HARNESS_SECRET, AgentHandle, EngineConfig, EngineProcess, start_engines

TIMEOUT = 30.0
SECRET = HARNESS_SECRET  # every engine of a test run shares it; in-process agents pass it too
KEY = resolve_secret(SECRET)  # the channel key a raw test client authenticates with
ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = ROOT / "layouts"
TEST_LAYOUTS = ROOT / "tests" / "runtime" / "layouts"


def signed_hello(client, server_agent: str, record, identity, direction: str = "READ",
                 mode: str = "pull_via_push"):
    """A hello introducing ``record``, signed with ``identity`` over ``client``'s connection (made now):
    what an insider holding its own key can send (:mod:`kvlc.runtime.channel.identity`)."""
    from kvlc.runtime.channel.identity import introduction
    from kvlc.runtime.channel.wire import Introduce

    client.connect()
    msg = introduction(client.sealed.binding, server_agent, record.agent, direction, mode)
    return Introduce(record=record, direction=direction, mode=mode, proof=identity.sign(msg))


def tiny_plans() -> dict:
    """The tiny dense engines of the multi-process tests: ``x`` TP1 NHD 16-token blocks (64),
    ``y`` TP2 HND 32-token blocks, ``z`` TP1 with 256 blocks."""
    from kvlc import compile_spec

    return {"x": compile_spec(TEST_LAYOUTS / "dense-tp1.yaml"),
            "y": compile_spec(TEST_LAYOUTS / "dense-tp2-hnd-b32.yaml"),
            "z": compile_spec(TEST_LAYOUTS / "dense-tp1-pool256.yaml")}


def config(plan, rank: int, fill: str, seed: int = 0, **kw) -> EngineConfig:
    """One rank's config; ranks of one engine share ``engine_id`` (default: the plan's name and whether the
    rank is content-coded, i.e. a producer in these tests)."""
    kw.setdefault("timeout", TIMEOUT)
    kw.setdefault("engine_id", f"{plan.name}-{'p' if fill == 'content' else 'c'}")
    return EngineConfig(plan.to_json(), rank, fill=fill, seed=seed, **kw)


def xyz_engines(plans: dict, seed: int, prefix: str | None = None) -> dict[str, AgentHandle]:
    """Start the engines of :func:`tiny_plans` (X, and Y's ranks 0 and 1: content-coded producers; Z:
    noise of ``seed``, the consumer), one process each; ``prefix`` names their engine ids
    (``<prefix>-x`` ...). Returns them by name (``x``, ``y0``, ``y1``, ``z``); stop with
    ``stop_engines(list(...values()))``."""
    def eid(name: str) -> dict:
        return {"engine_id": f"{prefix}-{name}"} if prefix else {}

    handles = start_engines([config(plans["x"], 0, "content", **eid("x")),
                             config(plans["y"], 0, "content", **eid("y")),
                             config(plans["y"], 1, "content", **eid("y")),
                             config(plans["z"], 0, "random", seed=seed, **eid("z"))])
    return dict(zip(("x", "y0", "y1", "z"), handles))


def move(initiator: AgentHandle, peer_id: str, method: str, requests, waiters=(), options: dict | None = None
         ) -> dict:
    """Submit ``requests`` (id, local ids, remote ids, tokens) on the initiator, then wait for every one
    on the initiator and on each waiting agent. Returns the initiator's outcome. ``options``: more
    keyword arguments of ``read`` / ``write`` (e.g. ``produced_at``)."""
    errors = initiator.call("submit", peer_id, method, list(requests), TIMEOUT, 0, options)
    assert not errors, errors
    ids = [r[0] for r in requests]
    out = initiator.call("wait", ids, TIMEOUT)
    assert out["failed"] == {} and out["open"] == [], out
    for w in waiters:
        got = w.call("wait", ids, TIMEOUT)
        assert got["failed"] == {} and got["open"] == [], got
    return out


def check_bytes(consumer: AgentHandle, consumer_plan, producer_plan, before, requests) -> int:
    """Every requested byte holds its content code; every other byte of the consumer is unchanged.

    ``requests`` are (id, consumer ids, producer ids, tokens). Returns the number of bytes checked.
    """
    after = consumer.call("dump")
    checked, problems = verify(consumer_plan, consumer.config.rank, producer_plan, before, after, requests)
    assert not problems, problems[:5]
    assert checked > 0
    return checked


def flip(requests):
    """(id, a, b, n) → (id, b, a, n): the same requests seen from the other side."""
    return [(r, b, a, n) for r, a, b, n in requests]


def check_from_many(consumer: AgentHandle, consumer_plan, before, batches, after=None) -> int:
    """Like :func:`check_bytes` for requests from several producer engines: ``batches`` is a list of
    (producer plan, requests). Every requested byte holds its code, every other byte is unchanged."""
    import numpy as np

    from kvlc.demo.content import expected_bytes

    after = consumer.call("dump") if after is None else after
    touched = {k: np.zeros(len(v), bool) for k, v in after.items()}
    checked, problems = 0, []
    for producer_plan, requests in batches:
        for req, cids, pids, tokens in requests:
            for storage, idx, vals in expected_bytes(consumer_plan, consumer.config.rank, producer_plan,
                                                     cids, pids, tokens):
                bad = np.flatnonzero(after[storage][idx] != vals)
                if bad.size:
                    problems.append(f"{req}: {storage}: {bad.size} wrong bytes")
                touched[storage][idx] = True
                checked += idx.size
    for name, t in touched.items():
        changed = np.flatnonzero((after[name] != before[name]) & ~t)
        if changed.size:
            problems.append(f"{name}: {changed.size} bytes outside the requested blocks changed")
    assert not problems, problems[:5]
    assert checked > 0
    return checked


def settle(consumer: AgentHandle, req_id: str, timeout: float = 30.0) -> tuple[dict, dict]:
    """Wait for ``req_id``'s terminal answer on ``consumer``, then prove no byte of its memory changes
    afterwards (1.5 s) and no request flipped; returns (the wait's outcome, the memory at the answer)."""
    import time

    out = consumer.call("wait", [req_id], timeout)
    assert out["open"] == [], out
    snap = consumer.call("dump")
    time.sleep(1.5)
    again = consumer.call("dump")
    late = {k: int((snap[k] != again[k]).sum()) for k in snap}
    assert sum(late.values()) == 0, f"bytes landed after the request was reported terminal: {late}"
    assert consumer.call("events")["flips"] == []
    return out, snap


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (an engine restarted on it keeps its address)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_requests(tag: str) -> list:
    """Two small requests (id, consumer ids, producer ids, tokens) named after ``tag``."""
    return [(f"{tag}-a", {"full": [1, 2]}, {"full": [5, 6]}, 30), (f"{tag}-b", {"full": [9]}, {"full": [3]}, 16)]


def start_one(plan, fill: str, eid: str, seed: int = 0, port: int = 0, **kw):
    """One engine process hosting one agent of ``plan`` (rank 0): (the process, the agent's handle);
    ``kw`` goes to the agent's config (``ipc="off"``, say)."""
    proc = EngineProcess()
    return proc, proc.add(config(plan, 0, fill, seed=seed, engine_id=eid, port=port, **kw))
