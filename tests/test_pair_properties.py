"""Proof tests of pairing: random pairs of engines move every byte right, and nothing else.

Hypothesis draws one *model* (regions, groups, fields with their dims and dtypes) and two
*engines* for it that differ in everything a layout may differ in without changing the
content: TP size (GQA replicas both ways), block and kernel block sizes (non-divisible pairs
too), dim order of every field (NHD, HND, K/V packed at any level), field order, offsets and
padding, block strides, storages (DRAM/VRAM, alignment, devices), region offsets and
per-region capacities. Then a random request (tokens per group, partial tiles, block ids per
group in ascending or arbitrary order) is executed READ from every consumer rank and WRITE
from every producer rank on the content-coded memory model, and checked three ways:

* every requested destination byte holds its content code, no other byte changes
  (``memory_model.verify``) and no destination byte is written twice;
* each part's byte map (local byte → remote byte) equals a reference map computed here
  from content coordinates, independently of ``kvlc.compiler.pairing.pair``;
* each part's descriptor count equals the coalesced minimum of the reference map: always
  after sorting and merging the program's rows, and as produced when block ids ascend.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import kvlc
from kvlc.compiler.pairing.pair import check_pair, pair

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_model import Engine, verify  # noqa: E402
from kvlc import bind, instantiate

ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1, "ue8m0": 1, "int8": 1, "uint8": 1, "fp4_e2m1": 1}
PACKED = {"fp4_e2m1": 2}   # values per byte, along the innermost (plain) dim
TP_SIZES = (1, 2, 3, 4, 8)
BLOCKS = ((4, 4), (6, 6), (8, 8), (8, 4), (12, 12), (12, 6), (12, 4), (16, 16), (16, 8), (24, 24),
          (24, 12), (24, 8), (32, 16))
# The default ("order") coalescing is the minimum within each (region, group) for ascending ids;
# coalesce="sort" must reach the minimum of the whole part for any ids, also where a run
# continues from one (region, group) into the next (a shared region, adjacent regions).
STRICT_ACROSS_ENTRIES = False

# Shrinking a failing pair takes minutes (every example compiles and pairs two engines); it is
# on with KVLC_SHRINK=1. Without it a failure prints the unshrunk example and its blob.
_PHASES = list(Phase) if os.environ.get("KVLC_SHRINK") == "1" else [p for p in Phase if p != Phase.shrink]
PROPS = settings(deadline=None, max_examples=300, suppress_health_check=list(HealthCheck), phases=_PHASES)


# ============================================================================ the model
@dataclass(frozen=True)
class DimT:
    name: str
    role: str = ""                   # "token" | "head" | ""
    size: int | None = None          # global size; None: token (kernel block) or from the model
    sections: tuple = ()             # ((name, global size), ...) for a sections dim
    replicated: tuple = ()           # sections every rank holds whole (the field's `replicated`)


@dataclass(frozen=True)
class FieldT:
    name: str
    dtype: str
    dims: tuple[DimT, ...]
    sections: bool = False


@dataclass(frozen=True)
class LayoutT:
    name: str
    group: str                       # whose kernel block size the token dims follow
    fields: tuple[FieldT, ...]


@dataclass(frozen=True)
class RegionT:
    name: str
    layout: str
    groups: tuple[str, ...]


@dataclass(frozen=True)
class Model:
    heads: int
    head_dim: int
    groups: tuple[tuple[str, str], ...]          # (name, kind)
    layouts: tuple[LayoutT, ...]
    regions: tuple[RegionT, ...]
    swa: str                                     # "none" | "own" | "shared"

    def layout(self, name: str) -> LayoutT:
        return next(lt for lt in self.layouts if lt.name == name)

    def kind(self, group: str) -> str:
        return dict(self.groups)[group]


# ============================================================================ one engine
@dataclass(eq=False)
class Side:
    """One engine's choices and the spec text they give, plus the geometry they imply."""

    tp: int
    blocks: dict                      # group → (block tokens, kernel tokens)
    text: str = ""
    fields: dict = field(default_factory=dict)     # layout → {plan field name: (offset, dims)}
    capacity: dict = field(default_factory=dict)   # region → logical blocks


def local_heads(heads: int, tp: int) -> int:
    return heads // tp if heads % tp == 0 else 1


def shard_ok(heads: int, tp: int) -> bool:
    return heads % tp == 0 or tp % heads == 0


def dim_local(d: DimT, model: Model, tp: int, tokens: int) -> int:
    if d.sections:
        return sum(s if n in d.replicated else s // tp for n, s in d.sections)
    if d.role == "token":
        return tokens
    size = d.size if d.size is not None else {"head": model.heads, "head_dim": model.head_dim}[d.name]
    return local_heads(size, tp) if d.role == "head" else size


def dim_yaml(d: DimT) -> dict:
    out: dict = {"name": d.name}
    if d.role:
        out["role"] = d.role
    if d.sections:
        out["sections"] = dict(d.sections)
    elif d.size is not None:
        out["size"] = d.size
    return out


@st.composite
def side_layouts(draw, model: Model, side: Side) -> tuple[dict, dict]:
    """Random field order, dim orders, offsets and padding for every layout of one side.

    Returns (YAML layouts, block bytes per layout) and fills ``side.fields`` with the geometry
    the compiler must produce: plan field name → (offset, ((name, role, size, global, stride), ...)).
    """
    ylayouts, block_bytes = {}, {}
    for lt in model.layouts:
        kind = model.kind(lt.group)
        tokens = 0 if kind == "mamba" else side.blocks[lt.group][1]
        order = draw(st.permutations(lt.fields))
        explicit = draw(st.booleans())
        cursor, fields_y, geo = 0, [], {}
        for f in order:
            per = PACKED.get(f.dtype, 1)   # fp4: the innermost dim stays innermost and counts bytes
            dims = tuple(draw(st.permutations(f.dims[:-1]))) + f.dims[-1:] if per > 1 else \
                tuple(draw(st.permutations(f.dims)))
            item = ITEMSIZE[f.dtype]
            local = [dim_local(d, model, side.tp, tokens) for d in dims]
            local[-1] //= per
            strides, acc = [], item
            for n in reversed(local):
                strides.append(acc)
                acc *= n
            strides.reverse()
            pad = draw(st.sampled_from((0, 0, 1, 6, 16))) if explicit else 0
            start = -(-(cursor + pad) // 4) * 4 if explicit else cursor  # explicit offsets: dtype-aligned
            cursor = start + acc
            fy: dict = {"name": f.name, "dtype": f.dtype, "dims": [dim_yaml(d) for d in dims]}
            if f.sections:
                fy["kind"] = "sections"
                fy.update({"replicated": list(d.replicated) for d in dims if d.replicated})
            if explicit:
                fy["offset"] = start
            fields_y.append(fy)

            def plan_dims(split_local=None, split_global=None, split_role="head"):
                out = []
                for d, n, s in zip(dims, local, strides):
                    if d.sections:
                        out.append((d.name, split_role, split_local, split_global, s))
                    else:
                        glob = n
                        if d.role == "head":
                            glob = d.size if d.size is not None else model.heads
                        out.append((d.name, d.role, n, glob, s))
                return tuple(out)

            if f.sections:
                i = next(i for i, d in enumerate(dims) if d.sections)
                at = 0
                for sec, g in dims[i].sections:   # a replicated section: whole on every rank, no head role
                    n = g if sec in dims[i].replicated else g // side.tp
                    geo[f"{f.name}.{sec}"] = (start + at * strides[i],
                                              plan_dims(n, g, "" if sec in dims[i].replicated else "head"))
                    at += n
            else:
                geo[f.name] = (start, plan_dims())
        size = cursor
        extra = draw(st.sampled_from((0, 0, 0, 3, 64)))
        layout_y: dict = {"fields": fields_y}
        if extra:
            size += extra
            layout_y["size"] = size
        ylayouts[lt.name] = layout_y
        block_bytes[lt.name] = size
        side.fields[lt.name] = geo
    return ylayouts, block_bytes


@st.composite
def side_spec(draw, model: Model, side: Side, label: str, need: dict) -> Side:
    """Spec text of one engine; ``need`` is the logical blocks each region must hold."""
    ylayouts, block_bytes = draw(side_layouts(model, side))
    full_b, full_k = side.blocks["full"]
    groups_y = []
    for name, kind in draw(st.permutations(model.groups)):
        g: dict = {"name": name, "kind": kind}
        if kind == "sliding_window":
            g["window"] = 64
            if model.swa == "own":
                b, k = side.blocks[name]   # its own sizes (a group inherits the spec's kernel size)
                g["block_size"] = b
                g["kernel_block_size"] = k
        groups_y.append(g)
    nst = draw(st.integers(1, 3))
    storages = []
    for i in range(nst):
        storages.append({"name": f"{label}.s{i}", "mem": draw(st.sampled_from(("VRAM", "DRAM"))),
                         "device": draw(st.integers(0, 1)), "align": draw(st.sampled_from((1, 1, 16, 256)))})
    cursor = {s["name"]: 0 for s in storages}
    regions_y = []
    for r in model.regions:
        st_ = draw(st.sampled_from(storages))
        kind = model.kind(r.groups[0])
        kpb = 1 if kind == "mamba" else side.blocks[r.groups[0]][0] // side.blocks[r.groups[0]][1]
        cap = need[r.name] + draw(st.sampled_from((0, 0, 1, 3)))
        side.capacity[r.name] = cap
        num_blocks = cap * kpb
        bb = block_bytes[r.layout]
        ry: dict = {"name": r.name, "storage": st_["name"], "layout": r.layout, "num_blocks": num_blocks,
                    "groups": list(r.groups)}
        stride = bb
        pad = draw(st.sampled_from((0, 0, 0, 8, 100)))
        if pad:
            stride = bb + pad
            ry["block_stride"] = stride
        align = st_["align"]
        offset = -(-cursor[st_["name"]] // align) * align
        gap = draw(st.sampled_from((None, None, 0, 5, 64)))
        if gap is not None:
            step = math.lcm(align, 4)  # explicit offsets: aligned to the storage and the dtypes
            offset = -(-(cursor[st_["name"]] + gap) // step) * step
            ry["offset"] = offset
        cursor[st_["name"]] = max(cursor[st_["name"]], offset + (num_blocks - 1) * stride + bb)
        regions_y.append(ry)
    spec = {
        "kvlc": 1, "name": f"prop-{label}",
        "model": {"name": "prop/model", "num_layers": 2, "num_kv_heads": model.heads,
                  "head_dim": model.head_dim},
        "parallel": {"tp_size": side.tp},
        "block_size": full_b, "groups": groups_y, "storages": storages, "layouts": ylayouts,
        "regions": regions_y,
    }
    if full_k != full_b:
        spec["kernel_block_size"] = full_k
    side.text = yaml.safe_dump(spec, sort_keys=False)
    return side


def block_pair(draw, fixed, same_kernel_as=None):
    if fixed is not None:
        return fixed
    if same_kernel_as is not None:
        return draw(st.sampled_from([b for b in BLOCKS if b[1] == same_kernel_as]))
    return draw(st.sampled_from(BLOCKS))


@dataclass
class Case:
    model: Model
    cons: Side
    prod: Side
    tokens: dict                 # group → tokens (token groups)
    cids: dict                   # group → consumer logical ids
    pids: dict
    id_mode: str
    tokens_arg: object           # int or mapping, as given to instantiate


def fp4_fields(draw, T: DimT, Hd: DimT) -> tuple[FieldT, ...]:
    """fp4 values (two per byte along ``q4_dim``, an even size) and one block scale per group of them."""
    groups = draw(st.integers(1, 3))
    vals = FieldT("q4", "fp4_e2m1", (T, Hd, DimT("q4_dim", size=2 * groups * draw(st.integers(1, 2)))))
    scales = FieldT("q4_scale", draw(st.sampled_from(("fp8_e4m3", "ue8m0"))), (T, Hd, DimT("q4_group", size=groups)))
    return (vals, scales)


@st.composite
def pair_case(draw, tps=None, heads=None, blocks=None, kv=None, swa=None, mla=None, mamba=None,
              scale=None, id_mode=None, max_tokens=40, fp4=None) -> Case:
    """A random model, two engines for it (consumer, producer), and one request."""
    tp_c, tp_p = tps or (draw(st.sampled_from(TP_SIZES)), draw(st.sampled_from(TP_SIZES)))
    lcm_tp = math.lcm(tp_c, tp_p)
    ok_heads = [h for h in range(1, 9) if shard_ok(h, tp_c) and shard_ok(h, tp_p)]
    H = heads if heads is not None else draw(st.sampled_from(ok_heads))
    D = draw(st.integers(1, 4))
    kv = kv if kv is not None else draw(st.sampled_from(("split", "packed")))
    swa = swa if swa is not None else draw(st.sampled_from(("none", "own", "shared")))
    mla = mla if mla is not None else draw(st.booleans())
    mamba = mamba if mamba is not None else draw(st.booleans())
    scale = scale if scale is not None else draw(st.booleans())
    T, Hd, HD = DimT("token", "token"), DimT("head", "head"), DimT("head_dim")
    dt = lambda: draw(st.sampled_from(("bf16", "fp16", "fp32", "fp8_e4m3", "uint8")))  # noqa: E731
    if kv == "split":
        kv_fields = (FieldT("k", dt(), (T, Hd, HD)), FieldT("v", dt(), (T, Hd, HD)))
    else:
        kv_fields = (FieldT("kv", dt(), (DimT("kv", size=2), T, Hd, HD)),)
    attn = kv_fields + ((FieldT("scale", "fp32", (Hd, DimT("sc", size=draw(st.integers(1, 2))))),)
                        if scale else ())
    if fp4 if fp4 is not None else draw(st.booleans()):   # NVFP4/MXFP4 values + their block scales
        attn += fp4_fields(draw, T, Hd)
    groups = [("full", "full_attention")]
    layouts = [LayoutT("kv", "full", attn)]
    regions = [RegionT(f"attn.{i}", "kv", ("full",)) for i in range(draw(st.integers(1, 2)))]
    if mla:
        lat = (FieldT("latent", dt(), (T, DimT("lat", size=draw(st.integers(1, 6))))),)
        if fp4:
            lat += (FieldT("latent4", "fp4_e2m1", (T, DimT("lat4", size=2 * draw(st.integers(1, 3))))),)
        if draw(st.booleans()):
            lat += (FieldT("pe", "bf16", (DimT("pe", size=2), T)),)
        layouts.append(LayoutT("mla", "full", lat))
        regions.append(RegionT("mla.0", "mla", ("full",)))
    if swa != "none":
        groups.append(("swa", "sliding_window"))
        layouts.append(LayoutT("swkv", "swa" if swa == "own" else "full", kv_fields))
        regions.append(RegionT("swa.0", "swkv", ("swa",)))
        if swa == "shared":
            regions.append(RegionT("shared.0", "kv", ("full", "swa")))
    if mamba:
        u = lcm_tp * draw(st.integers(1, 2))
        rep = draw(st.sampled_from(((), ("B", "C"))))   # one Mamba-2 group: B and C on every rank whole
        bc = draw(st.integers(1, 3)) if rep else u       # replicated: any size, no TP need divide it
        secs = (("x", u * draw(st.integers(2, 3))), ("B", bc), ("C", bc * draw(st.integers(1, 2))))
        ok_ssm = [h for h in range(1, 9) if shard_ok(h, tp_c) and shard_ok(h, tp_p)]
        conv = FieldT("conv", dt(), (DimT("conv_tap", size=draw(st.integers(1, 3))),
                                     DimT("channel", "head", sections=secs, replicated=rep)), sections=True)
        ssm = FieldT("ssm", dt(), (DimT("ssm_head", "head", size=draw(st.sampled_from(ok_ssm))),
                                   DimT("ssm_dim", size=draw(st.integers(1, 2))),
                                   DimT("ssm_state", size=draw(st.integers(1, 3)))))
        groups.append(("mamba", "mamba"))
        layouts.append(LayoutT("mamba", "mamba", (conv, ssm)))
        regions.extend(RegionT(f"state.{i}", "mamba", ("mamba",)) for i in range(draw(st.integers(1, 2))))
    regions = draw(st.permutations(regions))
    model = Model(H, D, tuple(groups), tuple(layouts), tuple(regions), swa)

    # block sizes: the per-block field needs equal kernel tokens on both sides
    bc = block_pair(draw, blocks[0] if blocks else None)
    bp = block_pair(draw, blocks[1] if blocks else None, bc[1] if scale and not blocks else None)
    cons, prod = Side(tp_c, {"full": bc}), Side(tp_p, {"full": bp})
    for s in (cons, prod):
        s.blocks["swa"] = block_pair(draw, None) if swa == "own" else s.blocks["full"]

    # the request: tokens per group, then how many logical blocks each side needs
    tokens = {"full": draw(st.integers(1, max_tokens))}
    if swa != "none":
        tokens["swa"] = draw(st.integers(1, max_tokens))
    need_blocks = {s: {g: -(-t // s.blocks[g][0]) for g, t in tokens.items()} for s in (cons, prod)}
    for s in (cons, prod):
        if mamba:
            need_blocks[s]["mamba"] = 1
    for s, label in ((cons, "c"), (prod, "p")):
        nb = need_blocks[s]
        both = nb.get("full", 0) + nb.get("swa", 0)   # a shared region holds both groups' blocks
        need = {r.name: (both if swa == "shared" and set(r.groups) & {"full", "swa"} else nb[r.groups[0]])
                for r in regions}
        draw(side_spec(model, s, label, need))

    id_mode = id_mode or draw(st.sampled_from(("contiguous", "ascending", "arbitrary")))
    ids = {}
    for s in (cons, prod):
        nb, out = need_blocks[s], {}
        taken: set = set()
        for g in [g for g, _ in model.groups]:
            regs = [r.name for r in regions if g in r.groups]
            cap = min(s.capacity[r] for r in regs)
            free = [i for i in range(cap) if g == "mamba" or i not in taken]
            n = nb[g]
            if id_mode == "contiguous":
                start = draw(st.integers(0, len(free) - n))
                chosen = free[start:start + n]
            else:
                chosen = draw(st.permutations(free))[:n]
                if id_mode == "ascending":
                    chosen = sorted(chosen)
            if swa == "shared":
                taken |= set(chosen)
            out[g] = chosen
        ids[s] = out
    tokens_arg = tokens["full"] if len(tokens) == 1 and draw(st.booleans()) else dict(tokens)
    return Case(model, cons, prod, tokens, ids[cons], ids[prod], id_mode, tokens_arg)


# ============================================================================ reference map
def owner_table(heads: int, tp: int) -> list[range]:
    """Global heads each rank holds, by brute force over the rank's shard."""
    n = local_heads(heads, tp)
    out = []
    for r in range(tp):
        start = r * n if heads % tp == 0 else r // (tp // heads)
        out.append(range(start, start + n))
    return out


def choose_source(c: int, head: int, heads: int, ptp: int) -> int:
    """The documented rule: among producer ranks holding ``head``, the (c mod count)-th."""
    cands = [r for r, hs in enumerate(owner_table(heads, ptp)) if head in hs]
    return cands[c % len(cands)]


def kernel_ids(plan, group: str, ids) -> np.ndarray:
    g = plan.group(group)
    m = 1 if g.is_state else g.block_size // g.kernel_block_size
    return (np.asarray(ids, np.int64)[:, None] * m + np.arange(m)).ravel()


def reference(cons_plan, c: int, prod_plan, C: Engine, P: Engine, cids, pids, tokens) -> dict:
    """Byte map of consumer rank ``c`` from content coordinates.

    (producer, cmem, pmem) → (consumer bytes, producer bytes, entry): ``entry`` numbers the
    (region, group) a byte is copied for.
    """
    entry_ids: dict = {}
    ptp = prod_plan.parallel.tp_size
    ctp = cons_plan.parallel.tp_size
    acc: dict = {}
    # the producer region holding each field: by the region it is part of (part_of: split K/V) and its name
    holders = {(r.content, f.name): r for r in prod_plan.regions for f in r.fields}
    for rc in cons_plan.regions:
        for g in rc.groups:
            ck, pk = kernel_ids(cons_plan, g, cids[g]), kernel_ids(prod_plan, g, pids[g])
            for fc in rc.fields:
                rp = holders[(rc.content, fc.name)]
                fp = rp.field(fc.name)
                sizes = [d.size for d in fc.dims]
                grid = np.indices(sizes, dtype=np.int64).reshape(len(sizes), -1)
                idx = {d.name: grid[i] for i, d in enumerate(fc.dims)}
                hd = fc.dim("head")
                if hd is not None:
                    heads = hd.global_size
                    own_c = owner_table(heads, ctp)[c]
                    hglob = idx[hd.name] + own_c.start
                    table = np.array([choose_source(c, h, heads, ptp) for h in range(heads)])
                    prank = table[hglob]
                    pstart = np.array([r.start for r in owner_table(heads, ptp)])
                    phead = hglob - pstart[prank]
                else:
                    prank = np.full(grid.shape[1], c % ptp)
                    phead = None
                tok = fc.dim("token")
                if rc.is_state:
                    kc = np.arange(len(ck))[:, None]
                    kp = kc
                    ptok = None
                    keep = np.ones((len(ck), grid.shape[1]), bool)
                else:
                    # token dims count entries: tokens_per_entry tokens each (1 unless compressed)
                    per = cons_plan.group(g).tokens_per_entry
                    kt_c, kt_p = rc.block_tokens // per, rp.block_tokens // per
                    nblk = -(-tokens[g] // rc.block_tokens)
                    kc = np.arange(nblk)[:, None]
                    if tok is None:
                        kp, ptok = kc, None
                        keep = np.ones((nblk, grid.shape[1]), bool)
                    else:
                        pos = kc * kt_c + idx[tok.name][None, :]
                        keep = pos < -(-tokens[g] // per)   # a partly filled last entry moves whole
                        kp, ptok = pos // kt_p, pos % kt_p
                coff = fc.offset + sum(grid[i] * d.stride for i, d in enumerate(fc.dims))
                poff = np.full(grid.shape[1], fp.offset, np.int64)
                for d in fp.dims:
                    if d.role == "head":
                        poff = poff + phead * d.stride
                    elif d.role != "token":
                        poff = poff + idx[d.name] * d.stride
                shape = keep.shape
                cblk = np.broadcast_to(ck[np.minimum(kc, len(ck) - 1)], shape)
                pblk = np.broadcast_to(pk[np.minimum(kp, len(pk) - 1)], shape)
                poff2 = np.broadcast_to(poff, shape)
                if ptok is not None:
                    ptd = fp.dim("token")
                    poff2 = poff2 + ptok * ptd.stride
                cbase = C.bases[(c, rc.storage)] + rc.offset
                caddr = cbase + cblk * rc.block_stride + np.broadcast_to(coff, shape)
                pr = np.broadcast_to(prank, shape)
                pbase = np.array([P.bases[(p, rp.storage)] for p in range(ptp)]) + rp.offset
                paddr = pbase[pr] + pblk * rp.block_stride + poff2
                caddr, paddr, pr = caddr[keep], paddr[keep], pr[keep]
                b = np.arange(fc.itemsize)
                caddr = (caddr[:, None] + b).ravel()
                paddr = (paddr[:, None] + b).ravel()
                pr = np.repeat(pr, fc.itemsize)
                entry = entry_ids.setdefault((rc.name, rp.name, g), len(entry_ids))
                for p in np.unique(pr):
                    sel = pr == p
                    acc.setdefault((int(p), rc.mem, rp.mem), []).append(
                        (caddr[sel], paddr[sel], np.full(int(sel.sum()), entry)))
    return {k: tuple(np.concatenate([x[i] for x in v]) for i in range(3)) for k, v in acc.items()}


def expand_rows(rows: np.ndarray) -> np.ndarray:
    """Every byte address a descriptor list covers, row by row."""
    addr, n = rows[:, 0].astype(np.int64), rows[:, 1].astype(np.int64)
    if not len(n):
        return np.zeros(0, np.int64)
    start = np.repeat(np.cumsum(n) - n, n)
    return np.repeat(addr, n) + (np.arange(int(n.sum())) - start)


def minimum_from_bytes(local: np.ndarray, remote: np.ndarray, entry: np.ndarray | None = None) -> int:
    """Fewest descriptors for a byte map: sort by local byte, count breaks of contiguity.

    With ``entry``, runs may not continue from one (region, group) entry into another.
    """
    if not len(local):
        return 0
    e = np.zeros_like(local) if entry is None else entry
    o = np.lexsort((remote, local, e))
    l, r, e = local[o], remote[o], e[o]
    cont = (l[1:] == l[:-1] + 1) & (r[1:] == r[:-1] + 1) & (e[1:] == e[:-1])
    return int(len(l) - cont.sum())


def sorted_merged_count(local: np.ndarray, remote: np.ndarray) -> int:
    """Program rows sorted by local address, then merged when contiguous on both sides, same devices."""
    if not len(local):
        return 0
    o = np.lexsort((remote[:, 0], local[:, 0]))
    l, r = local[o].astype(np.int64), remote[o].astype(np.int64)
    cont = ((l[1:, 0] == l[:-1, 0] + l[:-1, 1]) & (r[1:, 0] == r[:-1, 0] + r[:-1, 1])
            & (l[1:, 2] == l[:-1, 2]) & (r[1:, 2] == r[:-1, 2]))
    return int(len(l) - cont.sum())


def storage_device(engine: Engine, rank: int, addr: np.ndarray) -> np.ndarray:
    out = np.full(len(addr), -1, np.int64)
    for s in engine.plan.storages:
        base = engine.bases[(rank, s.name)]
        out[(addr >= base) & (addr < base + s.size)] = s.device
    return out


def check_parts(parts, want: dict, id_mode: str, L: Engine, lrank: int, R: Engine) -> None:
    """Parts equal the reference map part by part, and their row counts meet the minimum.

    ``want``: (peer, local mem, remote mem) → (local bytes, remote bytes, (region, group) entry).
    """
    got = {(k.peer_rank, k.local_mem, k.remote_mem): v for k, v in parts.items()}
    assert set(got) == set(want), f"parts {sorted(got)} != reference {sorted(want)}"
    for key, part in got.items():
        assert part.local.dtype == np.uint64 and part.local.shape[1] == 3
        assert np.array_equal(part.local[:, 1], part.remote[:, 1])
        assert (part.local[:, 1] > 0).all()
        lb, rb = expand_rows(part.local), expand_rows(part.remote)
        wl, wr, we = want[key]
        o1, o2 = np.lexsort((rb, lb)), np.lexsort((wr, wl))
        assert np.array_equal(lb[o1], wl[o2]) and np.array_equal(rb[o1], wr[o2]), f"byte map of part {key}"
        peer = key[0]
        assert np.array_equal(part.local[:, 2].astype(np.int64),
                              storage_device(L, lrank, part.local[:, 0].astype(np.int64))), "local devices"
        assert np.array_equal(part.remote[:, 2].astype(np.int64),
                              storage_device(R, peer, part.remote[:, 0].astype(np.int64))), "remote devices"
        minimum = minimum_from_bytes(wl, wr)
        assert len(part) >= minimum
        assert sorted_merged_count(part.local, part.remote) == minimum, f"part {key}: sorted+merged rows"
        if id_mode in ("contiguous", "ascending"):
            per_entry = minimum_from_bytes(wl, wr, we)
            assert len(part) <= per_entry, (f"part {key}: {len(part)} descriptors, minimum within each "
                                            f"(region, group) {per_entry} ({id_mode} ids)")
            if STRICT_ACROSS_ENTRIES:
                assert len(part) == minimum, (
                    f"part {key}: {len(part)} descriptors, minimum {minimum} ({id_mode} ids): a run that "
                    f"continues from one (region, group) into another is not merged")


def execute_counting(parts, local: Engine, lrank: int, remote: Engine, direction: str, writes: dict) -> None:
    """Copy every row like ``memory_model.execute`` and count writes per destination byte."""
    for key, part in parts.items():
        for (la, n, _), (ra, _, _) in zip(part.local.tolist(), part.remote.tolist()):
            lb, lo = local.resolve(lrank, la, n)
            rb, ro = remote.resolve(key.peer_rank, ra, n)
            if direction == "READ":
                lb[lo:lo + n] = rb[ro:ro + n]
                dst, rank, off = local, lrank, lo
                buf = lb
            else:
                rb[ro:ro + n] = lb[lo:lo + n]
                dst, rank, off = remote, key.peer_rank, ro
                buf = rb
            name = next(s for s, b in dst.buffers[rank].items() if b is buf)
            cnt = writes.setdefault((rank, name), np.zeros(len(buf), np.int32))
            cnt[off:off + n] += 1


def check_geometry(plan, side: Side, model: Model) -> None:
    """The compiled plan has exactly the field offsets, sizes and strides the spec implies."""
    for r in model.regions:
        parts = [pr for pr in plan.regions if pr.content == r.name]   # one, or the parts of a split region
        want = side.fields[r.layout]
        got = {f.name: (f.offset, tuple((d.name, d.role, d.size, d.global_size, d.stride) for d in f.dims))
               for pr in parts for f in pr.fields}
        if len(parts) > 1 or parts[0].name != r.name:  # split: each part packs its fields from byte 0
            got, want = ({k: v[1] for k, v in x.items()} for x in (got, want))
        assert got == want, f"geometry of region {r.name}"
        assert all(pr.capacity == side.capacity[r.name] for pr in parts)


def run_case(case: Case) -> dict:
    """Compile, pair, instantiate, execute READ and WRITE, check everything. Returns some counts."""
    cons = kvlc.compile_spec(case.cons.text)
    prod = kvlc.compile_spec(case.prod.text)
    check_geometry(cons, case.cons, case.model)
    check_geometry(prod, case.prod, case.model)
    ctp, ptp = cons.parallel.tp_size, prod.parallel.tp_size
    P = Engine(prod, 1, True)
    stats = {"rows": 0, "bytes": 0}

    # READ: every consumer rank pulls
    C = Engine(cons, 0, False)
    for c in range(ctp):
        rep = check_pair(cons, prod, local_rank=c, direction="READ")
        assert rep.ok, rep.render()
        prog = pair(cons, prod, local_rank=c, direction="READ")
        before = {k: v.copy() for k, v in C.buffers[c].items()}
        parts = instantiate(bind(prog, C.rank_bases(c), {p: P.rank_bases(p) for p in prog.peer_ranks}),
                            case.cids, case.pids, case.tokens_arg)
        ref = reference(cons, c, prod, C, P, case.cids, case.pids, case.tokens)
        exact = instantiate(bind(prog, C.rank_bases(c), {p: P.rank_bases(p) for p in prog.peer_ranks}),
                            case.cids, case.pids, case.tokens_arg, coalesce="sort")
        for key, part in exact.items():
            wl, wr, _ = ref[(key.peer_rank, key.local_mem, key.remote_mem)]
            assert len(part) == minimum_from_bytes(wl, wr), f"part {key}: coalesce='sort' above the minimum"
        check_parts(parts, {(p, cm, pm): (cb, pb, e) for (p, cm, pm), (cb, pb, e) in ref.items()},
                    case.id_mode, C, c, P)
        writes: dict = {}
        execute_counting(parts, C, c, P, "READ", writes)
        assert all(w.max(initial=0) <= 1 for w in writes.values()), "a destination byte written twice"
        stats["bytes"] += verify(C, c, P, case.cids, case.pids, case.tokens_arg, before)
        stats["rows"] += sum(len(p) for p in parts.values())

    # WRITE: every producer rank pushes into a fresh consumer engine
    C2 = Engine(cons, 2, False)
    befores = {c: {k: v.copy() for k, v in C2.buffers[c].items()} for c in range(ctp)}
    refs = {c: reference(cons, c, prod, C2, P, case.cids, case.pids, case.tokens) for c in range(ctp)}
    writes = {}
    for p in range(ptp):
        prog = pair(prod, cons, local_rank=p, direction="WRITE")
        parts = instantiate(bind(prog, P.rank_bases(p), {c: C2.rank_bases(c) for c in prog.peer_ranks}),
                            case.pids, case.cids, case.tokens_arg)
        want = {(c, pm, cm): (pb, cb, e) for c in range(ctp) for (q, cm, pm), (cb, pb, e) in refs[c].items()
                if q == p}
        check_parts(parts, want, case.id_mode, P, p, C2)
        execute_counting(parts, P, p, C2, "WRITE", writes)
    assert all(w.max(initial=0) <= 1 for w in writes.values()), "a destination byte written twice"
    for c in range(ctp):
        verify(C2, c, P, case.cids, case.pids, case.tokens_arg, befores[c])
    return stats


# ============================================================================ the properties
@PROPS
@given(pair_case())
def test_random_pairs_move_exact_bytes(case):
    """Any valid engine pair: READ and WRITE copy each requested byte once, nothing else, in fewest rows."""
    run_case(case)


@pytest.mark.parametrize("tps,heads", [((8, 2), 2), ((2, 8), 2), ((8, 1), 1), ((1, 8), 1), ((4, 8), 2),
                                       ((3, 1), 1), ((1, 3), 1), ((3, 2), 6), ((2, 3), 6)])
@settings(PROPS, max_examples=8)
@given(data=st.data())
def test_tp_pairs(tps, heads, data):
    """Hetero TP pairs incl. GQA replication (tp > heads) in both directions and non-power-of-two TP."""
    run_case(data.draw(pair_case(tps=tps, heads=heads)))


@pytest.mark.parametrize("blocks", [((12, 12), (8, 8)), ((8, 8), (12, 12)), ((16, 16), (24, 24)),
                                    ((24, 24), (16, 16)), ((32, 16), (8, 8)), ((8, 4), (24, 8)),
                                    ((16, 8), (12, 4))])
@settings(PROPS, max_examples=8)
@given(data=st.data())
def test_block_size_pairs(blocks, data):
    """Non-divisible and kernel-block pairs (12 vs 8, 16 vs 24, block = N kernel blocks) through lcm tiles."""
    run_case(data.draw(pair_case(blocks=blocks, scale=False)))


@settings(PROPS, max_examples=30)
@given(data=st.data())
def test_hybrid_mamba_mla_swa(data):
    """Mamba sections x|B|C (B and C sharded, or replicated on every rank) + SSM, an MLA latent and a
    sliding-window group (own, shared regions) together."""
    run_case(data.draw(pair_case(mamba=True, mla=True, swa=data.draw(st.sampled_from(("own", "shared"))))))


@settings(PROPS, max_examples=30)
@given(data=st.data())
def test_ascending_ids_hit_minimum(data):
    """Ascending (allocator-order) block ids: the program's own descriptor count is the coalesced minimum."""
    run_case(data.draw(pair_case(id_mode=data.draw(st.sampled_from(("contiguous", "ascending"))))))


@settings(PROPS, max_examples=60)
@given(data=st.data())
def test_fp4_pairs_move_exact_bytes(data):
    """fp4_e2m1 fields (two values per byte, any TP, block sizes, dim orders) and their ue8m0/fp8 block scales:
    every requested byte moves once; a byte holds the same two values on both sides (check_geometry)."""
    run_case(data.draw(pair_case(fp4=True, mla=data.draw(st.booleans()))))


# ============================================================================ reproducers
TWO_LAYOUTS = """
kvlc: 1
name: two-layouts
model: {name: m, num_layers: 1}
block_size: 16
groups: [{name: full, kind: full_attention}]
storages: [{name: s, mem: VRAM}]
layouts:
  tok_major: {fields: [{name: x, dtype: bf16, dims: [{name: token, role: token}, {name: d, size: 2}]}]}
  dim_major: {fields: [{name: x, dtype: bf16, dims: [{name: d, size: 2}, {name: token, role: token}]}]}
regions:
  - {name: a, storage: s, layout: tok_major, num_blocks: 2, groups: [full]}
  - {name: b, storage: s, layout: dim_major, num_blocks: 2, groups: [full]}
"""


@pytest.mark.parametrize("direction", ["READ", "WRITE"])
def test_partial_tile_follows_each_regions_layout(direction):
    """Regions whose whole tiles copy alike but whose layouts differ: a partial tile follows each layout."""
    plan = kvlc.compile_spec(TWO_LAYOUTS)
    src, dst = Engine(plan, 1, True), Engine(plan, 0, False)
    ids, tokens = {"full": [1]}, 3
    before = {k: v.copy() for k, v in dst.buffers[0].items()}
    local, other = (dst, src) if direction == "READ" else (src, dst)
    prog = pair(plan, plan, local_rank=0, direction=direction)
    parts = instantiate(bind(prog, local.rank_bases(0), {0: other.rank_bases(0)}), ids, ids, tokens)
    writes: dict = {}
    execute_counting(parts, local, 0, other, direction, writes)
    verify(dst, 0, src, ids, ids, tokens, before)


SHARED = """
kvlc: 1
name: shared
model: {name: m, num_layers: 1}
block_size: 4
groups: [{name: full, kind: full_attention}, {name: swa, kind: sliding_window, window: 8}]
storages: [{name: s, mem: VRAM}]
layouts:
  kv: {fields: [{name: x, dtype: uint8, dims: [{name: token, role: token}]}]}
regions:
  - {name: S, storage: s, layout: kv, num_blocks: 2, groups: [full, swa]}
  - {name: R, storage: s, layout: kv, num_blocks: 1, groups: [full]}
"""


def test_runs_continuing_across_groups_merge():
    """coalesce='sort': a run continuing from one (region, group) into another merges (minimum: 1 row)."""
    plan = kvlc.compile_spec(SHARED)
    prog = pair(plan, plan, local_rank=0, direction="READ")
    ids = {"full": [0], "swa": [1]}
    parts = instantiate(bind(prog, {"s": 0}, {0: {"s": 1 << 20}}), ids, ids, 4, coalesce="sort")
    (part,) = parts.values()
    # S block 0 (full), S block 1 (swa), R block 0 (full) are bytes [0, 12) on both sides
    assert sorted(expand_rows(part.local).tolist()) == list(range(12))
    assert len(part) == 1, f"{len(part)} rows: {part.local.tolist()}"
    (fast,) = instantiate(bind(prog, {"s": 0}, {0: {"s": 1 << 20}}), ids, ids, 4).values()
    assert len(fast) <= 3 and sorted(expand_rows(fast.local).tolist()) == list(range(12))
