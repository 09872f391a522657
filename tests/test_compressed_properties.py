"""Compressed token dims (``tokens_per_entry: k``) on the content-coded memory model.

A group whose token dims hold one entry per k tokens (DeepSeek-V4's c4a / c128a caches and their
indexer) pairs with an engine of another block size, kernel block size, TP, dim order and padding
that stores the same entries. Hypothesis draws both engines and a request of N tokens; READ from
every consumer rank and WRITE from every producer rank copy exactly the ``ceil(N / k)`` entries the
tokens occupy (the partly filled last entry whole), every destination byte holds its content code,
nothing else is written, and each part's descriptors are the independent minimum
(``test_pair_properties.run_case``). An uncompressed group of the same engines moves alongside.
Different k on the two engines, and block sizes that are not whole entries, are refused.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlc
from kvlc.compiler.pairing.pair import check_pair, pair
from kvlc.errors import SpecError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_model import Engine, execute, verify  # noqa: E402
from test_pair_properties import PROPS, Case, Model, Side, run_case, shard_ok  # noqa: E402
from kvlc import bind, instantiate

ROOT = Path(__file__).resolve().parents[1]
ITEM = {"fp8_e4m3": 1, "bf16": 2, "fp32": 4, "uint8": 1}


@st.composite
def content(draw, heads: bool, dtype: str) -> tuple:
    """What a layout holds (the same on both engines): K/V-like entries, maybe a per-entry fp32 scale."""
    kv = ("kv", dtype, (("entry", "token", None), ("d", "", draw(st.integers(1, 3))))
          + ((("head", "head", None),) if heads else ()))
    return (kv,) + ((("scale", "fp32", (("entry", "token", None),)),) if draw(st.booleans()) else ())


@st.composite
def side_layout(draw, fields: tuple) -> dict:
    """One engine's way of storing ``fields``: field order, dim orders, padding (bytes added by _fix_sizes)."""
    out = []
    for name, dtype, dims in draw(st.permutations(fields)):
        ys = [{"name": n, **({"role": r} if r else {}), **({"size": z} if z else {})} for n, r, z in dims]
        out.append({"name": name, "dtype": dtype, "dims": list(draw(st.permutations(ys)))})
    lay: dict = {"fields": out}
    pad = draw(st.sampled_from((0, 0, 4, 64)))
    if pad:
        lay["size"] = pad
    return lay


def spec_text(label: str, tp: int, heads: int, k: int, cmp: tuple[int, int], full: int, need: dict,
              layouts: dict, extra: dict) -> str:
    """One engine: group ``cmp`` (k tokens per entry, its own block/kernel sizes), group ``full`` (k=1)."""
    block, kernel = cmp
    groups = [{"name": "cmp", "kind": "full_attention", "tokens_per_entry": k, "block_size": block,
               "kernel_block_size": kernel}, {"name": "full", "kind": "full_attention"}]
    regions = []
    for name, group, layout in (("c.0", "cmp", "lc"), ("c.1", "cmp", "lc"), ("f.0", "full", "lf")):
        per = block // kernel if group == "cmp" else 1
        regions.append({"name": name, "storage": "s", "layout": layout, "num_blocks": (need[group] + extra[name]) * per,
                        "groups": [group]})
    return yaml.safe_dump({
        "kvlc": 1, "name": f"cmp-{label}", "model": {"name": "m", "num_layers": 1, "num_kv_heads": heads},
        "parallel": {"tp_size": tp}, "block_size": full, "groups": groups,
        "storages": [{"name": "s", "mem": "VRAM", "align": 16}], "layouts": layouts, "regions": regions},
        sort_keys=False)


def _fix_sizes(layouts: dict, tp: int, heads: int, entries: dict) -> dict:
    """Turn each drawn padding into ``size = field bytes + padding`` for this engine's sizes."""
    out = {}
    for name, lay in layouts.items():
        n = entries[name]
        total = 0
        for f in lay["fields"]:
            count = ITEM[f["dtype"]]
            for d in f["dims"]:
                count *= n if d.get("role") == "token" else (heads // tp if heads % tp == 0 else 1) \
                    if d.get("role") == "head" else d["size"]
            total += count
        lay = dict(lay)
        if "size" in lay:
            lay["size"] = total + lay["size"]
        out[name] = lay
    return out


@st.composite
def compressed_case(draw, k=None, id_mode=None) -> Case:
    k = k if k is not None else draw(st.sampled_from((1, 2, 3, 4, 8)))
    tps = (draw(st.sampled_from((1, 2, 3))), draw(st.sampled_from((1, 2, 3))))
    heads = draw(st.sampled_from([h for h in (1, 2, 3, 6) if all(shard_ok(h, t) for t in tps)]))
    lc = draw(content(heads=draw(st.booleans()), dtype=draw(st.sampled_from(sorted(ITEM)))))
    lf = draw(content(heads=True, dtype="bf16"))
    tokens = draw(st.integers(1, 60))
    id_mode = id_mode or draw(st.sampled_from(("ascending", "arbitrary")))
    sides, ids = [], []
    for label, tp in zip(("c", "p"), tps):
        entries_per_kernel = draw(st.integers(1, 4))
        kernel = k * entries_per_kernel
        cmp = (kernel * draw(st.sampled_from((1, 1, 2))), kernel)
        full = draw(st.sampled_from((4, 6, 8)))
        need = {"cmp": -(-tokens // cmp[0]), "full": -(-tokens // full)}
        extra = {r: draw(st.integers(0, 2)) for r in ("c.0", "c.1", "f.0")}
        layouts = _fix_sizes({"lc": draw(side_layout(lc)), "lf": draw(side_layout(lf))}, tp, heads,
                             {"lc": entries_per_kernel, "lf": full})
        side = Side(tp, {"cmp": cmp, "full": (full, full)},
                    spec_text(label, tp, heads, k, cmp, full, need, layouts, extra))
        caps = {"cmp": need["cmp"] + min(extra["c.0"], extra["c.1"]), "full": need["full"] + extra["f.0"]}
        chosen = {}
        for g in ("cmp", "full"):
            pick = draw(st.permutations(range(caps[g])))[:need[g]]
            chosen[g] = sorted(pick) if id_mode == "ascending" else list(pick)
        sides.append(side)
        ids.append(chosen)
    model = Model(heads=heads, head_dim=1, groups=(("cmp", "full_attention"), ("full", "full_attention")),
                  layouts=(), regions=(), swa="none")
    return Case(model, sides[0], sides[1], {"cmp": tokens, "full": tokens}, ids[0], ids[1], id_mode, tokens)


def _entries_geometry(text: str) -> None:
    """Token dims of the compressed regions hold kernel_block_size / k entries; block sizes stay tokens."""
    plan = kvlc.compile_spec(text)
    g = plan.group("cmp")
    for r in plan.regions:
        if "cmp" in r.groups:
            assert (r.block_tokens, r.tokens_per_entry) == (g.kernel_block_size, g.tokens_per_entry)
            for f in r.fields:
                assert f.dim("token").size == g.kernel_block_size // g.tokens_per_entry == r.block_entries


@settings(PROPS, max_examples=150)
@given(compressed_case())
def test_compressed_pairs_move_exact_entries(case):
    """Any k, block and kernel sizes, TP, dim order: exactly ceil(N/k) entries per group, in fewest rows."""
    _entries_geometry(case.cons.text)
    _entries_geometry(case.prod.text)
    stats = run_case(case)
    assert stats["bytes"] > 0


@settings(PROPS, max_examples=40)
@given(data=st.data())
def test_compressed_ascending_ids_hit_minimum(data):
    """Allocator-order ids with k = 4 and k = 128-like ratios: the program's own rows are the minimum."""
    run_case(data.draw(compressed_case(k=data.draw(st.sampled_from((4, 8))), id_mode="ascending")))


# ============================================================================ checked-in layouts
_SMALL: dict = {}


def _plans():
    """The checked-in pair with 8 (block 256) and 16 (block 128) blocks per region: same geometry, small buffers."""
    if not _SMALL:
        for key, name, blocks in (("big", "deepseek-v4-example-b256.yaml", 1024),
                                  ("small", "deepseek-v4-example-b128-tp2.yaml", 2048)):
            text = (ROOT / "layouts" / name).read_text()
            assert f"num_blocks: {blocks}," in text
            _SMALL[key] = kvlc.compile_spec(text.replace(f"num_blocks: {blocks},", f"num_blocks: {blocks // 128},"))
    return _SMALL["big"], _SMALL["small"]


@pytest.mark.parametrize("tokens", [1, 3, 4, 5, 127, 128, 129, 256, 300, 511])
def test_request_moves_ceil_tokens_over_k_entries(tokens):
    """N tokens move ceil(N/4) c4a and indexer entries and ceil(N/128) c128a entries, each byte exact."""
    big, small = _plans()
    prog = pair(small, big, local_rank=1, direction="READ")
    src, dst = Engine(big, 1, True), Engine(small, 0, False)
    nb = {"c4a": -(-tokens // 256), "c4a_indexer": -(-tokens // 256), "c128a": -(-tokens // 256)}
    ns = {g: -(-tokens // 128) for g in nb}
    rids = {g: list(range(3, 3 + n)) for g, n in nb.items()}
    lids = {g: list(range(n))[::-1] for g, n in ns.items()}
    before = {k: v.copy() for k, v in dst.buffers[1].items()}
    parts = instantiate(bind(prog, dst.rank_bases(1), {0: src.rank_bases(0)}), lids, rids, tokens)
    moved = sum(p.nbytes for p in parts.values())
    c4, c128 = -(-tokens // 4), -(-tokens // 128)
    assert moved == 2 * c4 * 584 + 2 * c4 * 132 + 2 * c128 * 584   # two c4a layers, two c128a layers
    execute(parts, dst, 1, src, "READ")
    assert verify(dst, 1, src, lids, rids, tokens, before) == moved


def test_checked_in_pages_are_vllms():
    """Block 256: c4a 64 entries (37376 bytes, page 37440), c128a 2 (1168, page 1728), indexer 64 x 132 (8640)."""
    big, small = _plans()
    got = {r.name: (r.block_entries, r.block_bytes, sum(f.nbytes for f in r.fields)) for r in big.regions[:3]}
    assert got == {"layer.0": (64, 37440, 37376), "layer.0.indexer": (64, 8640, 8448), "layer.2": (64, 37440, 37376)}
    assert (big.region("layer.1").block_entries, big.region("layer.1").block_bytes) == (2, 1728)
    assert [r.block_entries for r in small.regions[:2]] == [32, 32] and small.region("layer.1").block_entries == 1


# ============================================================================ refusals
SPEC = """
kvlc: 1
name: {name}
model: {{name: m, num_layers: 1}}
block_size: {block}
groups: [{{name: c, kind: indexer, tokens_per_entry: {k}}}]
storages: [{{name: s, mem: VRAM}}]
layouts:
  idx: {{fields: [{{name: key, dtype: fp8_e4m3, dims: [{{name: entry, role: token}}, {{name: d, size: 4}}]}}]}}
regions: [{{name: r, storage: s, layout: idx, num_blocks: 4, groups: [c]}}]
"""


def test_different_tokens_per_entry_is_refused_with_both_values():
    """k = 4 against k = 2 (the same block bytes!) is an error finding naming both, never a program."""
    a = kvlc.compile_spec(SPEC.format(name="a", block=16, k=4))
    b = kvlc.compile_spec(SPEC.format(name="b", block=8, k=2))
    assert a.regions[0].block_bytes == b.regions[0].block_bytes == 16
    rep = check_pair(a, b, local_rank=0, direction="READ")
    (f,) = [f for f in rep.findings if f.code == "tokens-per-entry"]
    assert (f.severity, f.local, f.remote) == ("error", "tokens_per_entry 4", "tokens_per_entry 2")
    assert "compresses tokens differently" in f.message and f.fix
    with pytest.raises(kvlc.errors.CompatError):
        pair(a, b, local_rank=0, direction="READ")


@pytest.mark.parametrize("block,k", [(6, 4), (64, 128), (12, 8)])
def test_block_size_not_whole_entries_is_located(block, k):
    """A block size that is not a multiple of k is refused at groups[0].tokens_per_entry."""
    with pytest.raises(SpecError) as info:
        kvlc.compile_spec(SPEC.format(name="a", block=block, k=k))
    (p,) = info.value.problems
    assert p.path == ("groups", 0, "tokens_per_entry")
    assert f"block size {block} is not a whole number of {k}-token entries" in p.what
    assert p.fix.startswith(f"use a block size of {-(-block // k) * k}")


def test_plans_without_compression_leave_the_field_out():
    """k = 1 is not in the plan's JSON (digests of existing plans unchanged); k > 1 is, and round-trips."""
    plain = kvlc.compile_spec(ROOT / "layouts" / "llama-3.1-8b.yaml")
    assert "tokens_per_entry" not in plain.to_json()
    big, _ = _plans()
    assert '"tokens_per_entry":4' in big.to_json()
    assert type(big).from_json(big.to_json()) == big
    assert np.array_equal([g.entries_for(9) for g in big.groups], [3, 3, 1])


HEADS = """
kvlc: 1
name: h{tp}
model: {{name: m, num_layers: 1, num_kv_heads: 4, head_dim: 8}}
parallel: {{tp_size: {tp}}}
block_size: 32
groups: [{{name: c, kind: full_attention, tokens_per_entry: {k}}}]
storages: [{{name: s, mem: VRAM}}]
layouts:
  kv: {{fields: [{{name: k, dtype: bf16, dims: [{{name: entry, role: token}}, {{name: head, role: head}},
                                           {{name: head_dim}}]}}]}}
regions: [{{name: r, storage: s, layout: kv, num_blocks: 4, groups: [c]}}]
"""


@pytest.mark.parametrize("k,warned", [(1, True), (4, True), (16, True), (32, False)])
def test_descriptor_explosion_counts_entries(k, warned):
    """Token-major heads across TP: about one run per entry of the tile is warned (not per token)."""
    one, two = kvlc.compile_spec(HEADS.format(tp=1, k=k)), kvlc.compile_spec(HEADS.format(tp=2, k=k))
    rep = check_pair(one, two, local_rank=0, direction="READ")
    assert rep.ok
    assert ("descriptor-explosion" in {f.code for f in rep.findings}) == warned


def _range_bytes(start: int, stop: int) -> int:
    """Independent count: every entry holding a token of [start, stop) moves whole (584 / 132 bytes)."""
    c4 = -(-stop // 4) - start // 4
    c128 = -(-stop // 128) - start // 128
    return 2 * c4 * (584 + 132) + 2 * c128 * 584


@settings(PROPS, max_examples=60)
@given(st.integers(0, 700), st.integers(1, 300), st.sampled_from(("READ", "WRITE")), st.booleans())
def test_token_ranges_move_the_entries_they_touch(start, length, direction, big_receives):
    """tokens=(start, stop) at any offsets: entries [start // k, ceil(stop / k)) move, each byte exact,
    nothing else written (the receiver's entries before start stay), both block sizes, both directions."""
    stop = start + length
    big, small = _plans()
    recv, send = (big, small) if big_receives else (small, big)
    R, S = Engine(recv, 0, False), Engine(send, 1, True)
    span = lambda p: list(range(start // p.group("c4a").block_size, -(-stop // p.group("c4a").block_size)))  # noqa
    rids = {g: span(recv) for g in ("c4a", "c4a_indexer", "c128a")}
    sids = {g: [i + 1 for i in span(send)] for g in rids}
    rrank = recv.parallel.tp_size - 1
    before = {k: v.copy() for k, v in R.buffers[rrank].items()}
    moved = 0
    if direction == "READ":
        prog = pair(recv, send, local_rank=rrank, direction="READ")
        parts = instantiate(bind(prog, R.rank_bases(rrank), {p: S.rank_bases(p) for p in prog.peer_ranks}),
                            rids, sids,
                                 tokens=(start, stop))
        execute(parts, R, rrank, S, "READ")
        moved = sum(p.nbytes for p in parts.values())
    else:
        for p in range(send.parallel.tp_size):
            prog = pair(send, recv, local_rank=p, direction="WRITE")
            parts = instantiate(bind(prog, S.rank_bases(p), {c: R.rank_bases(c) for c in prog.peer_ranks}),
                                sids, rids,
                                     tokens=(start, stop))
            execute(parts, S, p, R, "WRITE")
            moved += sum(part.nbytes for key, part in parts.items() if key.peer_rank == rrank)
    assert moved == _range_bytes(start, stop)
    assert verify(R, rrank, S, rids, sids, None, before, tokens=(start, stop)) == moved
