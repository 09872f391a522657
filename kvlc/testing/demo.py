"""A loopback demo: a producer process and a consumer process move a workload, every byte checked.

:func:`run_demo` compiles one layout for each engine (by default the same one),
scaled down (:func:`scaled_plan`: pools fit ``max_bytes`` per rank, ratios
kept) and, on CPU, turned into a CPU variant (:func:`cpu_plan`: every storage
in DRAM). The
producer process hosts every producer rank and fills it with content codes;
the consumer process hosts every consumer rank, filled with noise. The consumer
ranks connect (pairing happens there), the workload runs in rounds of requests
with disjoint destination blocks, and after each round every consumer rank's
memory is compared with what the content codes say it must hold — requested
bytes equal, every other byte unchanged.

>>> plan = cpu_plan(DEFAULT_LAYOUT, max_bytes=8 << 20)
>>> plan.mem_types, plan.regions[0].num_blocks
(('DRAM',), 4)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from kvlc.compiler import compile_spec
from kvlc.compiler.plan import Plan
from kvlc.errors import KvlcError

Progress = Callable[[int, int, int, float], None]  # (requests done, total, bytes so far, seconds so far)
MODES = ("pull", "push", "pull_via_push")
# The default layout: the repository's layouts/ folder next to the package (a source checkout).
DEFAULT_LAYOUT = Path(__file__).resolve().parents[2] / "layouts" / "llama-3.1-8b.yaml"
MAX_TOKENS = 1 << 24


class DemoError(KvlcError):
    """A demo option or workload that cannot run (says which option and what would)."""


def _rewrite(node, factor: int, multiple: int, to_dram: bool):
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k == "storages":
                out[k] = [_storage(e, to_dram) for e in v]
            elif k == "num_blocks" and isinstance(v, int):
                out[k] = max(multiple, (v // factor) // multiple * multiple)
            else:
                out[k] = _rewrite(v, factor, multiple, to_dram)
        return out
    if isinstance(node, list):
        return [_rewrite(v, factor, multiple, to_dram) for v in node]
    return node


def _storage(entry, to_dram: bool):
    if "repeat" in entry:
        return dict(entry, storages=[_storage(e, to_dram) for e in entry["storages"]])
    drop = ("size", "align") + (("device",) if to_dram else ())
    entry = {k: v for k, v in entry.items() if k not in drop}
    if to_dram:
        entry["mem"] = "DRAM"
    return entry


def scaled_plan(spec: str | Path, max_bytes: int = 32 << 20, *, to_dram: bool = True) -> Plan:
    """Compile a plain YAML spec with its pools scaled to about ``max_bytes`` per rank.

    Block counts are divided by one factor (at least one logical block each), so pools keep their
    ratios; explicit storage sizes and alignments are dropped (sized and placed from the regions).
    ``to_dram`` puts every storage in DRAM (a CPU variant). Layouts, groups and block sizes are
    untouched, so two scaled plans pair exactly as the originals do. Pools of per-request state
    (one block each at least) may keep a plan above ``max_bytes``.
    """
    if not isinstance(max_bytes, int) or max_bytes < 1 << 16:
        raise DemoError(f"pool size {max_bytes!r} bytes: give at least 64 KiB per rank (e.g. --pool-mib 1)")
    full = compile_spec(spec)
    total = sum(s.size for s in full.storages)
    factor = max(1, math.ceil(total / max_bytes))
    multiple = max(g.kernel_blocks_per_block for g in full.groups)
    if factor == 1 and (not to_dram or full.mem_types == ("DRAM",)):
        return full
    data = _rewrite(yaml.safe_load(Path(spec).read_text()), factor, multiple, to_dram)
    data["name"] = f"{data['name']}-{'cpu' if to_dram else 'small'}"
    return compile_spec(yaml.safe_dump(data, sort_keys=False))


def cpu_plan(spec: str | Path, max_bytes: int = 32 << 20) -> Plan:
    """:func:`scaled_plan` with every storage in DRAM: what the CPU demo and tests run."""
    return scaled_plan(spec, max_bytes, to_dram=True)


@dataclass
class DemoResult:
    """What a demo run did and measured."""

    mode: str
    requests: int
    nbytes: int
    seconds: float
    descriptors: int
    checked_bytes: int
    mismatches: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    startup_seconds: float = 0.0   # compiling, pairing, starting and connecting the engines
    verify_seconds: float = 0.0    # dumping memory and comparing every byte
    verified_requests: int = 0     # requests whose destination bytes were all compared
    rounds: int = 0
    verified_rounds: int = 0

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds else 0.0

    @property
    def descriptors_per_request(self) -> float:
        return self.descriptors / self.requests if self.requests else 0.0

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.failed


def _capacities(plan: Plan) -> dict[str, int]:
    return {g.name: plan.group_capacity(g.name) for g in plan.groups
            if any(g.name in r.groups for r in plan.regions)}


def default_tokens(consumer: Plan, producer: Plan, limit: int = 128) -> int:
    """Tokens per request so that at least two requests fit each consumer pool (at most ``limit``)."""
    cap_c, cap_p = _capacities(consumer), _capacities(producer)
    best = limit
    for g in consumer.groups:
        if g.is_state or g.name not in cap_p:
            continue
        best = min(
            best, max(1, cap_c[g.name] // 2) * g.block_size, cap_p[g.name] * producer.group(g.name).block_size
        )
    return max(1, best)


def max_fit(consumer: Plan, producer: Plan, group: str) -> int:
    """The most tokens one request of ``group`` can carry in both pools."""
    cap_c, cap_p = _capacities(consumer), _capacities(producer)
    return min(cap_c[group] * consumer.group(group).block_size, cap_p[group] * producer.group(group).block_size)


def check_pair(consumer: Plan, producer: Plan) -> None:
    """Pair every consumer rank with the producer before any engine starts (``CompatError`` with the report)."""
    from kvlc.compiler.pair import pair

    for r in range(consumer.parallel.tp_size):
        pair(consumer, producer, local_rank=r, direction="READ")


def make_workload(consumer: Plan, producer: Plan, requests: int, tokens: int | None = None, seed: int = 0,
                  ids: str = "random"):
    """Rounds of requests: (id, consumer ids, producer ids, tokens); destinations disjoint within a round.

    ``ids``: producer block ids drawn at ``"random"`` (a fragmented pool), or ``"contiguous"``
    runs on both sides (a fresh pool; descriptors coalesce across blocks).
    """
    if ids not in ("random", "contiguous"):
        raise DemoError(f"ids {ids!r}: use random or contiguous")
    if isinstance(requests, bool) or not isinstance(requests, int) or requests < 1:
        raise DemoError(f"requests {requests!r}: give a whole number of requests, at least 1")
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= MAX_TOKENS):
        raise DemoError(f"tokens {tokens!r}: give a whole number of tokens per request, 1 to {MAX_TOKENS}")
    rng = np.random.default_rng(seed)
    groups = [g.name for g in consumer.groups if g.name in {x.name for x in producer.groups}]
    cap_c, cap_p = _capacities(consumer), _capacities(producer)
    tokens = default_tokens(consumer, producer) if tokens is None else tokens
    need_c = {g: consumer.blocks_for(g, tokens) for g in groups}
    need_p = {g: producer.blocks_for(g, tokens) for g in groups}
    for g in groups:
        if need_c[g] > cap_c[g] or need_p[g] > cap_p[g]:
            raise DemoError(
                f"--tokens {tokens}: group '{g}': {tokens} tokens need {need_c[g]} consumer / {need_p[g]} producer blocks; "
                f"the pools hold {cap_c[g]} / {cap_p[g]}: use at most {max_fit(consumer, producer, g)} tokens or a larger pool (--pool-mib)"
            )
    per_round = max(1, min(cap_c[g] // need_c[g] for g in groups))
    if ids == "contiguous":
        per_round = max(1, min(per_round, *(cap_p[g] // need_p[g] for g in groups)))
    rounds, i = [], 0
    while i < requests:
        batch = []
        for j in range(min(per_round, requests - i)):
            cids = {g: list(range(j * need_c[g], (j + 1) * need_c[g])) for g in groups}
            if ids == "contiguous":
                pids = {g: list(range(j * need_p[g], (j + 1) * need_p[g])) for g in groups}
            else:
                pids = {g: rng.choice(cap_p[g], need_p[g], replace=False).tolist() for g in groups}
            batch.append((f"req-{i + j}", cids, pids, tokens))
        rounds.append(batch)
        i += len(batch)
    return rounds


def verify(
    consumer: Plan,
    rank: int,
    producer: Plan,
    before: Mapping[str, np.ndarray],
    after: Mapping[str, np.ndarray],
    batch,
) -> tuple[int, list[str]]:
    """Compare one consumer rank's memory with the content codes of a round's requests."""
    from kvlc.testing.content import expected_bytes, request_tokens

    touched = {k: np.zeros(len(v), bool) for k, v in after.items()}
    checked, problems = 0, []
    for req, cids, pids, tokens in batch:
        for storage, idx, vals in expected_bytes(consumer, rank, producer, cids, pids, **request_tokens(tokens)):
            bad = np.flatnonzero(after[storage][idx] != vals)
            if bad.size:
                problems.append(
                    f"{req}: rank {rank} storage {storage}: {bad.size} wrong bytes, first at byte "
                    f"{int(idx[bad[0]])}"
                )
            touched[storage][idx] = True
            checked += idx.size
    for name, t in touched.items():
        changed = np.flatnonzero((after[name] != before[name]) & ~t)
        if changed.size:
            problems.append(
                f"rank {rank} storage {name}: {changed.size} bytes outside the requested blocks "
                f"changed, first at byte {int(changed[0])}"
            )
    return checked, problems


def run_demo(
    layout: str | Path,
    consumer_layout: str | Path | None = None,
    *,
    mode: str = "pull",
    requests: int = 32,
    tokens: int | None = None,
    max_bytes: int = 8 << 20,
    seed: int = 0,
    progress: Progress | None = None,
    timeout: float = 60.0,
    device: str = "cpu",
    check: str = "all",
    progress_mode: str = "thread",
    fill: str = "content",
    ids: str = "random",
    descriptors: str = "rows",
) -> DemoResult:
    """Run the loopback demo; see the module docstring. ``mode``: pull | push | pull_via_push.

    ``tokens`` per request defaults to what lets two requests share the smallest consumer pool.
    ``progress(done, total, bytes, seconds)`` is called after every round. ``device="cpu"`` runs the
    CPU variant of the layouts; ``"gpu"`` keeps their memory types (VRAM on its cuda device, DRAM
    on the host). ``check``: ``"all"`` rounds, the ``"first"`` round only, or ``"none"`` (bytes are
    checked on every consumer rank; the result says what failed or mismatched: ``result.ok``).
    ``progress_mode`` is every agent's ``progress`` (see :class:`~kvlc.runtime.agent.KvAgent`).
    ``fill``: how the producer fills its cache, ``"content"`` (codes; needed for any check) or
    ``"random"`` / ``"zeros"`` (fast, for throughput runs with ``check="none"``). ``ids``: see
    :func:`make_workload`. ``descriptors``: ``"rows"`` builds (N, 3) rows per request;
    ``"prepped"`` prepares strided lists once per connection and sends indices (pull and push).
    """
    import secrets

    from kvlc.testing.procs import EngineConfig, EngineProcess

    for what, value, choices in (("mode", mode, MODES), ("check", check, ("all", "first", "none")),
                                 ("descriptors", descriptors, ("rows", "prepped")),
                                 ("fill", fill, ("content", "random", "zeros")), ("device", device, ("cpu", "gpu"))):
        if value not in choices:
            raise DemoError(f"{what} {value!r}: use one of {', '.join(choices)}")
    direct = "prepped" if descriptors == "prepped" else "direct"
    if fill != "content" and check != "none":
        raise DemoError("checking bytes needs fill='content'")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise DemoError(f"timeout {timeout!r}: give seconds, more than 0")
    t_start = time.perf_counter()
    to_dram = device == "cpu"
    prod_plan = scaled_plan(layout, max_bytes, to_dram=to_dram)
    cons_plan = scaled_plan(consumer_layout, max_bytes, to_dram=to_dram) if consumer_layout else prod_plan
    check_pair(cons_plan, prod_plan)  # an incompatible pair fails here, before any engine starts
    rounds = make_workload(cons_plan, prod_plan, requests, tokens, seed, ids)
    secret = secrets.token_hex(32)  # this run's side-channel secret, shared by its engines only

    def cfg(plan, rank, fill_, seed_, engine):
        return EngineConfig(
            plan.to_json(),
            rank,
            fill=fill_,
            seed=seed_,
            timeout=timeout,
            progress=progress_mode,
            pin=not to_dram,
            secret=secret,
            engine_id=engine,
        )

    pproc, cproc = EngineProcess(), EngineProcess()
    try:
        prods = [pproc.add_async(cfg(prod_plan, r, fill, 0, "demo-producer")) for r in range(prod_plan.parallel.tp_size)]
        cons = [
            cproc.add_async(cfg(cons_plan, r, "random", seed + r, "demo-consumer")) for r in range(cons_plan.parallel.tp_size)
        ]
        for h in prods + cons:
            h.ready()
        addrs_p = [h.address for h in prods]
        addrs_c = [h.address for h in cons]
        if mode == "push":
            initiators, proc, method = prods, pproc, "write"
            links = [h.connect(addrs_c, "WRITE", direct) for h in prods]
        else:
            initiators, proc, method = cons, cproc, "read"
            links = [
                h.connect(addrs_p, "READ", direct if mode == "pull" else "pull_via_push") for h in cons
            ]
        active = [h for h, link in zip(initiators, links) if link["peer_ranks"]]
        movers = prods if mode in ("push", "pull_via_push") else cons
        result = DemoResult(mode, 0, 0, 0.0, 0, 0, rounds=len(rounds))
        stats0 = {id(h): h.call("stats") for h in movers}
        result.startup_seconds = time.perf_counter() - t_start
        for i, batch in enumerate(rounds):
            verify_now = check == "all" or (check == "first" and i == 0)
            t_v = time.perf_counter()
            before = [h.call("dump") for h in cons] if verify_now else None
            result.verify_seconds += time.perf_counter() - t_v
            reqs = [(r, p, c, n) for r, c, p, n in batch] if mode == "push" else batch
            out = proc.call("batch", -1, [(h.aid, "default", method, reqs) for h in active], timeout)
            ids = [b[0] for b in batch]
            for h in cons:  # every consumer rank: every request landed (push: notified)
                got = h.call("wait", ids, timeout)
                result.failed.update(got["failed"])
                result.failed.update({r: "still open" for r in got["open"]})
            for a in out["agents"].values():
                result.failed.update(a["failed"])
                result.failed.update(a["errors"])
            result.seconds += out["seconds"]
            if verify_now:
                t_v = time.perf_counter()
                for h, b in zip(cons, before):
                    checked, problems = verify(cons_plan, h.config.rank, prod_plan, b, h.call("dump"), batch)
                    result.checked_bytes += checked
                    result.mismatches.extend(problems)
                result.verify_seconds += time.perf_counter() - t_v
                result.verified_requests += len(batch)
                result.verified_rounds += 1
            result.requests += len(batch)
            stats = {id(h): h.call("stats") for h in movers}
            result.nbytes = sum(stats[k]["bytes"] - stats0[k]["bytes"] for k in stats)
            result.descriptors = sum(stats[k]["descriptors"] - stats0[k]["descriptors"] for k in stats)
            if progress:
                progress(result.requests, requests, result.nbytes, result.seconds)
        return result
    finally:
        for p in (cproc, pproc):
            p.stop()
