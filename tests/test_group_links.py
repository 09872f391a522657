"""Regions paired by layer across group layouts: a region in group G on one engine and group H on the other
(DeepSeek-V3's MTP layer in a group of its own on one side, in the main group on the other) pairs, with the
local ids of G and the remote ids of H; what cannot correspond stays refused, naming both layouts.

The property reuses the generator of ``test_pair_properties`` (random models with full attention, an MLA
latent, a sliding window of its own or shared, Mamba state; any TP, block and kernel block sizes, dim
orders, offsets, memory types) and then moves regions into new groups on either engine or both: a copy of
the region's group (same kind, window and block sizes) under another name, one or two per group. Every
request is executed READ from every consumer rank and WRITE from every producer rank on the content-coded
memory model and checked twice:

* with each new group's ids equal to those of the group it came from, each part's byte map equals the
  reference map of the engines *before* the move (which ``test_pair_properties`` proves exact and minimal),
  with descriptor counts at the coalesced minimum: moving a region to another group changes no byte;
* with fresh ids for every new group, every destination byte holds its content code and no other byte
  changes (``memory_model.verify``), and no byte is written twice: a region's ids come from its own group
  on each side.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlc
from kvlc import bind, instantiate
from kvlc.cli import main
from kvlc.compiler.pairing.pair import check_pair, pair
from kvlc.compiler.plan.model import Plan
from kvlc.demo.run import cpu_plan
from kvlc.errors import CompatError, TransferError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_model import Engine, execute, verify  # noqa: E402
from test_dcp_properties import dcp_case  # noqa: E402
from test_pair_properties import PROPS, check_parts, execute_counting, expand_rows, minimum_from_bytes  # noqa: E402
from test_pair_properties import pair_case, reference  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ROOT / "layouts"


# ============================================================================ move regions to other groups
@st.composite
def regroup(draw, text: str, label: str) -> tuple[str, dict[str, str]]:
    """``text`` with some one-group regions moved to copies of their group; returns it and new -> origin."""
    spec = yaml.safe_load(text)
    defs = {g["name"]: g for g in spec["groups"]}
    moved: dict[str, str] = {}
    for r in spec["regions"]:
        if len(r["groups"]) != 1 or not draw(st.booleans()):
            continue
        origin = r["groups"][0]
        new = f"{origin}_{label}{draw(st.integers(0, 1))}"   # two regions may move to one new group
        if new not in moved:
            spec["groups"].insert(draw(st.integers(0, len(spec["groups"]))), {**defs[origin], "name": new})
            moved[new] = origin
        r["groups"] = [new]
    return yaml.safe_dump(spec, sort_keys=False), moved


def _capacity(plan: Plan, group: str) -> int:
    return min(r.capacity for r in plan.regions if group in r.groups)


@st.composite
def fresh_ids(draw, plan: Plan, ids: dict, moved: dict[str, str]) -> dict:
    """``ids`` with ids of their own (as many as their origin's, distinct) for the new groups."""
    out = dict(ids)
    for new, origin in moved.items():
        if any(new in r.groups for r in plan.regions):
            out[new] = draw(st.permutations(range(_capacity(plan, new))))[:len(ids[origin])]
    return out


def _with_origin(value: dict, moved: dict[str, str]) -> dict:
    return {**value, **{new: value[origin] for new, origin in moved.items() if origin in value}}


def _tokens_arg(tokens, *moved: dict[str, str]):
    """The request's tokens: one value, or one per group (the new groups move what their origin moves)."""
    if not isinstance(tokens, dict):
        return tokens
    for m in moved:
        tokens = _with_origin(tokens, m)
    return tokens


MODES = (("regroup", "keep"), ("keep", "regroup"), ("regroup", "regroup"))


@settings(PROPS, max_examples=60)
@given(data=st.data())
def test_regions_in_other_groups_move_exact_bytes(data):
    """Regions moved to other groups on either engine or both, any model, TP, block sizes and dim orders:
    the same bytes as before the move with the same ids, and every byte right with ids of their own."""
    case = data.draw(pair_case(max_tokens=24))
    cmode, pmode = data.draw(st.sampled_from(MODES))
    ctext, cmoved = data.draw(regroup(case.cons.text, "c")) if cmode == "regroup" else (case.cons.text, {})
    ptext, pmoved = data.draw(regroup(case.prod.text, "p")) if pmode == "regroup" else (case.prod.text, {})
    cons0, prod0 = kvlc.compile_spec(case.cons.text), kvlc.compile_spec(case.prod.text)
    cons, prod = kvlc.compile_spec(ctext), kvlc.compile_spec(ptext)
    ctp, ptp = cons.parallel.tp_size, prod.parallel.tp_size
    tokens = _tokens_arg(case.tokens_arg, cmoved, pmoved)
    same_c, same_p = _with_origin(case.cids, cmoved), _with_origin(case.pids, pmoved)
    own_c = data.draw(fresh_ids(cons, case.cids, cmoved))
    own_p = data.draw(fresh_ids(prod, case.pids, pmoved))
    P = Engine(prod, 1, True)

    # READ from every consumer rank
    for c in range(ctp):
        rep = check_pair(cons, prod, local_rank=c, direction="READ")
        assert rep.ok, rep.render()
        prog = pair(cons, prod, local_rank=c, direction="READ")
        C = Engine(cons, 0, False)
        bound = bind(prog, C.rank_bases(c), {p: P.rank_bases(p) for p in prog.peer_ranks})
        ref = reference(cons0, c, prod0, C, P, case.cids, case.pids, case.tokens)
        check_parts(instantiate(bound, same_c, same_p, tokens), ref, case.id_mode, C, c, P)
        before = {k: v.copy() for k, v in C.buffers[c].items()}
        writes: dict = {}
        execute_counting(instantiate(bound, own_c, own_p, tokens), C, c, P, "READ", writes)
        assert all(w.max(initial=0) <= 1 for w in writes.values()), "a destination byte written twice"
        verify(C, c, P, own_c, own_p, tokens, before)

    # WRITE from every producer rank into one consumer engine
    C2 = Engine(cons, 2, False)
    befores = {c: {k: v.copy() for k, v in C2.buffers[c].items()} for c in range(ctp)}
    refs = {c: reference(cons0, c, prod0, C2, P, case.cids, case.pids, case.tokens) for c in range(ctp)}
    writes = {}
    for p in range(ptp):
        prog = pair(prod, cons, local_rank=p, direction="WRITE")
        bound = bind(prog, P.rank_bases(p), {c: C2.rank_bases(c) for c in prog.peer_ranks})
        want = {(c, pm, cm): (pb, cb, e) for c in range(ctp) for (q, cm, pm), (cb, pb, e) in refs[c].items()
                if q == p}
        check_parts(instantiate(bound, same_p, same_c, tokens), want, case.id_mode, P, p, C2)
        execute_counting(instantiate(bound, own_p, own_c, tokens), P, p, C2, "WRITE", writes)
    assert all(w.max(initial=0) <= 1 for w in writes.values()), "a destination byte written twice"
    for c in range(ctp):
        verify(C2, c, P, own_c, own_p, tokens, befores[c])


# ============================================================================ under decode context parallelism
def into_main_group(text: str) -> str:
    """A ``test_dcp_properties`` engine with its draft (MTP) region moved from group ``mtp`` into ``full`` (the
    main group, DCP-sharded) and the ``mtp`` group gone: it holds as many blocks as the main regions."""
    spec = yaml.safe_load(text)
    spec["groups"] = [g for g in spec["groups"] if g["name"] != "mtp"]
    main_blocks = next(r["num_blocks"] for r in spec["regions"] if r["groups"] == ["full"])
    for r in spec["regions"]:
        if r["groups"] == ["mtp"]:
            r.update(groups=["full"], num_blocks=main_blocks)
    return yaml.safe_dump(spec, sort_keys=False)


@settings(PROPS, max_examples=30)
@given(data=st.data())
def test_draft_layer_in_the_main_group_on_one_side_under_dcp(data):
    """A draft (MTP) layer in a group of its own (DCP-sharded or `dcp: replicated`) on one engine and in the
    main group on the other, any TP, DCP, interleave and block sizes: READ and WRITE write every destination
    byte once with its content, nothing else, in the fewest descriptors of the bytes they move."""
    case = data.draw(dcp_case(draft=True))
    moved = data.draw(st.sampled_from(("cons", "prod")))
    side = getattr(case, moved)
    side.text = into_main_group(side.text)
    ids = case.cids if moved == "cons" else case.pids
    ids.pop("mtp")
    cons, prod = kvlc.compile_spec(case.cons.text), kvlc.compile_spec(case.prod.text)
    if "name: scale" in side.text and side.draft == 2 and side.dcp > 1:
        # a per-block field: the draft layer joins a DCP-sharded main group here, the peer keeps it replicated
        rep = check_pair(cons, prod, local_rank=0, direction="READ")
        assert {f.code for f in rep.errors} == {"dcp-per-block"}, rep.render()
        return
    assert {e.link for e in pair(cons, prod, local_rank=0, direction="READ").entries} >= (
        {"full>mtp"} if moved == "cons" else {"mtp>full"})
    P, C, C2 = Engine(prod, 1, True), Engine(cons, 0, False), Engine(cons, 2, False)
    kw = case.kw()
    befores = {c: {k: v.copy() for k, v in C2.buffers[c].items()} for c in range(cons.parallel.tp_size)}
    pushed: dict = {}
    for c in range(cons.parallel.tp_size):
        prog = pair(cons, prod, local_rank=c, direction="READ")
        bound = bind(prog, C.rank_bases(c), {p: P.rank_bases(p) for p in prog.peer_ranks})
        _fewest(instantiate(bound, case.cids, case.pids, **kw, coalesce="sort"))
        before = {k: v.copy() for k, v in C.buffers[c].items()}
        writes: dict = {}
        execute_counting(instantiate(bound, case.cids, case.pids, **kw), C, c, P, "READ", writes)
        assert all(w.max(initial=0) <= 1 for w in writes.values()), "a destination byte written twice"
        verify(C, c, P, case.cids, case.pids, kw.get("num_tokens"), before, kw.get("tokens"))
    for p in range(prod.parallel.tp_size):
        prog = pair(prod, cons, local_rank=p, direction="WRITE")
        bound = bind(prog, P.rank_bases(p), {c: C2.rank_bases(c) for c in prog.peer_ranks})
        _fewest(instantiate(bound, case.pids, case.cids, **kw, coalesce="sort"))
        execute_counting(instantiate(bound, case.pids, case.cids, **kw), P, p, C2, "WRITE", pushed)
    assert all(w.max(initial=0) <= 1 for w in pushed.values()), "a destination byte written twice"
    for c in range(cons.parallel.tp_size):
        verify(C2, c, P, case.cids, case.pids, kw.get("num_tokens"), befores[c], kw.get("tokens"))


def _fewest(parts) -> None:
    """Each part (sorted and merged) has the fewest descriptors of the byte map it moves."""
    for key, part in parts.items():
        assert len(part) == minimum_from_bytes(expand_rows(part.local), expand_rows(part.remote)), f"part {key}"


# ============================================================================ what stays refused (fixtures)
INVALID = ROOT / "tests" / "fixtures" / "invalid_pairs"
CASES = sorted(p.name[:-len(".local.yaml")] for p in INVALID.glob("*.local.yaml"))
UPDATE = __import__("os").environ.get("KVLC_UPDATE_GOLDEN") == "1"


def refused(case: str) -> tuple[CompatError, str]:
    """Pair ``case``'s local (the consumer) and remote spec as a pull; the error and its text."""
    local, remote = (kvlc.compile_spec(INVALID / f"{case}.{side}.yaml") for side in ("local", "remote"))
    with pytest.raises(CompatError) as info:
        pair(local, remote, local_rank=0, direction="READ")
    return info.value, info.value.report.render_errors() + "\n"


def test_invalid_pair_fixtures_are_described():
    """Each refused pair has a local and a remote spec (line 1 says what is wrong) and a golden message."""
    assert len(CASES) >= 6
    for case in CASES:
        assert (INVALID / f"{case}.local.yaml").read_text().startswith("# Invalid pair: ")
        assert (INVALID / f"{case}.remote.yaml").exists() and (UPDATE or (INVALID / f"{case}.expected").exists())


@pytest.mark.parametrize("case", CASES)
def test_invalid_pair_message(case: str):
    """The pair is refused with exactly the golden lines: where (region), both layouts' values, the fix."""
    exc, text = refused(case)
    golden = INVALID / f"{case}.expected"
    if UPDATE:
        golden.write_text(text)
    assert text == golden.read_text()
    local, remote = (kvlc.compile_spec(INVALID / f"{case}.{side}.yaml").name for side in ("local", "remote"))
    assert text.startswith(f"cannot pair {local} with {remote}:")
    for f in exc.report.errors:
        assert f.local and f.remote, f"{case}: {f.code} gives both sides' values"
        if f.code in ("group-kind", "tokens-per-entry", "region-groups"):
            assert f.region == "layer.1" and f.fix, f"{case}: {f.code} is located and says how to fix it"
        if f.code in ("group-kind", "tokens-per-entry"):
            assert local in f.message + f.local and remote in f.message + f.remote, f"{case}: both layouts named"


# ============================================================================ a consumer's window of a full cache
def small(name: str, groups: str, layer1: str) -> Plan:
    """Two layers of K/V (2 heads x 4, 4-token blocks); layer.1 in group ``layer1``."""
    kv = "{name: %s, dtype: bf16, dims: [{name: token, role: token}, {name: head, role: head}, {name: head_dim}]}"
    return kvlc.compile_spec(f"""
kvlc: 1
name: {name}
model: {{name: m, num_layers: 2, num_kv_heads: 2, head_dim: 4}}
block_size: 4
groups: {groups}
storages: [{{name: a, mem: DRAM}}]
layouts: {{kv: {{fields: [{kv % "k"}, {kv % "v"}]}}}}
regions:
  - {{name: layer.0, storage: a, layout: kv, num_blocks: 12, groups: [full]}}
  - {{name: layer.1, storage: a, layout: kv, num_blocks: 12, groups: [{layer1}]}}
""")


FULL = "[{name: full, kind: full_attention}]"
WINDOW = "[{name: full, kind: full_attention}, {name: swa, kind: sliding_window, window: 9}]"


@pytest.mark.parametrize("direction", ["READ", "WRITE"])
@pytest.mark.parametrize("tokens", [5, 30, (8, 30), (21, 30)])
def test_consumer_window_takes_what_it_keeps_from_a_full_cache(direction, tokens):
    """layer.1 in a sliding window (9 tokens) on the consumer and in the full group on the producer: only the
    blocks the window keeps move into it (the receiver's window), layer.0 all of the range; bytes exact."""
    cons, prod = small("win", WINDOW, "swa"), small("all", FULL, "full")
    C, P = Engine(cons, 0, False), Engine(prod, 1, True)
    cids = {"full": [9, 2, 5, 11, 0, 7, 3, 1], "swa": [4, 8, 0, 6, 10, 1, 2, 3]}
    pids = {"full": [6, 1, 10, 3, 8, 0, 2, 4]}
    start, stop = tokens if isinstance(tokens, tuple) else (0, tokens)
    n = -(-stop // 4) - start // 4
    cids, pids = {g: v[:n] for g, v in cids.items()}, {g: v[:n] for g, v in pids.items()}
    arg = {"tokens": tokens} if isinstance(tokens, tuple) else {"num_tokens": tokens}
    before = {k: v.copy() for k, v in C.buffers[0].items()}
    if direction == "READ":
        prog = pair(cons, prod, local_rank=0, direction="READ")
        parts = instantiate(bind(prog, C.rank_bases(0), {0: P.rank_bases(0)}), cids, pids, **arg)
        execute(parts, C, 0, P, "READ")
    else:
        prog = pair(prod, cons, local_rank=0, direction="WRITE")
        parts = instantiate(bind(prog, P.rank_bases(0), {0: C.rank_bases(0)}), pids, cids, **arg)
        execute(parts, P, 0, C, "WRITE")
    assert {e.link for e in prog.entries} == ({"full", "swa>full"} if direction == "READ" else {"full", "full>swa"})
    kept = max(start, (stop - 9 + 1) // 4 * 4)            # the window's first kept block, in tokens
    want = ((stop - start) + (stop - kept)) * 2 * 2 * 4 * 2   # layer.0 the range, layer.1 the window; K and V
    assert verify(C, 0, P, cids, pids, None, before, tokens=(start, stop)) == want


def test_producer_window_into_a_full_cache_is_refused_both_ways():
    """The producer's sliding window cannot fill the consumer's full cache, pulled or pushed: group-kind at
    layer.1, naming both layouts and groups."""
    full, win = small("all", FULL, "full"), small("win", WINDOW, "swa")
    for local, remote, direction in ((full, win, "READ"), (win, full, "WRITE")):
        f = check_pair(local, remote, local_rank=0, direction=direction).errors
        assert [(x.code, x.region) for x in f] == [("group-kind", "layer.1")]
        assert "'all'" not in f[0].message and "of all" in f[0].message + f[0].local + f[0].remote
        assert "win group 'swa' sliding_window window=9" in (f[0].local, f[0].remote)


# ============================================================================ the checked-in DeepSeek-V3 pair
OWN, MAIN = "deepseek-v3-tp8-mtp.yaml", "deepseek-v3-tp1-mtp.yaml"   # MTP in group mtp / in group mla


def _plans(*names: str) -> list[Plan]:
    return [kvlc.compile_spec(LAYOUTS / n) for n in names]


def _ids(plan: Plan, n: int, scattered: bool) -> dict:
    return {g.name: [2 * i if scattered else i for i in range(n)] for g in plan.groups}


@pytest.mark.parametrize("consumer, producer", [(MAIN, OWN), (OWN, MAIN)])
def test_deepseek_mtp_descriptors_per_4096_token_request(consumer, producer):
    """A 4,096-token DeepSeek-V3 pull between MTP in its own group and MTP in the main group, either way:
    one descriptor per layer and 64-token block for scattered ids (62 x 64), one per layer for contiguous
    ones, 576 bf16 per token and layer (279 MiB), layer.61 with the ids of its own group on each side."""
    cons, prod = _plans(consumer, producer)
    prog = pair(cons, prod, local_rank=0, direction="READ")
    mtp = [e for e in prog.entries if e.region == "layer.61"]
    assert [(e.group, e.remote_group) for e in mtp] == ([("mla", "mtp")] if consumer == MAIN else [("mtp", "mla")])
    bases = lambda p: {s.name: ((i + 1) << 40, 0) for i, s in enumerate(p.storages)}  # noqa: E731
    bound = bind(prog, bases(cons), {0: bases(prod)})
    for scattered, rows in ((True, 62 * 64), (False, 62)):
        parts = instantiate(bound, _ids(cons, 64, scattered), _ids(prod, 64, scattered), 4096)
        assert sum(len(p) for p in parts.values()) == rows
        assert sum(p.nbytes for p in parts.values()) == 4096 * 576 * 2 * 62 == 292_552_704


@pytest.mark.parametrize("consumer, producer", [(MAIN, OWN), (OWN, MAIN)])
@pytest.mark.parametrize("direction", ["READ", "WRITE"])
def test_deepseek_mtp_bytes_exact(consumer, producer, direction):
    """The checked-in pair (scaled down to DRAM pools) moves every byte of 100 tokens right, pulled and pushed,
    layer.61 from the producer's ids of its group into the consumer's ids of its group."""
    cons, prod = (cpu_plan(LAYOUTS / n, 16 << 20) for n in (consumer, producer))
    C, P = Engine(cons, 0, False), Engine(prod, 1, True)
    ids = {"mla": [2, 0], "mtp": [5, 3]}          # other ids for layer.61 where it has a group of its own
    cids = {g.name: ids[g.name] for g in cons.groups}
    pids = {g.name: ids[g.name][::-1] for g in prod.groups}
    c_rank = 0
    before = {k: v.copy() for k, v in C.buffers[c_rank].items()}
    if direction == "READ":
        prog = pair(cons, prod, local_rank=c_rank, direction="READ")
        parts = instantiate(bind(prog, C.rank_bases(c_rank), {p: P.rank_bases(p) for p in prog.peer_ranks}),
                            cids, pids, 100)
        execute(parts, C, c_rank, P, "READ")
    else:   # every producer rank pushes the replicas it serves (one rank per consumer rank)
        for p in range(prod.parallel.tp_size):
            prog = pair(prod, cons, local_rank=p, direction="WRITE")
            parts = instantiate(bind(prog, P.rank_bases(p), {c: C.rank_bases(c) for c in prog.peer_ranks}),
                                pids, cids, 100)
            execute(parts, P, p, C, "WRITE")
    assert verify(C, c_rank, P, cids, pids, 100, before) == 100 * 576 * 2 * 62


def test_request_names_the_group_each_side_lacks():
    """A request without the remote ids of layer.61's group there: refused before any descriptor, naming the
    plan, both groups and which ids to give."""
    main_, own = _plans(MAIN, OWN)
    prog = pair(main_, own, local_rank=0, direction="READ")
    bound = bind(prog, {s.name: (1 << 40) + i * (1 << 34) for i, s in enumerate(main_.storages)},
                 {0: {s.name: (2 << 40) + i * (1 << 34) for i, s in enumerate(own.storages)}})
    with pytest.raises(TransferError, match=r"no remote block ids for group 'mtp' of plan 'deepseek-v3-tp8-mtp': "
                       r"regions in local group 'mla' are in remote group 'mtp', so a request gives local ids of "
                       r"'mla' and remote ids of 'mtp'"):
        instantiate(bound, {"mla": [0, 1]}, {"mla": [0, 1]}, 100)


def test_kvlc_pair_shows_the_group_link():
    """`kvlc pair --program` on the checked-in pair: compatible, layer.61's entry says [mla>mtp]."""
    out = CliRunner().invoke(main, ["pair", str(LAYOUTS / OWN), str(LAYOUTS / MAIN), "--program"])
    assert out.exit_code == 0, out.output
    assert "compatible, 0 error(s)" in out.output and "entry layer.61 [mla>mtp] peer=0" in out.output


def test_pairs_register_the_mtp_group_case():
    """layouts/pairs/pairs.yaml names the DeepSeek-V3 MTP pair both ways (golden programs exist)."""
    pairs = {p["name"]: p for p in yaml.safe_load((LAYOUTS / "pairs" / "pairs.yaml").read_text())["pairs"]}
    assert (pairs["deepseek-v3-mtp-group-to-main"]["producer"], pairs["deepseek-v3-mtp-group-to-main"]["consumer"]) \
        == (OWN, MAIN)
    assert (pairs["deepseek-v3-mtp-main-to-group"]["producer"], pairs["deepseek-v3-mtp-main-to-group"]["consumer"]) \
        == (MAIN, OWN)
    assert np.all([(ROOT / "tests" / "golden" / "programs" / f"deepseek-v3-mtp-{n}.{m}.txt").exists()
                   for n in ("group-to-main", "main-to-group") for m in ("pull", "push")])
