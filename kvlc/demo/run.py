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
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import yaml

from kvlc.compiler import compile_spec
from kvlc.compiler.plan.model import Plan
from kvlc.demo.workload import (  # noqa: F401  (re-exported: the demo's public names)
    MAX_TOKENS,
    DemoError,
    check_pair,
    default_tokens,
    make_workload,
    max_fit,
    verify,
)

Progress = Callable[[int, int, int, float], None]  # (requests done, total, bytes so far, seconds so far)
MODES = ("pull", "push", "pull_via_push")
# The default layout: the repository's layouts/ folder next to the package (a source checkout).
DEFAULT_LAYOUT = Path(__file__).resolve().parents[2] / "layouts" / "llama-3.1-8b.yaml"


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
    round_seconds: list[float] = field(default_factory=list)  # each round's timed seconds, in order
    staged_chunks: int = 0         # chunks the movers sent through bounce buffers (kvlc.runtime.staging.endpoint)
    direct_chunks: int = 0         # of those, chunks written from their source ranges, not gathered
    copied_requests: int = 0       # requests moved by same-host copies (kvlc.runtime.ipc), not NIXL

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds else 0.0

    @property
    def descriptors_per_request(self) -> float:
        return self.descriptors / self.requests if self.requests else 0.0

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.failed


def run_demo(layout: str | Path, consumer_layout: str | Path | None = None, *, mode: str = "pull",
             requests: int = 32, tokens: int | None = None, max_bytes: int = 8 << 20, seed: int = 0,
             progress: Progress | None = None, timeout: float = 60.0, device: str = "cpu", check: str = "all",
             progress_mode: str = "thread", fill: str = "content", ids: str = "random",
             descriptors: str = "rows", batch: int = 1, start_timeout: float = 120.0) -> DemoResult:
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
    ``batch``: requests per :meth:`~kvlc.runtime.peer.Peer.write_many` / ``read_many`` call (1:
    one :meth:`~kvlc.runtime.peer.Peer.write` / ``read`` per request). ``timeout``: seconds per
    request; ``start_timeout``: seconds for the engines to start and connect. Either running out is
    a :class:`DemoError` that names the setting to raise (a busy machine), not a traceback.
    """
    import secrets

    from kvlc.demo.procs import EngineProcess

    _check_options(mode=mode, check=check, descriptors=descriptors, fill=fill, device=device, timeout=timeout,
                   batch=batch)
    if not (isinstance(start_timeout, (int, float)) and start_timeout > 0):
        raise DemoError(f"start_timeout {start_timeout!r}: give seconds, more than 0")
    t_start = time.perf_counter()
    to_dram = device == "cpu"
    prod_plan, cons_plan = _plans(layout, consumer_layout, max_bytes, to_dram)
    check_pair(cons_plan, prod_plan)  # an incompatible pair fails here, before any engine starts
    rounds = make_workload(cons_plan, prod_plan, requests, tokens, seed, ids)
    # this run's side-channel secret, shared by its engines only
    cfg = partial(_config, timeout=timeout, progress=progress_mode, pin=not to_dram, secret=secrets.token_hex(32))
    pproc, cproc = EngineProcess(), EngineProcess()
    try:
        try:
            engines = _start(pproc, cproc, (prod_plan, cons_plan), cfg, fill=fill, seed=seed, mode=mode,
                             direct="prepped" if descriptors == "prepped" else "direct", batch=batch,
                             start_timeout=start_timeout)
        except TimeoutError as exc:
            raise DemoError(f"{exc} while the engines started: a busy or slow machine? allow more with "
                            f"--start-timeout (now {start_timeout:g} s)") from None
        result = DemoResult(mode, 0, 0, 0.0, 0, 0, rounds=len(rounds))
        stats0 = {id(h): h.call("stats") for h in engines.movers}
        result.startup_seconds = time.perf_counter() - t_start
        _run_rounds(engines, rounds, result, stats0, timeout=timeout, check=check, plans=(cons_plan, prod_plan),
                    progress=progress, requests=requests)
        return result
    finally:
        for p in (cproc, pproc):
            p.stop()


def _run_rounds(engines: "_Engines", rounds: list, result: DemoResult, stats0: dict, *, timeout: float,
                check: str, plans: tuple[Plan, Plan], progress: Progress | None, requests: int) -> None:
    """Every round in turn, its bytes checked as ``check`` says; a timeout names --timeout."""
    for i, round_ in enumerate(rounds):
        verify_now = check == "all" or (check == "first" and i == 0)
        try:
            _run_round(engines, round_, result, timeout, plans if verify_now else None)
        except TimeoutError as exc:
            raise DemoError(f"{exc} in round {i + 1} of {len(rounds)}: a busy or slow machine? allow more "
                            f"with --timeout (now {timeout:g} s per request)") from None
        _count_moved(result, engines.movers, stats0)
        if progress:
            progress(result.requests, requests, result.nbytes, result.seconds)


def _start(pproc, cproc, plans: tuple[Plan, Plan], cfg, *, fill: str, seed: int, mode: str, direct: str,
           batch: int, start_timeout: float = 120.0) -> "_Engines":
    """Every rank of the producer and consumer ``plans``, ready and connected (``cfg`` makes a rank's
    config; ``fill``: the producer's; ``seed``: the consumers' noise)."""
    prod_plan, cons_plan = plans
    prods = [pproc.add_async(cfg(prod_plan, r, fill, 0, "demo-producer")) for r in range(prod_plan.parallel.ranks)]
    cons = [cproc.add_async(cfg(cons_plan, r, "random", seed + r, "demo-consumer"))
            for r in range(cons_plan.parallel.ranks)]
    _ready(prods + cons, start_timeout)
    return _connect(pproc, cproc, prods, cons, mode, direct, batch, start_timeout)


def _plans(layout, consumer_layout, max_bytes: int, to_dram: bool) -> tuple[Plan, Plan]:
    """The scaled producer and consumer plans (the consumer's is the producer's without its own layout)."""
    prod_plan = scaled_plan(layout, max_bytes, to_dram=to_dram)
    return prod_plan, scaled_plan(consumer_layout, max_bytes, to_dram=to_dram) if consumer_layout else prod_plan


def _ready(handles: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for h in handles:
        h.ready(max(0.001, deadline - time.monotonic()))


def _check_options(*, mode, check, descriptors, fill, device, timeout, batch=1) -> None:
    for what, value, choices in (("mode", mode, MODES), ("check", check, ("all", "first", "none")),
                                 ("descriptors", descriptors, ("rows", "prepped")),
                                 ("fill", fill, ("content", "random", "zeros")), ("device", device, ("cpu", "gpu"))):
        if value not in choices:
            raise DemoError(f"{what} {value!r}: use one of {', '.join(choices)}")
    if fill != "content" and check != "none":
        raise DemoError("checking bytes needs fill='content'")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise DemoError(f"timeout {timeout!r}: give seconds, more than 0")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise DemoError(f"batch {batch!r}: give the requests per batch, an integer of at least 1")


def _config(plan: Plan, rank: int, fill: str, seed: int, engine: str, **settings):
    """One rank's :class:`~kvlc.demo.procs.EngineConfig` (``settings``: those every rank of the run shares)."""
    from kvlc.demo.procs import EngineConfig

    return EngineConfig(plan.to_json(), rank, fill=fill, seed=seed, engine_id=engine, **settings)


@dataclass
class _Engines:
    """The ranks of both engine processes, connected: which process and ranks move the bytes."""

    proc: object        # the EngineProcess whose ranks initiate the transfers
    method: str         # "read" (the consumer pulls) or "write" (the producer pushes)
    active: list        # the initiating ranks that have peers
    cons: list          # every consumer rank (each is waited on and checked)
    movers: list        # the ranks whose agents post the transfers (their stats count the bytes)
    mode: str
    batch: int = 1      # requests per write_many / read_many (1: write / read each)


def _connect(pproc, cproc, prods: list, cons: list, mode: str, direct: str, batch: int = 1,
             timeout: float = 120.0) -> _Engines:
    addrs_p = [h.address for h in prods]
    addrs_c = [h.address for h in cons]
    if mode == "push":
        initiators, proc, method = prods, pproc, "write"
        links = [h.connect(addrs_c, "WRITE", direct, timeout=timeout) for h in prods]
    else:
        initiators, proc, method = cons, cproc, "read"
        links = [h.connect(addrs_p, "READ", direct if mode == "pull" else "pull_via_push", timeout=timeout)
                 for h in cons]
    active = [h for h, link in zip(initiators, links) if link["peer_ranks"]]
    movers = prods if mode in ("push", "pull_via_push") else cons
    return _Engines(proc, method, active, cons, movers, mode, batch)


def _run_round(engines: _Engines, batch: list, result: DemoResult, timeout: float,
               verify_plans: tuple[Plan, Plan] | None) -> None:
    """Move one round of requests; with ``verify_plans`` (consumer, producer) check every consumer byte."""
    t_v = time.perf_counter()
    before = [h.call("dump") for h in engines.cons] if verify_plans else None
    result.verify_seconds += time.perf_counter() - t_v
    _move(engines, batch, result, timeout)
    if verify_plans:
        t_v = time.perf_counter()
        for h, b in zip(engines.cons, before):
            checked, problems = verify(verify_plans[0], h.config.rank, verify_plans[1], b, h.call("dump"), batch)
            result.checked_bytes += checked
            result.mismatches.extend(problems)
        result.verify_seconds += time.perf_counter() - t_v
        result.verified_requests += len(batch)
        result.verified_rounds += 1
    result.requests += len(batch)


def _move(engines: _Engines, batch: list, result: DemoResult, timeout: float) -> None:
    """Post one round's requests on every active rank and wait until every consumer rank has them."""
    reqs = [(r, p, c, n) for r, c, p, n in batch] if engines.mode == "push" else batch
    method, size = (engines.method, 0) if engines.batch == 1 else (f"{engines.method}_many", engines.batch)
    out = engines.proc.call("batch", -1, [(h.aid, "default", method, reqs, size) for h in engines.active], timeout)
    for a in out["agents"].values():
        result.failed.update(a["failed"])
        result.failed.update(a["errors"])
    ids = [b[0] for b in batch if b[0] not in result.failed]  # (a refused request is not waited for)
    for h in engines.cons:  # every consumer rank: every request landed (push: notified)
        got = h.call("wait", ids, timeout)
        result.failed.update(got["failed"])
        result.failed.update({r: "still open" for r in got["open"]})
    result.seconds += out["seconds"]
    result.round_seconds.append(out["seconds"])


def _count_moved(result: DemoResult, movers: list, stats0: dict) -> None:
    """Bytes and descriptors the movers' agents posted since ``stats0``."""
    stats = {id(h): h.call("stats") for h in movers}
    result.nbytes = sum(stats[k]["bytes"] - stats0[k]["bytes"] for k in stats)
    result.descriptors = sum(stats[k]["descriptors"] - stats0[k]["descriptors"] for k in stats)
    result.copied_requests = sum(stats[k]["ipc_requests"] - stats0[k]["ipc_requests"] for k in stats)
    for name, attr in (("chunks_sent", "staged_chunks"), ("chunks_direct", "direct_chunks")):
        setattr(result, attr, sum((stats[k]["staging"] or {}).get(name, 0) - (stats0[k]["staging"] or {}).get(name, 0)
                                  for k in stats))
