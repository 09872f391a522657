"""Engines restarted under a steady request stream, as a supervisor restarts them (CPU, float32).

A client thread runs P/D requests back to back (prefill on ``p`` kept for a consumer, decode on ``d``
with the params it returned) while the main thread kills and restarts the prefill engine on the
same kvlc address, then the decode engine (its kvlc port is any free one, as a fresh engine's is).
Neither engine is told about the other's restart. Contract:

* zero wrong tokens: every decode equals the decode engine's own output for that prompt;
* zero hangs: every request ends within its timeout, or fails at once because its engine is down;
* a request whose KV went away (prefilled before the prefill engine died, decoded after) is
  recomputed and counted (``num_cached_tokens`` below the prompt), never wrong;
* the first P/D request after each restart loads its KV: never a silent recompute.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field

import pytest

from testkit.vllm_engines import EngineDied, EngineSpec
from tests.engines.conftest import Engines, engine_env, for_decode, kvlc_config, prompt

pytestmark = pytest.mark.engine
MAX_TOKENS = 6
N = 100  # prompt tokens: three full 32-token blocks and a partial one
LOADED = N - 1  # vLLM computes at least the last prompt token itself


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Tally:
    """What the client thread saw."""

    loaded: int = 0
    recomputed: int = 0
    down: int = 0          # a request to an engine that was down (restarting): refused at once
    wrong: list = field(default_factory=list)
    errors: list = field(default_factory=list)


@pytest.fixture(scope="module")
def engines(model_dir, tmp_path_factory):
    e = Engines(tmp_path_factory.mktemp("restart-logs"))
    e.specs = {
        "p": EngineSpec(model_dir, 32, dtype="float32", env=engine_env(0),
                        connector=kvlc_config("kv_producer", port=_free_port())),
        "d": EngineSpec(model_dir, 32, dtype="float32", env=engine_env(1), connector=kvlc_config("kv_consumer")),
    }
    for name, spec in e.specs.items():
        e.start(name, spec)
    yield e
    e.close()


def _restart(engines, name: str, gate: threading.Lock) -> float:
    """kill -9 the engine and start it again with the same spec; the seconds until it was ready. The
    client takes engines under ``gate``, so it never waits on a half-started one with this thread."""
    t0 = time.monotonic()
    with gate:
        engines.procs[name].kill()
        engines.start(name, engines.specs[name])
        engines[name]  # waits until ready
    return time.monotonic() - t0


def _pd(p_engine, d_engine, p: list[int], timeout: float = 120.0):
    (o,) = p_engine.generate([p], 1, [{"do_remote_decode": True}], timeout=timeout)
    return d_engine.generate([p], MAX_TOKENS, [for_decode(o.kv_transfer_params)], timeout=timeout)[0]


def _stream(engines, gate: threading.Lock, prompts: dict, refs: dict, stop: threading.Event, tally: Tally) -> None:
    """P/D requests back to back until ``stop``; every outcome tallied."""
    i = 0
    while not stop.is_set():
        seed = i % len(prompts)
        i += 1
        with gate:
            pe, de = engines.procs["p"], engines.procs["d"]
        try:
            out = _pd(pe, de, prompts[seed])
        except EngineDied:  # its engine was killed under it (restarting): the request is refused at once
            tally.down += 1
            continue
        except Exception as exc:  # noqa: BLE001 - anything else is a finding
            tally.errors.append(repr(exc))
            continue
        if out.tokens != refs[seed]:
            tally.wrong.append((seed, out.tokens, refs[seed]))
        elif out.num_cached_tokens >= LOADED:
            tally.loaded += 1
        else:
            tally.recomputed += 1


def test_rolling_restart_under_a_request_stream(engines):
    prompts = {s: prompt(N, seed=40 + s) for s in range(3)}
    refs = {s: engines["d"].generate([p], MAX_TOKENS)[0].tokens for s, p in prompts.items()}
    first = _pd(engines["p"], engines["d"], prompts[0])
    assert first.tokens == refs[0] and first.num_cached_tokens >= LOADED, first

    gate, tally, stop = threading.Lock(), Tally(), threading.Event()
    client = threading.Thread(target=_stream, args=(engines, gate, prompts, refs, stop, tally), daemon=True)
    client.start()
    time.sleep(3)
    with gate:  # KV prefilled before the prefill engine dies, decoded after it is back: recomputed, right
        (held,) = engines["p"].generate([prompts[1]], 1, [{"do_remote_decode": True}])
    took = {"p": _restart(engines, "p", gate)}
    with gate:
        late = engines["d"].generate([prompts[1]], MAX_TOKENS, [for_decode(held.kv_transfer_params)])[0]
        # the first request after the restart loads (same address, new agent; the decode engine kept running)
        after = _pd(engines["p"], engines["d"], prompts[2])
    assert late.tokens == refs[1] and late.num_cached_tokens < LOADED, late
    assert after.tokens == refs[2] and after.num_cached_tokens >= LOADED, after
    time.sleep(3)
    took["d"] = _restart(engines, "d", gate)
    with gate:
        after = _pd(engines["p"], engines["d"], prompts[0])
    assert after.tokens == refs[0] and after.num_cached_tokens >= LOADED, after
    time.sleep(3)
    stop.set()
    client.join(timeout=300)
    assert not client.is_alive(), "the client hung"
    assert not tally.wrong, f"wrong tokens: {tally.wrong[:2]}"
    assert not tally.errors, tally.errors[:3]
    assert tally.loaded >= 2, tally
    print(f"restarts (s): {took}; stream: {tally}")
