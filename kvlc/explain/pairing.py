"""``kvlc pair --html``: which consumer rank reads which producer heads and tokens, drawn.

Three figures, all from :func:`kvlc.pair` programs (nothing is recomputed here):

* **ranks and heads** — every producer rank above, every consumer rank below, each split into the
  global heads it holds; a band joins the heads a consumer rank takes from a producer rank
  (from the program of that consumer rank). Fields without a head dim (an MLA latent) are read
  whole from one producer rank, drawn as a band between whole ranks.
* **tokens** — one tile of lcm(block tokens) tokens: the producer's and the consumer's kernel
  blocks over it.
* **descriptors of one tile** — for the chosen rank and direction, the runs (descriptors per
  tile) of the first region: each run's bytes in the local kernel block(s) and in the peer's.
"""

from __future__ import annotations

from math import gcd

from kvlc.compiler.pairing.pair import pair
from kvlc.compiler.plan.model import Plan, PlanField
from kvlc.explain.numbers import exact, human
from kvlc.explain.page import environment
from kvlc.explain.program_view import piece, runs

W = 1100             # drawing width in pixels
LEFT = 150           # labels left of the rank rows
RANK_GAP = 6
PEER_COLORS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2", "#edc948", "#9c755f")
MAX_DRAWN_RUNS = 256


def _head_field(plan: Plan, region: str) -> PlanField | None:
    return next((f for f in plan.region(region).fields if f.dim("head") is not None), None)


def _held(rank: int, f: PlanField | None, tp: int) -> tuple[int, int]:
    """Global heads ``[h0, h1)`` rank ``rank`` holds of field ``f`` (``(0, 0)``: no head dim)."""
    if f is None:
        return (0, 0)
    d = f.dim("head")
    if d.size * tp >= d.global_size and tp <= d.global_size:
        return (rank * d.size, (rank + 1) * d.size)
    per = tp // d.global_size                     # replicas: tp ranks share each head
    return (rank // per, rank // per + 1)


def _row(n: int, y: float, label: str, heads, tp_name: str) -> list[dict]:
    width = (W - LEFT - RANK_GAP * (n - 1)) / n
    out = []
    for r in range(n):
        h0, h1 = heads(r)
        out.append(dict(rank=r, x=LEFT + r * (width + RANK_GAP), y=y, w=width, h=34, h0=h0, h1=h1,
                        label=f"{tp_name} {r}", heads=f"heads {h0}..{h1 - 1}" if h1 > h0 + 1 else
                        (f"head {h0}" if h1 > h0 else "whole field (replicated)")))
    return out


def _x_of(box: dict, head: int) -> float:
    n = box["h1"] - box["h0"]
    return box["x"] + box["w"] * ((head - box["h0"]) / n if n else 0)


def mapping_model(producer: Plan, consumer: Plan) -> dict:
    """Ranks, their heads, and a band per (consumer rank, producer rank, head slice) of the first region."""
    first = pair(consumer, producer, local_rank=0, direction="READ").entries[0]
    region, remote = first.region, first.remote_region   # another name where K/V are split (part_of)
    pf, cf = _head_field(producer, remote), _head_field(consumer, region)
    ptp, ctp = producer.parallel.tp_size, consumer.parallel.tp_size
    prow = _row(ptp, 40, "producer", lambda r: _held(r, pf, ptp), "producer rank")
    crow = _row(ctp, 190, "consumer", lambda r: _held(r, cf, ctp), "consumer rank")
    bands = []
    for c in range(ctp):
        prog = pair(consumer, producer, local_rank=c, direction="READ")
        for e in prog.entries:
            if (e.region, e.remote_region) != (region, remote) or e.group != prog.entries[0].group:
                continue
            bands += [_band(c, e.peer, name, h0, h1, prow[e.peer], crow[c])
                      for name, h0, h1 in (piece(x) for x in e.pieces) if _drawn_piece(cf, name, h0, h1)]
    field = cf.name if cf is not None else (consumer.region(region).fields[0].name)
    return dict(region=region, remote=remote, field=field, producer=prow, consumer=crow, bands=bands, height=240,
                head_field=cf is not None)


def _drawn_piece(cf: PlanField | None, name: str, h0: int, h1: int) -> bool:
    """Whether a piece is drawn: a head slice of the head field ``cf``, or (no head field) a whole field."""
    return (cf is None) == (h1 == h0) and (cf is None or name == cf.name)


def _band(c: int, peer: int, name: str, h0: int, h1: int, pb: dict, cb: dict) -> dict:
    """The band joining producer rank box ``pb`` to consumer rank ``c``'s box ``cb`` for one piece."""
    if h1 > h0:
        xs = (_x_of(pb, h0), _x_of(pb, h1), _x_of(cb, h1), _x_of(cb, h0))
        what = f"heads {h0}..{h1 - 1}" if h1 - h0 > 1 else f"head {h0}"
    else:
        xs = (pb["x"], pb["x"] + pb["w"], cb["x"] + cb["w"], cb["x"])
        what = f"field {name} (no head dim: every rank holds it whole)"
    return dict(consumer=c, producer=peer, h0=h0, h1=h1, what=what,
                points=_points(xs, pb["y"] + pb["h"], cb["y"]),
                color=PEER_COLORS[peer % len(PEER_COLORS)],
                title=f"consumer rank {c} reads {what} from producer rank {peer}")


def _points(xs, y_top: float, y_bottom: float) -> str:
    a, b, c, d = xs
    return f"{a:.2f},{y_top:.2f} {b:.2f},{y_top:.2f} {c:.2f},{y_bottom:.2f} {d:.2f},{y_bottom:.2f}"


def tokens_model(producer: Plan, consumer: Plan, region: str, remote: str | None = None) -> dict | None:
    """One tile of lcm(kernel block tokens) tokens and both sides' kernel blocks over it (None: state);
    ``region`` is the consumer's region, ``remote`` the producer's (default: of the same name)."""
    bp, bc = producer.region(remote or region).block_tokens, consumer.region(region).block_tokens
    if not bp or not bc:
        return None
    tile = bp * bc // gcd(bp, bc)
    px = (W - LEFT) / tile
    rows = []
    for y, who, bt in ((20, "producer", bp), (80, "consumer", bc)):
        rows.append(dict(who=who, y=y, block_tokens=bt, blocks=[
            dict(x=LEFT + k * bt * px, w=bt * px, label=f"block +{k}: tokens {k * bt}..{(k + 1) * bt - 1}")
            for k in range(tile // bt)]))
    return dict(tile=tile, rows=rows, height=130, width=W)


def descriptors_model(local: Plan, remote: Plan, rank: int, direction: str) -> dict:
    """The runs of one tile of the first region for ``rank``: where each lies on both sides."""
    prog = pair(local, remote, local_rank=rank, direction=direction)
    first = prog.entries[0]
    entries = [e for e in prog.entries if (e.region, e.remote_region) == (first.region, first.remote_region)
               and e.group == first.group]
    lr, rr = local.region(first.region), remote.region(first.remote_region)
    ltile = first.local_sub * lr.block_bytes
    rtile = max(e.remote_sub for e in entries) * rr.block_bytes
    span = max(ltile, rtile)
    px = (W - LEFT) / span
    peers, drawn, y = [], [], 120
    for e in entries:
        color = PEER_COLORS[e.peer % len(PEER_COLORS)]
        peers.append(dict(peer=e.peer, y=y, w=e.remote_sub * rr.block_bytes * px, color=color,
                          label=f"peer rank {e.peer}", runs=len(runs(e.runs)), bytes=e.bytes_per_tile))
        drawn += [_run_shape(run, e.peer, lr, rr, px, y) for run in runs(e.runs)[:MAX_DRAWN_RUNS]]
        y += 46
    local_is = "consumer" if direction == "READ" else "producer"
    return dict(region=first.region, group=first.group, local_w=ltile * px, local_sub=first.local_sub,
                local_bytes=lr.block_bytes, remote_bytes=rr.block_bytes, peers=peers, runs=drawn, height=y + 10,
                width=W, left=LEFT, local_is=local_is, rank=rank, direction=direction,
                tile_tokens=first.tile_tokens, total_runs=sum(len(runs(e.runs)) for e in entries),
                drawn=len(drawn), per_tile=sum(e.bytes_per_tile for e in entries), stats=prog.stats(),
                peer_ranks=prog.peer_ranks, warnings=[str(f) for f in prog.report.warnings])


def _run_shape(run: tuple, peer: int, lr, rr, px: float, y: float) -> dict:
    """One run ``(kl, ol, kr, orr, n)`` of peer ``peer`` drawn from the local block row to the peer's at ``y``."""
    kl, ol, kr, orr, n = run
    lx, rx, w = LEFT + (kl * lr.block_bytes + ol) * px, LEFT + (kr * rr.block_bytes + orr) * px, n * px
    field = next((f.name for f in lr.fields if f.offset <= ol < f.offset + f.extent), "")
    return dict(peer=peer, lx=lx, rx=rx, w=max(w, 0.8), color=PEER_COLORS[peer % len(PEER_COLORS)], ry=y,
                field=field, label=field if w >= len(field) * 7 + 8 else "",
                points=_points((lx, lx + w, rx + w, rx), 54, y),
                title=f"{exact(n)} B of field {field}: local block +{kl} byte {exact(ol)} <-> "
                      f"peer {peer} block +{kr} byte {exact(orr)}")


def render_pair_html(producer: Plan, consumer: Plan, *, rank: int = 0, direction: str = "READ") -> str:
    """A standalone page (inline SVG, no scripts) drawing a pairing: ranks/heads, tokens, descriptors.

    ``rank`` and ``direction`` are those of ``kvlc pair``: READ — ``rank`` is a consumer rank
    pulling; WRITE — a producer rank pushing.

    >>> from kvlc import compile_spec
    >>> page = render_pair_html(compile_spec("layouts/llama-3.1-70b-hnd-tp8.yaml"),
    ...                         compile_spec("layouts/llama-3.1-70b-hnd-tp4.yaml"))
    >>> page.count('class="band"'), 'data-peer="1"' in page
    (8, True)
    """
    mapping = mapping_model(producer, consumer)
    local, remote = (consumer, producer) if direction == "READ" else (producer, consumer)
    return environment().get_template("pair.html.j2").render(
        producer=producer, consumer=consumer, mapping=mapping, width=W, left=LEFT,
        tokens=tokens_model(producer, consumer, mapping["region"], mapping["remote"]),
        desc=descriptors_model(local, remote, rank, direction), human=human)
