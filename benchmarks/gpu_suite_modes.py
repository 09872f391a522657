"""The GPU suite's modes (benchmarks/gpu_suite.py): torch ceilings, raw NIXL, kvlc; one group at a time.

Each runner takes a prepared :class:`gpu_suite_cases.Group` and returns ``(rows, checks)``: one row
per case (latency p50/p99 in µs and GB/s at p50 for one request at a time; median round GB/s for
rounds in flight; first-round and overall GB/s where every round counts) and the content checks
it made. Processes: raw NIXL runs in a fresh ``testkit.staging_pair.Pair`` (two spawned processes,
so ``NIXL_UCX_SGL_ENABLE`` reaches both before NIXL loads); kvlc's initiating KvAgent runs in this
process and the other side in a spawned ``kvlc.demo.procs.EngineProcess`` that inherits
``KVLC_IPC``; the torch ceilings run here.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import secrets
import statistics
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE / "probes"))

from profile_push import wait_finished  # noqa: E402

TIMEOUT = 60.0  # seconds per request or round


# ----------------------------------------------------------------------------- shared
def stats_row(c, seconds: list[float]) -> dict:
    """A case's numbers from its timed units (``seconds`` per batch of ``c.batches()``, warm-ups included)."""
    if c.kind == "handover":
        lat = np.array(seconds[c.warm:]) * 1e6
        p50 = float(np.median(lat))
        return {"p50_us": p50, "p99_us": float(np.percentile(lat, 99)), "gbps": c.nbytes / p50 / 1e3,
                "requests_timed": len(lat), "latencies_us": [round(float(x), 1) for x in lat]}
    nbytes = c.nbytes * c.inflight
    if c.kind == "bulk":
        timed = seconds[1:]
        return {"gbps": nbytes / statistics.median(timed) / 1e9, "gbps_best": nbytes / min(timed) / 1e9,
                "rounds": len(timed), "in_flight": c.inflight}
    return {"gbps": nbytes * len(seconds) / sum(seconds) / 1e9, "gbps_first_round": nbytes / seconds[0] / 1e9,
            "gbps_rest": nbytes * (len(seconds) - 1) / sum(seconds[1:]) / 1e9 if len(seconds) > 1 else None,
            "rounds": len(seconds), "round_seconds": [round(s, 6) for s in seconds]}


def guarded(rows: list, c, mode: str, fn) -> None:
    """Run one case of a mode; an error is its row's (the suite goes on)."""
    t0 = time.time()
    base = {"case": c.name, "kind": c.kind, "mode": mode, "ids": c.ids, "tokens": c.tokens,
            "direction": c.direction, "bytes_per_request": c.nbytes, "descriptors_per_request": c.descriptors,
            "batched": c.batched}
    try:
        row = {**base, **fn()}
    except Exception as exc:
        row = {**base, "error": f"{type(exc).__name__}: {exc}"[:600],
               "traceback": traceback.format_exc()[-2000:]}
    row["wall_s"] = round(time.time() - t0, 2)
    rows.append(row)
    _say(row)


def _say(row: dict) -> None:
    keys = ("p50_us", "p99_us", "gbps", "gbps_first_round", "check", "ipc", "error")
    got = ", ".join(f"{k}={row[k]:.1f}" if isinstance(row.get(k), float) else f"{k}={row[k]}"
                    for k in keys if row.get(k) is not None)
    print(f"  [{row['mode']}] {row['case']}: {got} ({row['wall_s']} s)", flush=True)


@contextmanager
def environ(values: dict):
    """``os.environ`` with ``values`` set (spawned processes inherit it), restored after."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ----------------------------------------------------------------------------- (a) torch ceilings
def ceiling_rows(g, gpu: bool) -> tuple[list, list]:
    """Per push case: one contiguous copy of a request's bytes (device to device; pinned host to device
    for the mixed group) and, for VRAM, the same scattered rows gathered and scattered by torch."""
    import torch

    rows: list = []
    dev = "cuda:0" if gpu else "cpu"
    for c in g.cases:
        if c.direction != "push" or c.batched:  # the same bytes as the push (in flight) case of its size
            continue
        if g.mixed:
            guarded(rows, c, "h2d copy", lambda: _copy_case(c, torch, "cpu", dev, pin=gpu))
            continue
        guarded(rows, c, "d2d copy", lambda: _copy_case(c, torch, dev, dev))
        guarded(rows, c, "d2d gather+scatter", lambda: _scatter_case(g, c, torch, dev))
        if gpu:
            torch.cuda.empty_cache()
    return rows, []


def _sync(torch) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _copy_case(c, torch, src_dev: str, dst_dev: str, pin: bool = False) -> dict:
    src = torch.zeros(c.nbytes, dtype=torch.uint8, device=src_dev)
    src = src.pin_memory() if pin else src
    dst = torch.zeros(c.nbytes, dtype=torch.uint8, device=dst_dev)

    def once():
        dst.copy_(src, non_blocking=True)
        _sync(torch)
    return stats_row(c, [_timed(once, len(b)) for b in c.batches()])


def _timed(fn, times: int = 1) -> float:
    t0 = time.perf_counter()
    for _ in range(times):
        fn()
    return time.perf_counter() - t0


def _scatter_case(g, c, torch, dev: str) -> dict:
    """``index_select`` into a bounce buffer + ``index_copy_`` out of it, on row views of the storages laid
    end to end: each row snapped to its length's slot (within one row of its true address), one pair of
    calls per distinct row length."""
    src = _flat(g.plans[0], torch, dev)
    dst = _flat(g.plans[1], torch, dev)
    ops = [_scatter_ops(rs, src, dst, torch, dev) for rs in c.ranges]
    most = {}  # row length -> the most rows of that length one request gathers
    for op in ops:
        for o in op:
            most[o[0]] = max(most.get(o[0], 0), len(o[2]))
    bounce = {L: torch.empty((n, L // 8), dtype=torch.int64, device=dev) for L, n in most.items()}

    def once(op):
        for L, s2, i_s, d2, i_d in op:
            buf = bounce[L][:len(i_s)]
            torch.index_select(s2, 0, i_s, out=buf)
            d2.index_copy_(0, i_d, buf)
        _sync(torch)
    seconds = [sum(_timed(lambda: once(ops[i])) for i in b) for b in c.batches()]
    return dict(stats_row(c, seconds), row_lengths=sorted(bounce))


def _flat(plan, torch, dev: str):
    """(tensor, base of each storage): every storage of ``plan`` end to end, 2 MiB aligned."""
    bases, at = [], 0
    for s in plan.storages:
        bases.append(at)
        at += -(-s.size // (2 << 20)) * (2 << 20)
    return torch.zeros(at, dtype=torch.uint8, device=dev), np.array(bases, dtype=np.int64)


def _scatter_ops(ranges: list, src, dst, torch, dev: str) -> list:
    out = []
    for r in ranges:
        s_at, d_at = src[1][r.src[:, 0]] + r.src[:, 1], dst[1][r.dst[:, 0]] + r.dst[:, 1]
        for L in np.unique(r.src[:, 2]):
            if L % 8:
                raise RuntimeError(f"a row of {L} bytes: not a whole number of int64")
            m = r.src[:, 2] == L
            out.append((int(L), _rows_view(src[0], L, torch), torch.from_numpy(s_at[m] // L).to(dev),
                        _rows_view(dst[0], L, torch), torch.from_numpy(d_at[m] // L).to(dev)))
    return out


def _rows_view(flat, L: int, torch):
    n = flat.numel() // L
    return flat[:n * L].view(torch.int64).view(n, L // 8)


# ----------------------------------------------------------------------------- (b) raw NIXL
def raw_rows(g, gpu: bool, env: dict, mode: str) -> tuple[list, list]:
    """Raw NIXL WRITEs of the rows kvlc posts (pull via push: not a raw operation, left out), in a fresh
    pair of processes under ``env``; the content check first, on the small plans."""
    from testkit.staging_pair import Pair

    rows, checks = [], []
    with environ(env):
        pair = None if g.separate_check else Pair(*_sides(g.check_plans, gpu, fill=True))
        try:
            checks.append(_raw_check(g, gpu, mode, pair))
            if pair is None:
                pair = Pair(*_sides(g.plans, gpu, fill=False))
            pair.raw("WRITE", g.cases[0].ranges[0], reps=1, single=False)  # first use of the peer's memory
            for c in g.cases:
                if c.direction != "push" or c.batched:  # (raw NIXL has no batches: the in-flight case is it)
                    continue
                guarded(rows, c, mode, lambda: dict(_raw_case(pair, c), check=checks[0]["verdict"]))
        finally:
            if pair is not None:
                pair.stop()
    return rows, checks


def _sides(plans, gpu: bool, fill: bool):
    from testkit.staging_pair import Side

    return tuple(Side(tuple(s.size for s in p.storages), mem=tuple(s.mem for s in p.storages),
                      device=0 if gpu else None, fill=fill) for p in plans)


def _raw_check(g, gpu: bool, mode: str, pair) -> dict:
    """Content codes through raw NIXL: every destination byte and every byte around it (``Pair.check``)."""
    from testkit.staging_pair import Pair

    own = pair is None
    pair = Pair(*_sides(g.check_plans, gpu, fill=True)) if own else pair
    try:
        pair.raw("WRITE", g.check_ranges, reps=1, single=False)
        got = pair.check(g.check_ranges)
        bad = got["mismatches"]
        return _check_entry(g, mode, "push", not bad, got["checked_bytes"], bad[:3])
    except Exception as exc:
        return _check_entry(g, mode, "push", False, 0, [f"{type(exc).__name__}: {exc}"[:400]])
    finally:
        if own:
            pair.stop()


def _check_entry(g, mode: str, direction: str, ok: bool, checked: int, problems: list, **more) -> dict:
    return {"group": g.name, "mode": mode, "direction": direction, "verdict": "pass" if ok else "FAIL",
            "tokens": g.check_tokens, "checked_bytes": int(checked), "problems": problems, **more}


def _raw_case(pair, c) -> dict:
    if c.kind == "handover":
        if any(len(rs) != 1 for rs in c.ranges):
            raise RuntimeError("one at a time: a request of several NIXL parts")
        got = pair.raw("WRITE", [rs[0] for rs in c.ranges], reps=1, single=False, serial=True)
        return stats_row(c, got["each"])
    seconds = []
    for b in c.batches():  # a round: its requests' parts created and posted in flight, then waited for
        got = pair.raw("WRITE", [r for i in b for r in c.ranges[i]], reps=1, single=False, inflight=True)
        seconds.append(got["seconds"])
    return stats_row(c, seconds)


# ----------------------------------------------------------------------------- (c, d) kvlc
def kvlc_rows(g, gpu: bool, ipc: str, mode: str) -> tuple[list, list]:
    """kvlc under ``KVLC_IPC=ipc``: this process's KvAgent initiates, a spawned engine process hosts the
    other side; content checks first (push, and pull via push where the group has it), then every case."""
    rows: list = []
    with environ({"KVLC_IPC": ipc}):
        k = _Kvlc(g, gpu)
        try:
            checks = k.checks(mode)
            verdict = {c["direction"]: c["verdict"] for c in checks}
            for c in g.cases:
                guarded(rows, c, mode, lambda: dict(k.case(c, mode), check=verdict.get(c.direction, "-")))
        finally:
            k.close()
    return rows, checks


def _supports(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


class _Kvlc:
    """The agents of one group and mode: here ``big`` (timed) and ``chk`` (content checks; ``big`` when the
    pools are small), in the child the same on the consumer side plus ``src`` (content codes: the producer
    a pull via push check reads from)."""

    def __init__(self, g, gpu: bool):
        from kvlc.demo.procs import EngineConfig, EngineProcess

        self.g, self.gpu = g, gpu
        self.secret = secrets.token_hex(32)
        self.shared = not gpu and "shared" in {f.name for f in dataclasses.fields(EngineConfig)}
        self.proc = EngineProcess()
        self.locals: list = []
        self.tensors: dict = {}  # id(local agent) -> its storages' tensors
        self.peers: list = []
        try:
            self._start(EngineConfig)
        except BaseException:
            self.close()
            raise

    def _start(self, EngineConfig) -> None:
        g = self.g
        more = {"shared": True} if self.shared else {}
        cfg = {"secret": self.secret, "pin": self.gpu, **more}
        def add(plan, fill: str, engine: str):
            return self.proc.add_async(EngineConfig(plan.to_json(), 0, fill=fill, engine_id=engine, **cfg))
        self.c_big = add(g.plans[1], "zeros", "suite-c-big")
        self.c_chk = add(g.check_plans[1], "zeros", "suite-c-chk") if g.separate_check else None
        self.src = add(g.check_plans[0], "content", "suite-p-chk") if g.has("pull_via_push") else None
        self.l_big = self._local(g.plans[0], "suite-l-big")
        self.l_chk = self._local(g.check_plans[0], "suite-l-chk") if g.separate_check else self.l_big
        for h in (self.c_big, self.c_chk, self.src):
            if h is not None:
                h.ready(180.0)
        self.c_chk = self.c_chk or self.c_big

    def _local(self, plan, engine: str):
        from kvlc.runtime.agent import KvAgent
        from kvlc.runtime.binding import allocate
        from kvlc.runtime.settings import AgentSettings

        more = {"shared": True} if self.shared and _supports(allocate, "shared") else {}
        tensors = allocate(plan, pin=self.gpu, **more)
        agent = KvAgent(plan, 0, tensors, AgentSettings(secret=self.secret, engine_id=engine))
        self.locals.append(agent)
        self.tensors[id(agent)] = tensors
        return agent

    def connect(self, agent, handle, direction: str, mode: str = "direct"):
        peer = agent.connect(handle.address, direction=direction, mode=mode)
        self.peers.append(peer)
        return peer

    def close(self) -> None:
        for x in self.peers + self.locals:
            try:
                x.close()
            except Exception:
                pass
        self.proc.stop()

    # ---- content checks
    def checks(self, mode: str) -> list[dict]:
        out = []
        if self.src is not None:  # first: the local check agent is still all zeros
            out.append(self._guard_check(mode, "pull_via_push", self._check_pull_via_push))
        out.append(self._guard_check(mode, "push", self._check_push))
        return out

    def _guard_check(self, mode: str, direction: str, fn) -> dict:
        t0 = time.time()
        try:
            ok, checked, problems, counts = fn()
            entry = _check_entry(self.g, mode, direction, ok, checked, problems[:3], **counts)
        except Exception as exc:
            entry = _check_entry(self.g, mode, direction, False, 0, [f"{type(exc).__name__}: {exc}"[:400]],
                                 traceback=traceback.format_exc()[-2000:])
        entry["wall_s"] = round(time.time() - t0, 2)
        print(f"  [{mode}] check {self.g.name} {direction}: {entry['verdict']} ({entry['checked_bytes']:,} "
              f"bytes; {entry['problems'][:1]}; ipc {entry.get('ipc')}, by block ids "
              f"{entry.get('ipc_block_copies', '-')}, on the copy engines {entry.get('ipc_engine_copies', '-')}; "
              f"{entry['tokens']} tokens)", flush=True)
        return entry

    def _check_push(self):
        from kvlc.demo.procs_child import _fill
        from kvlc.demo.workload import verify

        prod, cons = self.g.check_plans
        _fill(prod, 0, self.tensors[id(self.l_chk)], "content", 0)
        rid, cids, pids, n = self.g.check_request
        peer = self.connect(self.l_chk, self.c_chk, "WRITE")
        before, moved0 = ipc_count(self.l_chk.stats), _paths(self.l_chk.stats)
        peer.write(f"check-{rid}", pids, cids, n)
        wait_finished(self.l_chk, {f"check-{rid}"}, TIMEOUT)
        counts = {"ipc": ipc_delta(before, self.l_chk.stats),  # parts by the same-host copy; of them by block ids...
                  **_paths(self.l_chk.stats, moved0)}
        after = self.c_chk.call("dump")
        zeros = {k: np.zeros_like(v) for k, v in after.items()}
        checked, problems = verify(cons, 0, prod, zeros, after, [(rid, cids, pids, n)])
        return not problems and checked > 0, checked, problems, counts

    def _check_pull_via_push(self):
        from kvlc.demo.workload import verify

        prod, cons = self.g.check_plans
        rid, cids, pids, n = self.g.check_request
        peer = self.connect(self.l_chk, self.src, "READ", "pull_via_push")
        stats = self.src.call("stats")
        before, moved0 = ipc_count(stats), _paths(stats)
        peer.read(f"check-pv-{rid}", cids, pids, n)
        wait_finished(self.l_chk, {f"check-pv-{rid}"}, TIMEOUT)
        stats = self.src.call("stats")  # the producer's: it made the copies
        counts = {"ipc": ipc_delta(before, stats), **_paths(stats, moved0)}
        after = {k: t.cpu().numpy().copy() for k, t in self.tensors[id(self.l_chk)].items()}
        zeros = {k: np.zeros_like(v) for k, v in after.items()}
        checked, problems = verify(cons, 0, prod, zeros, after, [(rid, cids, pids, n)])
        return not problems and checked > 0, checked, problems, counts

    # ---- timed cases
    def case(self, c, mode: str) -> dict:
        pv = c.direction == "pull_via_push"
        if not hasattr(self, "_w"):
            self._w = self.connect(self.l_big, self.c_big, "WRITE")
        if pv and not hasattr(self, "_r"):
            self._r = self.connect(self.l_big, self.c_big, "READ", "pull_via_push")
        counter = (lambda: self.c_big.call("stats")) if pv else (lambda: self.l_big.stats)
        before = ipc_count(counter())
        moved0 = _paths(counter())
        bytes0, desc0 = self.l_big.stats["bytes"], self.l_big.stats["descriptors"]
        tag = f"{mode.replace(' ', '-')}-c{self.g.cases.index(c)}"
        seconds = [self._unit(c, b, tag, pv) for b in c.batches()]
        out = stats_row(c, seconds)
        out["ipc"] = ipc_delta(before, counter())
        out.update(_paths(counter(), moved0))  # parts copied by their block ids, on the copy engines
        if not pv:
            moved = len(c.requests)
            out["kvlc_descriptors_per_request"] = (self.l_big.stats["descriptors"] - desc0) / moved
            out["kvlc_bytes_per_request"] = (self.l_big.stats["bytes"] - bytes0) / moved
        return out

    def _unit(self, c, batch: list[int], tag: str, pv: bool) -> float:
        """Hand one request (or one round) over and wait until the initiator sees every one done."""
        ids = set()
        t0 = time.perf_counter()
        if c.batched:  # one write_many of the round's requests
            from kvlc.runtime import BlockRequest

            ids.update(f"{tag}-{i}" for i in batch)
            self._w.write_many([BlockRequest(f"{tag}-{i}", c.requests[i][2], c.requests[i][1], c.requests[i][3])
                                for i in batch])
        else:
            for i in batch:
                rid, cids, pids, n = c.requests[i]
                ids.add(f"{tag}-{i}")
                if pv:
                    self._r.read(f"{tag}-{i}", cids, pids, n)
                else:
                    self._w.write(f"{tag}-{i}", pids, cids, n)
        wait_finished(self.l_big, ids, TIMEOUT, nap=0.0 if self.gpu else 0.0002)
        return time.perf_counter() - t0


def ipc_count(stats: dict) -> int | None:
    """The agent's same-host copy counter (None: this kvlc has none)."""
    v = stats.get("ipc_requests")
    return None if v is None else int(v)


def _paths(stats: dict, since: dict | None = None) -> dict:
    """The same-host copy's parts by path (block ids, copy engines) in an agent's stats, less ``since``'s."""
    keys = ("ipc_block_copies", "ipc_engine_copies")
    return {k: stats.get(k, 0) - (since or {}).get(k, 0) for k in keys}


def ipc_delta(before: int | None, stats: dict) -> str | int:
    after = ipc_count(stats)
    return "not available" if before is None or after is None else after - before
