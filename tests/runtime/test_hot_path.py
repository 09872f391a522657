"""The per-request hot path: the progress thread never makes the engine wait, post/state build messages
only on failure (and still name the operation), the one-run shortcut of instantiate's segments
gives what the general path gives, and so do the small-input (Python) paths of segments and coalesce."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlc.compiler.algebra.copies import coalesce_rows
from kvlc.compiler.request.instantiate import _SMALL, _segments
from kvlc.compiler.request.rows import coalesce
from kvlc.runtime.settings import AgentSettings
from kvlc.runtime.errors import NixlError
from kvlc.runtime.nixl.core import Agent, Xfer, XferState


# ------------------------------------------------------------------ progress thread
@pytest.fixture(scope="module")
def kv_agent():
    from kvlc.runtime.agent import KvAgent
    from kvlc.runtime.binding import allocate
    from kvlc.demo.run import DEFAULT_LAYOUT, cpu_plan

    plan = cpu_plan(DEFAULT_LAYOUT, max_bytes=1 << 20)
    agent = KvAgent(plan, 0, allocate(plan), AgentSettings(insecure=True, progress="manual"))
    yield agent
    agent.close()


def _counting(agent, monkeypatch) -> list:
    calls = []
    real = agent._pump
    monkeypatch.setattr(agent, "_pump", lambda: (calls.append(1), real()))
    return calls


def test_progress_turn_skips_right_after_poll_and_runs_later(kv_agent, monkeypatch):
    calls = _counting(kv_agent, monkeypatch)
    kv_agent.poll()
    assert len(calls) == 1
    kv_agent.progress_turn()  # poll() just ran: the engine is progressing itself
    assert len(calls) == 1
    time.sleep(kv_agent.PUMP_SKIP_S * 3)
    kv_agent.progress_turn()
    assert len(calls) == 2


def test_progress_turn_never_waits_for_the_lock(kv_agent, monkeypatch):
    calls = _counting(kv_agent, monkeypatch)
    time.sleep(kv_agent.PUMP_SKIP_S * 3)
    held, release = threading.Event(), threading.Event()

    def hold():
        with kv_agent._lock:
            held.set()
            release.wait(5)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(5)
    t0 = time.monotonic()
    kv_agent.progress_turn()  # the engine's thread holds the lock (a write in progress): skip, at once
    waited = time.monotonic() - t0
    release.set()
    t.join()
    assert calls == [] and waited < 0.5
    kv_agent.progress_turn()
    assert calls == [1]


def test_progress_turn_comes_sooner_after_a_notification(kv_agent, monkeypatch):
    """A notification just fetched (a peer's next WRITE waits until this side's worker took it): the
    progress thread comes back within PUMP_HEARD_EVERY_S and takes its turn once the engine has not polled
    for that long (within it, the engine's poll did the turn's work); PUMP_HEARD_S later it is back to
    skipping for PUMP_SKIP_S after polls and to its interval."""
    calls = _counting(kv_agent, monkeypatch)
    monkeypatch.setattr(kv_agent, "PUMP_HEARD_S", 0.3)  # (the default is a few ms: too short for a loaded test host)
    real = kv_agent.nixl.notifs
    monkeypatch.setattr(kv_agent.nixl, "notifs", lambda: {"a-peer": [b"not a kvlc notification"]})
    kv_agent.poll()  # fetches one (dropped: no session signs it), and counts as heard
    monkeypatch.setattr(kv_agent.nixl, "notifs", real)
    assert kv_agent.progress_turn() == kv_agent.PUMP_HEARD_EVERY_S
    assert len(calls) == 1  # right after the poll: skipped, the poll just did it
    time.sleep(kv_agent.PUMP_HEARD_EVERY_S * 3)
    assert kv_agent.progress_turn() == kv_agent.PUMP_HEARD_EVERY_S
    assert len(calls) == 2  # a gap between the engine's polls: the turn fills it
    time.sleep(kv_agent.PUMP_HEARD_S + kv_agent.PUMP_SKIP_S * 3)
    kv_agent.poll()
    assert kv_agent.progress_turn() is False and len(calls) == 3  # the poll just ran: skipped


def test_progress_turn_while_busy_fills_only_the_gaps_between_polls(kv_agent, monkeypatch):
    """Work in flight that waits on this side's turns (a same-host copy's end, staged chunks: _hot True):
    the thread comes every PUMP_BUSY_S, but an engine that polled within that long already did the turn's
    work, so the thread skips it (run 12: its turns cost a 4k same-host request 30-50 us of lock and GIL)."""
    calls = _counting(kv_agent, monkeypatch)
    monkeypatch.setattr(kv_agent, "_hot", lambda: True)
    monkeypatch.setattr(kv_agent, "PUMP_BUSY_S", 0.05)  # (the default is 50 us: too short for a loaded test host)
    kv_agent.poll()
    assert kv_agent.progress_turn() is True and len(calls) == 1  # the engine just polled: nothing to fill
    time.sleep(0.15)
    assert kv_agent.progress_turn() is True and len(calls) == 2  # the engine went quiet: the thread takes over


def test_pump_waits_what_its_method_returns():
    """Pump: True waits busy_interval, False the interval, a number that long (at most the interval)."""
    from kvlc.runtime.pump import Pump

    class Turns:
        def __init__(self):
            self.at = []

        def turn(self):
            self.at.append(time.monotonic())
            return 0.002 if len(self.at) < 6 else False

    t, stop = Turns(), threading.Event()
    pump = Pump(t, "turn", 0.2, stop, "test-pump-number")
    time.sleep(0.15)
    stop.set()
    pump.thread.join(5)
    gaps = [b - a for a, b in zip(t.at, t.at[1:])]
    assert len(t.at) == 6 and max(gaps) < 0.1  # five quick turns, then the 0.2 s interval


def test_pump_wake_takes_the_next_turn_now():
    """Pump.wake: the turn comes at once, not an interval later (a transfer started for a peer's request,
    which no engine call follows); a wake during a turn is kept for right after it."""
    from kvlc.runtime.pump import Pump

    class Turns:
        def __init__(self):
            self.at, self.pump = [], None

        def turn(self):
            self.at.append(time.monotonic())
            if len(self.at) == 2:
                self.pump.wake()  # during the second turn: a third follows at once
            return False

    t, stop = Turns(), threading.Event()
    t.pump = pump = Pump(t, "turn", 30.0, stop, "test-pump-wake")
    time.sleep(0.2)
    assert len(t.at) == 1  # the first turn, then the 30 s interval
    woke = time.monotonic()
    pump.wake()
    deadline = time.monotonic() + 5
    while len(t.at) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(t.at) == 3 and t.at[1] - woke < 2 and t.at[2] - t.at[1] < 2
    time.sleep(0.1)
    assert len(t.at) == 3  # then the interval again
    stop.set()
    pump.wake()
    pump.thread.join(5)
    assert not pump.thread.is_alive()


# ------------------------------------------------------------------ post / state
class _Raw:
    """Stands in for nixl_agent: transfer/check_xfer_state return or raise what a test scripts."""

    def __init__(self, result):
        self.result = result

    def _answer(self, *args):
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result

    transfer = check_xfer_state = _answer


def _agent(result) -> Agent:
    a = Agent.__new__(Agent)  # no NIXL: only the wrapper's bookkeeping and status handling
    a._lock, a._live, a._nixl, a.name = threading.RLock(), set(), _Raw(result), "fake"
    return a


@pytest.mark.parametrize("result, state", [("DONE", XferState.DONE), ("PROC", XferState.PROC)])
def test_healthy_states_pass_through(result, state):
    a = _agent(result)
    x = Xfer(a, object(), "WRITE request 'r1' part peer0:VRAM->VRAM")
    assert a.post(x) is state and x.error is None
    assert a.state(x) is state


@pytest.mark.parametrize("result, words", [
    ("ERR", ["NIXL post", "request 'r1'", "failed"]),
    (None, ["post WRITE request 'r1'", "no result"]),
    (RuntimeError("NIXL_ERR_BACKEND remote gone"), ["post WRITE request 'r1'", "NIXL_ERR_BACKEND"]),
    (NixlError("post x", "NIXL_ERR_NOT_FOUND"), ["NIXL_ERR_NOT_FOUND"]),
    ("WEIRD", ["NIXL post WRITE request 'r1'", "failed"]),  # a state NIXL does not define
])
def test_failed_post_names_the_operation(result, words):
    a = _agent(result)
    x = Xfer(a, object(), "WRITE request 'r1' part peer0:VRAM->VRAM")
    assert a.post(x) is XferState.ERR
    assert all(w in x.error for w in words), x.error


def test_failed_check_names_the_operation_and_sticks():
    a = _agent("ERR")
    x = Xfer(a, object(), "READ request 'r2' part peer1:DRAM->DRAM")
    assert a.state(x) is XferState.ERR and "NIXL check READ request 'r2'" in x.error, x.error
    a._nixl.result = "DONE"
    assert a.state(x) is XferState.ERR  # terminal states stick


# ------------------------------------------------------------------ segments
def _segments_reference(kl, kr, full):
    starts = [0] + [i for i in range(1, full) if not (kl[i] == kl[i - 1] + 1 and kr[i] == kr[i - 1] + 1)]
    lens = [b - a for a, b in zip(starts, starts[1:] + [full])]
    return [int(kl[s]) for s in starts], [int(kr[s]) for s in starts], lens


def _steps(small: bool):
    sizes = {"min_size": 1, "max_size": 40} if small else {"min_size": _SMALL + 1, "max_size": 2 * _SMALL + 10}
    return st.lists(st.tuples(st.integers(0, 3), st.booleans()), **sizes)


@settings(max_examples=200, deadline=None)
@given(_steps(small=True), st.integers(0, 1000))
def test_segments_match_the_definition(steps, start):
    """Segments of few ids (the Python path) are the maximal runs that continue on both sides."""
    _check_segments(steps, start)


@settings(max_examples=40, deadline=None)
@given(_steps(small=False), st.integers(0, 1000))
def test_segments_of_many_ids_match_the_definition(steps, start):
    """Segments of more ids than the Python path takes (numpy) are the same maximal runs."""
    _check_segments(steps, start)


def _check_segments(steps, start):
    # ids that mostly continue (the shortcut's case) and sometimes jump, on either side
    kl, kr = [start], [start * 2]
    for jump, which in steps[1:]:
        kl.append(kl[-1] + 1 + (jump if which else 0))
        kr.append(kr[-1] + 1 + (0 if which else jump))
    kl, kr = np.array(kl, dtype=np.int64), np.array(kr, dtype=np.int64)
    ids, lens = _segments(kl, kr, len(kl))
    assert ids.shape == (2, len(lens)) and ids.dtype == np.int64
    assert (ids[0].tolist(), ids[1].tolist(), lens.tolist()) == _segments_reference(kl, kr, len(kl))
    assert lens.dtype == np.int64


# ------------------------------------------------------------------ coalesce
def _rows(rng, n: int, mode: str):
    """n rows whose neighbours continue on both sides, one side, or neither (devices 0 or 1)."""
    length = rng.integers(1, 64, n)
    local = np.cumsum(length) + 4096
    remote = np.cumsum(length) + (1 << 40)
    if mode != "all":
        jumps = rng.random(n) < (0.5 if mode == "some" else 1.0)
        local = local + np.cumsum(jumps * rng.integers(1, 8, n)) * (rng.random(n) < 0.7)
        remote = remote + np.cumsum(jumps * rng.integers(1, 8, n))
    dev = (rng.random(n) < 0.1).astype(np.int64)
    to = lambda a, d: np.stack([a - length, length, d], axis=1).astype(np.uint64)  # noqa: E731
    return to(local, dev), to(remote, np.zeros(n, dtype=np.int64))


@pytest.mark.parametrize("n", [2, 3, 17, _SMALL, _SMALL + 1, 3 * _SMALL])
@pytest.mark.parametrize("mode", ["all", "some", "none"])
def test_coalesce_matches_coalesce_rows(n, mode):
    """rows.coalesce gives coalesce_rows' rows for few rows (Python test) and many (numpy chunks)."""
    for seed in range(5):
        local, remote = _rows(np.random.default_rng(seed), n, mode)
        got, want = coalesce(local, remote), coalesce_rows(local, remote)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), (n, mode, seed)
