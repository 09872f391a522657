"""What kvlc adds per request over raw NIXL: the same descriptors, the same agents, rounds alternated.

The bytes are made tiny on purpose (``--spec`` with one KV head of ``--head-dim`` 2: 32
descriptors of 128 bytes per 16-token request for Llama-3.1-8B), so the copy costs almost nothing
and what is left is each side's per-request work:

* ``raw``: for each request, NIXL's ``get_xfer_descs`` of both sides' rows, ``initialize_xfer``
  and ``transfer`` (post), then every request waited for and released: what any runtime pays.
  The rows are kvlc's own for that request, built before the clock.
* ``kvlc``: ``Peer.write`` of the same requests (check, descriptor rows, NIXL create and post,
  bookkeeping), then polled until every one is done on the producer (the consumer told, the
  ``done`` notification sent): what an engine pays.

The producer (this process) and consumer (a spawned process) are KvAgents over UCX on loopback;
raw NIXL uses the producer's own NIXL agent and connection, under its lock (the progress thread
uses the same UCX worker). ``--inflight`` requests per round, ``--rounds`` rounds of each kind
alternated (raw, kvlc, raw, ...) after two warm-up rounds; medians of µs per request. ``--gpu``
puts both caches in VRAM on cuda:0 (a GPU machine). Writes ``results/overhead.json``.

``--latency 1024,4096`` instead times ONE request at a time (what a decode handover waits for), on three
kinds taken in turn request by request (each first, second and third in rotation), each to its own
consumer agent (all hosted in one consumer process, one polling loop), p50 and p99 of each:

* ``raw``: create, post, spin on the state, release (the producer's own NIXL agent, as above);
* ``raw+notif``: the same, then kvlc's ``done`` notification (built before the clock) sent with NIXL's
  ``send_notif``: what any runtime that tells the consumer pays;
* ``kvlc``: ``Peer.write``, then ``poll()`` in a loop until it reports the request finished (spinning).

Each kind has its own UCX endpoint because NIXL's WRITE ends with a flush of its endpoint, and that
flush waits until the consumer's worker took the notification sent on it before: a notification
delays the next WRITE on that endpoint by up to one consumer polling interval. Then a breakdown of
kvlc's stages over ``--breakdown`` more requests (the ``write()`` call, from its return to the poll
that reports the request, the polls and their cost, NIXL notification fetches, progress-thread
turns), and kvlc's own host work alone (``--host-rounds``: ``write()`` + ``poll()`` with NIXL's create,
post, state, release and send_notif stubbed out). ``--gap`` sleeps before each request.
``--kvlc-root`` runs another checkout's kvlc (before / after in one run: the same command with two
roots, alternated by the caller). ``--flush-probe`` shows that flush with bare NIXL agents (no kvlc): one
8 KiB WRITE at a time, with and without a notification after each, to a consumer that fetches its
notifications every ``--flush-every`` seconds.

Run:  python3 benchmarks/probes/bench_overhead.py [--tokens 16] [--inflight 32] [--rounds 40] [--progress manual] [--gpu]
      python3 benchmarks/probes/bench_overhead.py --latency 1024,4096 --requests 400 [--full] [--kvlc-root DIR]
      python3 benchmarks/probes/bench_overhead.py --flush-probe --requests 300
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
if "--kvlc-root" in sys.argv:  # another checkout's kvlc (its native library built there), before anything imports it
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--kvlc-root") + 1]).resolve()))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, the suite
sys.path.insert(0, str(Path(__file__).resolve().parent))  # probes/

from common import write_results  # noqa: E402
from profile_push import one_round  # noqa: E402

from kvlc.demo.run import DEFAULT_LAYOUT, make_workload, scaled_plan  # noqa: E402



def _parts(peer, local_ids, remote_ids, num_tokens):
    """The NIXL parts one request posts (the peer's own decision on staging left out)."""
    return peer.parts(local_ids, remote_ids, num_tokens)[0]

def tiny_plan(spec: str, head_dim: int, pool_mib: int, gpu: bool):
    """``spec`` with one KV head of ``head_dim`` (the same descriptors, tiny bytes), pools scaled."""
    data = yaml.safe_load(Path(spec).read_text())
    data["model"].update(num_kv_heads=1, head_dim=head_dim)
    data["name"] = f"{data['name']}-tiny"
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(data, f, sort_keys=False)
    try:
        return scaled_plan(f.name, pool_mib << 20, to_dram=not gpu)
    finally:
        os.unlink(f.name)


def raw_round(nixl, remote: str, parts: list) -> tuple[float, float]:
    """Create and post one NIXL WRITE per request part, then wait for all: (post time, total) seconds."""
    n, lock = nixl._n, nixl._lock
    t0 = time.perf_counter()
    xfers = []
    for req in parts:
        for key, p in req.items():
            with lock:
                ld = n.get_xfer_descs(p.local.view("int64"), key.local_mem)
                rd = n.get_xfer_descs(p.remote.view("int64"), key.remote_mem)
                x = n.initialize_xfer("WRITE", ld, rd, remote, b"")
                if n.transfer(x) == "ERR":
                    raise RuntimeError("raw NIXL post failed")
            xfers.append(x)
    t1 = time.perf_counter()
    for x in xfers:
        while True:
            with lock:
                state = n.check_xfer_state(x)
                if state != "PROC":
                    n.release_xfer_handle(x)
                    break
        if state == "ERR":
            raise RuntimeError("raw NIXL transfer failed")
    return t1 - t0, time.perf_counter() - t0


def raw_one(nixl, remote: str, req: list, notif: bytes = b"") -> float:
    """One request the way a runtime without kvlc moves it: create, post, spin on the state, release, and
    with ``notif`` send that notification to ``remote`` once it is done (seconds)."""
    n, lock = nixl._n, nixl._lock
    t0 = time.perf_counter()
    xs = []
    for key, p in req:
        with lock:
            ld = n.get_xfer_descs(p.local.view("int64"), key.local_mem)
            rd = n.get_xfer_descs(p.remote.view("int64"), key.remote_mem)
            x = n.initialize_xfer("WRITE", ld, rd, remote, b"")
            state = n.transfer(x)
        xs.append((x, state))
    for x, state in xs:
        while state == "PROC":
            with lock:
                state = n.check_xfer_state(x)
        with lock:
            n.release_xfer_handle(x)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL transfer ended {state}")
    if notif:
        with lock:
            n.send_notif(remote, notif)
    return time.perf_counter() - t0


def kvlc_one(prod, peer, rid: str, cids, pids, tokens: int) -> tuple[float, float, int, float]:
    """``Peer.write`` of one request, then ``poll()`` until it is finished: (total, write() call, polls,
    seconds inside poll()), seconds."""
    t0 = time.perf_counter()
    peer.write(rid, pids, cids, tokens)
    t1 = time.perf_counter()
    polls, inside = 0, 0.0
    while True:
        a = time.perf_counter()
        c = prod.poll()
        b = time.perf_counter()
        polls += 1
        inside += b - a
        if c.failed:
            raise RuntimeError(f"kvlc request failed: {dict(c.failed)}")
        if rid in c.finished:
            return b - t0, t1 - t0, polls, inside


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank."""
    v = sorted(values)
    return v[min(len(v) - 1, max(0, int(round(q * (len(v) - 1)))))]


class _Counted:
    """Wraps an agent's method (an instance attribute shadows it): calls and seconds, per thread kind."""

    def __init__(self, obj, name: str):
        self.obj, self.name, self.fn = obj, name, getattr(obj, name)
        self.main = threading.get_ident()
        self.calls = {"engine": 0, "thread": 0}
        self.seconds = {"engine": 0.0, "thread": 0.0}
        setattr(obj, name, self)

    def __call__(self, *args, **kw):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kw)
        finally:
            who = "engine" if threading.get_ident() == self.main else "thread"
            self.calls[who] += 1
            self.seconds[who] += time.perf_counter() - t0

    def take(self) -> tuple[dict, dict]:
        out = dict(self.calls), dict(self.seconds)
        self.calls = {"engine": 0, "thread": 0}
        self.seconds = {"engine": 0.0, "thread": 0.0}
        return out

    def remove(self) -> None:
        delattr(self.obj, self.name)


def breakdown(prod, peer, cids, pids, tokens: int, count: int, tag: str, gap: float = 0.0) -> dict:
    """Where one request's time goes in kvlc (medians over ``count`` requests, µs): the ``write()`` call,
    from its return to the poll that reports the request, the polls, the cost of one poll, NIXL
    notification fetches (the engine's polls and the progress thread's turns)."""
    notifs = _Counted(prod.nixl, "notifs")
    pump = _Counted(prod, "_pump")
    rows = []
    try:
        for i in range(count):
            if gap:
                time.sleep(gap)
            notifs.take(), pump.take()
            total, call, polls, inside = kvlc_one(prod, peer, f"{tag}-b{i}", cids, pids, tokens)
            (nc, ns), (pc, ps) = notifs.take(), pump.take()
            rows.append({"total": total, "write": call, "to_done": total - call, "polls": polls,
                         "poll_each": inside / polls, "notif_fetches": nc["engine"] + nc["thread"],
                         "notif_fetch_each": (ns["engine"] + ns["thread"]) / max(1, nc["engine"] + nc["thread"]),
                         "thread_turns": pc["thread"], "thread_turn_each": ps["thread"] / max(1, pc["thread"])})
    finally:
        notifs.remove()
        pump.remove()
    return {k: statistics.median(r[k] for r in rows) * (1 if k in ("polls", "notif_fetches", "thread_turns") else 1e6)
            for k in rows[0]}


KINDS = ("raw", "raw+notif", "kvlc")


class _NoNixl:
    """The executor's NIXL agent with create, post, state, release, send_notif and send_done doing nothing (every
    transfer DONE at once): what is left of a request is kvlc's own host work (``--host``)."""

    class Xfer:
        __slots__ = ("released", "error", "state", "what")

        def __init__(self, what: str):
            from kvlc.runtime.nixl.core import XferState
            self.released, self.error, self.state, self.what = False, None, XferState.PROC, what

        def release(self) -> None:
            self.released = True

    def __init__(self, real):
        self.real = real

    def initialize(self, op, local_rows, local_mem, remote_rows, remote_mem, remote_agent, what="transfer"):
        return self.Xfer(what)

    def post(self, xfer, notif: bytes = b""):
        from kvlc.runtime.nixl.core import XferState
        xfer.state = XferState.DONE
        return xfer.state

    def state(self, xfer):
        return xfer.state

    def send_notif(self, agent_name: str, message: bytes) -> None:
        pass

    def send_done(self, agent_name: str, message: bytes) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self.real, name)


def host_cost(prod, peer, plan, sizes: list[int], rounds: int, per_round: int) -> list[dict]:
    """kvlc's own host work per request (``Peer.write`` + ``poll()`` until finished, NIXL's calls stubbed
    out; the agent's own notification fetch stays real), median µs over ``rounds`` rounds."""
    real = prod.executor.agent
    prod.executor.agent = _NoNixl(real)
    out = []
    try:
        for tokens in sizes:
            _, cids, pids, n = make_workload(plan, plan, 1, tokens, ids="contiguous")[0][0]
            per, write, done = [], [], []
            for r in range(-1, rounds):
                t0 = time.perf_counter()
                for i in range(per_round):
                    rid = f"h{tokens}-{r}-{i}"
                    a = time.perf_counter()
                    peer.write(rid, pids, cids, n)
                    b = time.perf_counter()
                    while rid not in prod.poll().finished:
                        pass
                    write.append(b - a)
                    done.append(time.perf_counter() - b)
                if r >= 0:
                    per.append((time.perf_counter() - t0) / per_round)
            out.append({"tokens": tokens, "request_us": statistics.median(per) * 1e6, "request_min_us": min(per) * 1e6,
                        "write_us": statistics.median(write) * 1e6, "to_finished_us": statistics.median(done) * 1e6,
                        "idle_poll_us": per_call(prod.poll, 2000) * 1e6})
            o = out[-1]
            print(f"  host only, {tokens} tokens: {o['request_us']:.1f} us per request (min {o['request_min_us']:.1f}): "
                  f"write() {o['write_us']:.1f}, polls to finished {o['to_finished_us']:.1f}; idle poll "
                  f"{o['idle_poll_us']:.1f}", flush=True)
    finally:
        prod.executor.agent = real
    return out


def latency(args) -> int:
    """One request at a time, kvlc vs raw NIXL alternated (see the module docstring)."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ["KVLC_IPC"] = args.ipc  # both processes: "off" moves every byte through NIXL
    import kvlc
    from kvlc.runtime.agent import KvAgent
    from kvlc.runtime.settings import AgentSettings
    from kvlc.runtime.binding import allocate
    from kvlc.runtime.channel.notifs import agents_of
    from kvlc.demo.procs import EngineConfig, EngineProcess
    from kvlc.demo.run import scaled_plan

    sizes = [int(t) for t in args.latency.split(",")]
    plan = (scaled_plan(args.spec, args.pool_mib << 20, to_dram=not args.gpu) if args.full
            else tiny_plan(args.spec, args.head_dim, args.pool_mib, args.gpu))
    secret = secrets.token_hex(32)
    proc = EngineProcess()
    cases = []
    try:
        # one consumer agent per kind, hosted together (one process, one polling loop): each kind has its own
        # UCX endpoint, so a notification one kind sends never delays another kind's next transfer (a NIXL
        # WRITE flushes its endpoint, which waits until the consumer took the notification sent before it)
        cons = {k: proc.add(EngineConfig(plan.to_json(), 0, fill="zeros", secret=secret, engine_id=f"latency-{k.replace('+', '-')}",
                                         pin=args.gpu, ipc=args.ipc)) for k in KINDS}
        prod = KvAgent(plan, 0, allocate(plan, pin=args.gpu),
                       AgentSettings(secret=secret, engine_id="latency-producer", progress=args.progress,
                                     ipc=args.ipc))
        peers = {k: prod.connect(c.address, direction="WRITE") for k, c in cons.items()}
        remote = {k: agents_of(p._targets())[0] for k, p in peers.items()}
        tell = next(iter(peers["raw+notif"]._targets().values()))  # kvlc's own `done`, built before the clock
        for tokens in sizes:
            _, cids, pids, n = make_workload(plan, plan, 1, tokens, ids="contiguous")[0][0]
            req = {k: [(pk, p) for pk, p in _parts(peers[k], pids, cids, n).items() if len(p)] for k in KINDS}
            rows = sum(len(p) for _, p in req["kvlc"])
            nbytes = sum(int(p.nbytes) for _, p in req["kvlc"])
            t = {k: [] for k in KINDS}
            t.update(kvlc_write=[], kvlc_polls=[])
            for i in range(-args.warm, args.requests):
                order = KINDS[i % len(KINDS):] + KINDS[:i % len(KINDS)]  # each kind first, second, third in turn
                for kind in order:
                    if args.gap:
                        time.sleep(args.gap)
                    if kind == "kvlc":
                        got, call, polls, _ = kvlc_one(prod, peers[kind], f"l{tokens}-{i}", cids, pids, n)
                        if i >= 0:
                            t["kvlc_write"].append(call)
                            t["kvlc_polls"].append(polls)
                    else:
                        msg = tell.done([f"n{tokens}-{i}"], 0) if kind == "raw+notif" else b""
                        got = raw_one(prod.nixl, remote[kind], req[kind], msg)
                    if i >= 0:
                        t[kind].append(got)
            row = {"tokens": tokens, "rows": rows, "bytes": nbytes, "requests": args.requests}
            for k in KINDS:
                row[k] = {"p50_us": pct(t[k], 0.5) * 1e6, "p99_us": pct(t[k], 0.99) * 1e6,
                          "mean_us": statistics.fmean(t[k]) * 1e6}
            for base in ("raw", "raw+notif"):
                row[f"ratio_p50_vs_{base}"] = row["kvlc"]["p50_us"] / row[base]["p50_us"]
                row[f"ratio_p99_vs_{base}"] = row["kvlc"]["p99_us"] / row[base]["p99_us"]
            row["kvlc_write_p50_us"] = pct(t["kvlc_write"], 0.5) * 1e6
            row["kvlc_polls_p50"] = pct(t["kvlc_polls"], 0.5)
            row["breakdown_us"] = breakdown(prod, peers["kvlc"], cids, pids, n, args.breakdown, f"l{tokens}", args.gap)
            cases.append(row)
            b = row["breakdown_us"]
            print(f"{plan.name} {tokens} tokens ({rows} rows, {nbytes} B), p50 / p99 us: "
                  + ", ".join(f"{k} {row[k]['p50_us']:.1f} / {row[k]['p99_us']:.1f}" for k in KINDS)
                  + f"\n    kvlc/raw {row['ratio_p50_vs_raw']:.2f} / {row['ratio_p99_vs_raw']:.2f}, kvlc/raw+notif "
                  f"{row['ratio_p50_vs_raw+notif']:.2f} / {row['ratio_p99_vs_raw+notif']:.2f}"
                  f"\n    kvlc: write() {b['write']:.1f} us, then {b['to_done']:.1f} us to the poll that reports it "
                  f"({b['polls']:.0f} polls of {b['poll_each']:.1f} us); notification fetches {b['notif_fetches']:.0f} "
                  f"of {b['notif_fetch_each']:.1f} us; progress-thread turns {b['thread_turns']:.0f} "
                  f"of {b['thread_turn_each']:.1f} us", flush=True)
        host = host_cost(prod, peers["kvlc"], plan, sizes, args.host_rounds, 500) if args.host_rounds else []
        for p in peers.values():
            p.close()
        prod.close()
    finally:
        proc.stop()
    doc = {"plan": plan.name, "kvlc_root": str(Path(kvlc.__file__).resolve().parents[1]), "full_bytes": args.full,
           "gpu": args.gpu, "progress": args.progress, "ipc": args.ipc, "requests": args.requests,
           "warm": args.warm, "gap_s": args.gap, "cases": cases, "host_only": host, "load_end": os.getloadavg()[0]}
    print(f"wrote {write_results(args.out, doc)}; load {doc['load_end']:.2f}")
    return 0


def _flush_consumer(conn, every: str) -> None:  # pragma: no cover - runs in the child process
    """A bare NIXL agent that fetches its notifications in a loop (``every``: "spin", or seconds between)."""
    import numpy as np
    from kvlc.runtime.nixl.core import Agent

    a = Agent(f"flush-consumer-{os.getpid()}")
    buf = np.zeros(1 << 20, dtype=np.uint8)
    a.register(np.array([[buf.ctypes.data, buf.nbytes, 0]], dtype=np.uint64), "DRAM")
    conn.send((a.name, a.metadata(), buf.ctypes.data))
    a.add_remote(conn.recv())
    while not any(b"stop" in m for v in a.notifs().values() for m in v):
        if every != "spin":
            time.sleep(float(every))
    conn.send("bye")
    conn.recv()


def flush_probe(args) -> int:
    """``--flush-probe``: bare NIXL (no kvlc), one 8 KiB WRITE at a time to a consumer that fetches its
    notifications every ``--flush-every`` seconds, with and without a notification after each WRITE."""
    import multiprocessing as mp
    import numpy as np
    from kvlc.runtime.nixl.core import Agent, XferState

    out = []
    for every in args.flush_every.split(","):
        ctx = mp.get_context("spawn")
        here, there = ctx.Pipe()
        child = ctx.Process(target=_flush_consumer, args=(there, every), daemon=True)
        child.start()
        a = Agent(f"flush-producer-{os.getpid()}")
        buf = np.ones(1 << 20, dtype=np.uint8)
        a.register(np.array([[buf.ctypes.data, buf.nbytes, 0]], dtype=np.uint64), "DRAM")
        name, md, base = here.recv()
        a.add_remote(md)
        here.send(a.metadata())
        time.sleep(0.5)

        def write(notify: bool) -> float:
            t0 = time.perf_counter()
            x = a.initialize("WRITE", np.array([[buf.ctypes.data, 8192, 0]], dtype=np.uint64), "DRAM",
                             np.array([[base, 8192, 0]], dtype=np.uint64), "DRAM", name)
            state = a.post(x)
            while state is XferState.PROC:
                state = a.state(x)
            x.release()
            if notify:
                a.send_notif(name, b"done " * 16)
            return time.perf_counter() - t0

        row = {"consumer_fetches_every": every}
        for notify in (False, True, False):
            t = [write(notify) for _ in range(args.requests)]
            row.setdefault("with_notif" if notify else "without_notif", []).append(statistics.median(t) * 1e6)
        a.send_notif(name, b"stop")
        here.recv()
        here.send("ok")
        child.join(10)
        a.close()
        out.append({"consumer_fetches_every": every, "without_notif_p50_us": min(row["without_notif"]),
                    "with_notif_p50_us": row["with_notif"][0]})
        print(f"consumer fetching every {every}: one WRITE at a time p50 {out[-1]['without_notif_p50_us']:.1f} us; "
              f"with a notification after each {out[-1]['with_notif_p50_us']:.1f} us", flush=True)
    print(f"wrote {write_results(args.out, {'flush_probe': out, 'requests': args.requests, 'load_end': os.getloadavg()[0]})}")
    return 0


def per_call(fn, repeat: int = 200) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default=str(DEFAULT_LAYOUT))
    ap.add_argument("--head-dim", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--inflight", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--pool-mib", type=int, default=64)
    ap.add_argument("--progress", default="thread", help="the producer's progress: thread (default) or manual")
    ap.add_argument("--nap", type=float, default=0.0,
                    help="seconds kvlc's wait sleeps between empty polls (default 0: it spins, as raw's wait does)")
    ap.add_argument("--gpu", action="store_true", help="VRAM on cuda:0 on both sides (a GPU machine)")
    ap.add_argument("--out", default="overhead", help="result name under benchmarks/results (no .json)")
    ap.add_argument("--latency", default="", help="comma-separated tokens: one request at a time, kvlc vs raw "
                    "alternated, p50 / p99 (see the module docstring)")
    ap.add_argument("--requests", type=int, default=400, help="--latency: requests of each kind per size")
    ap.add_argument("--warm", type=int, default=20, help="--latency: uncounted requests of each kind first")
    ap.add_argument("--breakdown", type=int, default=100, help="--latency: requests in kvlc's stage breakdown")
    ap.add_argument("--host-rounds", type=int, default=7, help="--latency: rounds of 500 requests with NIXL's "
                    "calls stubbed out (kvlc's own host work alone; 0: skip)")
    ap.add_argument("--gap", type=float, default=0.0, help="--latency: seconds slept before each request")
    ap.add_argument("--full", action="store_true", help="--latency: the plan's real bytes (else one tiny KV head)")
    ap.add_argument("--ipc", default="off", help="--latency: AgentSettings.ipc of both sides (default off: NIXL)")
    ap.add_argument("--kvlc-root", default="", help="import kvlc from this checkout (before / after runs)")
    ap.add_argument("--flush-probe", action="store_true", help="bare NIXL: a WRITE after a notification waits "
                    "for the consumer's next fetch (see --flush-every)")
    ap.add_argument("--flush-every", default="spin,0.0002,0.001,0.005",
                    help="--flush-probe: the consumer's seconds between notification fetches, comma-separated")
    args = ap.parse_args(argv)
    if args.flush_probe:
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        return flush_probe(args)
    if args.latency:
        return latency(args)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from kvlc.runtime.agent import KvAgent
    from kvlc.runtime.settings import AgentSettings
    from kvlc.runtime.binding import allocate
    from kvlc.runtime.channel.notifs import agents_of
    from kvlc.demo.procs import EngineConfig, EngineProcess

    plan = tiny_plan(args.spec, args.head_dim, args.pool_mib, args.gpu)
    secret = secrets.token_hex(32)
    proc = EngineProcess()
    try:
        cons = proc.add(EngineConfig(plan.to_json(), 0, fill="zeros", secret=secret, engine_id="overhead-consumer",
                                     pin=args.gpu))
        prod = KvAgent(plan, 0, allocate(plan, pin=args.gpu),
                       AgentSettings(secret=secret, engine_id="overhead-producer", progress=args.progress))
        peer = prod.connect(cons.address, direction="WRITE")
        batch = make_workload(plan, plan, args.inflight, args.tokens, ids="contiguous")[0]
        parts = [_parts(peer, p, c, n) for _, c, p, n in batch]
        remote = agents_of(peer._targets())[0]
        rows = sum(len(p) for p in parts[0].values())
        nbytes = sum(int(p.nbytes) for p in parts[0].values())
        times = {"raw": [], "kvlc": []}
        for i in range(-2, args.rounds):  # rounds -2, -1 warm both paths up, not counted
            raw = raw_round(prod.nixl, remote, parts)
            k = one_round(prod, peer, [(f"o{i}-{j}", c, p, n) for j, (_, c, p, n) in enumerate(batch)], nap=args.nap)
            if i >= 0:
                times["raw"].append(raw)
                times["kvlc"].append((k["submit_s"], k["total_s"]))
        _, c0, p0, n0 = batch[0]
        inst = per_call(lambda: _parts(peer, p0, c0, n0))
        peer.close()
        prod.close()
    finally:
        proc.stop()
    n = args.inflight
    med = {k: {"post_us": statistics.median(a for a, _ in v) / n * 1e6,
               "total_us": statistics.median(b for _, b in v) / n * 1e6} for k, v in times.items()}
    extra = med["kvlc"]["total_us"] - med["raw"]["total_us"]
    doc = {"plan": plan.name, "gpu": args.gpu, "progress": args.progress, "tokens": args.tokens,
           "in_flight": n, "rounds": args.rounds, "descriptors_per_request": rows, "bytes_per_request": nbytes,
           "raw": med["raw"], "kvlc": med["kvlc"], "kvlc_instantiate_us": inst * 1e6,
           "kvlc_extra_us": extra, "ratio_raw_over_kvlc": med["raw"]["total_us"] / med["kvlc"]["total_us"],
           "load_end": os.getloadavg()[0]}
    print(f"{plan.name}: {rows} descriptors, {nbytes} bytes per request, {n} in flight, {args.rounds} rounds each, "
          f"progress {args.progress}")
    for k in ("raw", "kvlc"):
        print(f"  {k:5s} posted {med[k]['post_us']:7.1f} us/request, done {med[k]['total_us']:7.1f} us/request")
    print(f"  kvlc adds {extra:.1f} us per request (instantiate alone {inst * 1e6:.1f}); raw / kvlc "
          f"{doc['ratio_raw_over_kvlc']:.2f}; load {doc['load_end']:.2f}")
    print(f"wrote {write_results(args.out, doc)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
