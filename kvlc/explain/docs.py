"""The JSON documents of ``--json``: plain dicts of exact integers and strings, stable keys.

Every document has ``"kind"`` (what it describes) and ``"kvlc"`` (the document version).
Byte counts are exact integers; ``per_rank`` and ``engine`` say what they count.
"""

from __future__ import annotations

from dataclasses import asdict

from kvlc.compiler.pairing.program import TransferProgram
from kvlc.compiler.plan.model import Plan
from kvlc.compiler.request.windows import window_stats
from kvlc.errors import format_path
from kvlc.explain.program_view import piece
from kvlc.explain.size import RequestSize
from kvlc.explain.summary import Summary, summarize

DOC_VERSION = 1


def _head(kind: str) -> dict:
    return {"kvlc": DOC_VERSION, "kind": kind}


def explain_doc(plan: Plan) -> dict:
    """``kvlc explain --json``: the plan's identity, every region, storage, group and total.

    >>> from kvlc import compile_spec
    >>> d = explain_doc(compile_spec("layouts/llama-3.1-8b.yaml"))
    >>> d["per_rank"]["region_bytes"], d["engine"]["ranks"], d["groups"][0]["engine_tokens"]
    (8589934592, 1, 65536)
    """
    s: Summary = summarize(plan)
    return {
        **_head("explain"),
        "plan": s.name, "digest": s.digest, "model": s.model, "num_layers": s.num_layers,
        "tp_size": s.tp_size, "dcp_size": s.dcp_size, "layers": list(s.layers),
        "per_rank": {"region_bytes": s.total_bytes, "storage_bytes": s.total_size},
        "engine": {"ranks": s.tp_size, "region_bytes": s.engine_bytes, "storage_bytes": s.engine_size},
        "mems": [{**asdict(m), "devices": list(m.devices), "engine_bytes": m.bytes * s.tp_size} for m in s.mems],
        "groups": [{**asdict(g), "token_bytes": g.token_bytes, "rank_tokens": g.rank_tokens,
                    "engine_tokens": g.engine_tokens} for g in s.groups],
        "storages": [{**asdict(st), "free": st.free} for st in s.storages],
        "runs": [{"label": run.label, "count": run.count, "storage": run.storage, "offset": run.offset,
                  "bytes": run.bytes, "regions": [r.name for r in run.rows]} for run in s.runs()],
        "regions": [{**asdict(r), "groups": list(r.groups)} for r in s.regions],
    }


def pair_doc(report, program, rank: int) -> dict:
    """``kvlc pair --json``: the compatibility report and, when compatible, the program summary."""
    doc = {**_head("pair"), "compatible": report.ok, "direction": report.direction, "local": report.local,
           "remote": report.remote, "local_rank": rank,
           "findings": [{"code": f.code, "severity": f.severity, "message": f.message, "region": f.region,
                         "field": f.field, "local": f.local, "remote": f.remote, "fix": f.fix}
                        for f in report.findings]}
    if program is not None:
        doc["peer_ranks"] = list(program.peer_ranks)
        doc["consumer_counts"] = {str(k): v for k, v in sorted(program.consumer_counts.items())}
        doc["parts"] = [{"peer_rank": k.peer_rank, "local_mem": k.local_mem, "remote_mem": k.remote_mem, **v}
                        for k, v in program.stats().items()]
        doc["windows"] = _windows(program)
        doc["digest"] = program.digest
        doc["heads"] = _heads(program)
        if program.dcp_text():
            doc["dcp"] = program.dcp_text()
    return doc


def _windows(program: TransferProgram) -> list[dict]:
    return [{**asdict(w), "vllm_blocks": w.vllm_blocks} for w in window_stats(program)]


def program_summary(program: TransferProgram) -> dict:
    """A program as JSON-ready data: peers, consumer counts, layers covered, parts, windows and digest.

    >>> from kvlc import compile_spec, pair
    >>> p = compile_spec("layouts/llama-3.1-8b.yaml")
    >>> s = program_summary(pair(p, p, local_rank=0))
    >>> s["peer_ranks"], s["layers"], s["parts"][0]["entries"], s["windows"]
    ([0], [0, 32], 32, [])
    """
    return {"peer_ranks": list(program.peer_ranks), "layers": list(program.layers),
            "consumer_counts": {str(k): v for k, v in sorted(program.consumer_counts.items())},
            "parts": [{"peer_rank": k.peer_rank, "local_mem": k.local_mem, "remote_mem": k.remote_mem,
                       "entries": s.entries, "runs_per_tile": s.runs_per_tile,
                       "bytes_per_tile": s.bytes_per_tile} for k, s in program.part_stats().items()],
            "windows": _windows(program), "digest": program.digest,
            **({"dcp": program.dcp_text()} if program.dcp_text() else {})}


def _heads(program) -> list[dict]:
    """Which global heads of which field this rank exchanges with each peer, in the first region."""
    if not program.entries:
        return []
    first = program.entries[0]
    return [{"region": e.region, "peer_rank": e.peer, "field": name, "heads": [h0, h1] if h1 > h0 else None,
             **({"remote_region": e.remote_region} if e.remote_region != e.region else {})}
            for e in program.entries if e.region == first.region and e.group == first.group
            for name, h0, h1 in (piece(x) for x in e.pieces)]


def size_doc(s: RequestSize) -> dict:
    """``kvlc size --json``: one request's blocks, bytes and descriptors per rank and per engine."""
    return {
        **_head("size"), "local": s.local, "remote": s.remote, "direction": s.direction, "tokens": s.tokens,
        "tp_size": s.tp_size,
        "groups": [asdict(g) for g in s.groups],
        "per_rank": {"bytes": s.rank_bytes},
        "engine": {"ranks": s.tp_size, "bytes": s.engine_bytes, "moved": s.moved,
                   "descriptors_scattered": s.scattered, "descriptors_contiguous": s.contiguous,
                   "ranks_counted": [r.rank for r in s.ranks]},
        "ranks": [{"rank": r.rank, "peers": list(r.peers), "bytes": r.bytes, "descriptors_scattered": r.scattered,
                   "descriptors_contiguous": r.contiguous, "parts": [asdict(p) for p in r.parts]}
                  for r in s.ranks],
    }


def check_doc(results: list[dict]) -> dict:
    """``kvlc check --json``: per spec ``ok`` with its digest, or its problems."""
    return {**_head("check"), "ok": all(r["ok"] for r in results), "specs": results}


def problem_doc(p) -> dict:
    """One spec problem (:class:`~kvlc.errors.Problem`) as a dict: what, where (file, line, col, path), fix."""
    mark = getattr(p, "mark", None)
    return {"what": p.what, "path": format_path(p.path), "expected": p.expected, "found": p.found, "fix": p.fix,
            "file": mark.file if mark else None, "line": mark.line if mark else None,
            "col": mark.col if mark else None, "text": str(p)}
