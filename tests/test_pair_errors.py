"""Pairing refuses what it cannot move, at start-up, with a code and both sides' values.

Each test crafts a pair of small specs that differ in one thing and checks the finding
code ``check_pair`` reports (never raising), that ``pair`` raises :class:`CompatError`
carrying the same report, and that requests ``instantiate`` refuses (bad block ids,
counts, groups, bases) fail with :class:`TransferError` before any descriptor exists.
"""

from __future__ import annotations

import copy

import pytest
import yaml

import kvlc
from kvlc.compiler.pairing.findings import CompatReport
from kvlc.compiler.pairing.pair import check_pair, pair
from kvlc.errors import CompatError, TransferError
from kvlc import bind, instantiate


def kv_field(name="k", dtype="bf16", order=("token", "head", "head_dim")):
    roles = {"token": {"role": "token"}, "head": {"role": "head"}}
    return {"name": name, "dtype": dtype, "dims": [{"name": d, **roles.get(d, {})} for d in order]}


def base(**over) -> dict:
    """A small valid spec: 4 KV heads x 2, two attention layers (K, V NHD), a host region."""
    spec = {
        "kvlc": 1, "name": "e",
        "model": {"name": "m", "num_layers": 2, "num_kv_heads": 4, "head_dim": 2},
        "parallel": {"tp_size": 1},
        "block_size": 4,
        "groups": [{"name": "full", "kind": "full_attention"}],
        "storages": [{"name": "gpu", "mem": "VRAM"}, {"name": "host", "mem": "DRAM"}],
        "layouts": {"kv": {"fields": [kv_field("k"), kv_field("v")]}},
        "regions": [
            {"name": "attn.0", "storage": "gpu", "layout": "kv", "num_blocks": 8, "groups": ["full"]},
            {"name": "attn.1", "storage": "gpu", "layout": "kv", "num_blocks": 8, "groups": ["full"]},
        ],
    }
    spec.update(over)
    return spec


def plan(spec: dict):
    return kvlc.compile_spec(yaml.safe_dump(spec, sort_keys=False))


def edit(spec: dict, fn) -> dict:
    out = copy.deepcopy(spec)
    fn(out)
    return out


def report(a: dict, b: dict, rank=0, direction="READ") -> CompatReport:
    return check_pair(plan(a), plan(b), local_rank=rank, direction=direction)


def findings(a: dict, b: dict, code: str, **kw):
    rep = report(a, b, **kw)
    found = [f for f in rep.findings if f.code == code]
    assert found, f"no '{code}' in {rep.render()}"
    return rep, found


def assert_refused(a: dict, b: dict, code: str, **kw):
    """check_pair lists ``code`` as an error, and pair raises CompatError carrying that report."""
    rep, found = findings(a, b, code, **kw)
    assert not rep.ok and all(f.severity == "error" for f in found)
    with pytest.raises(CompatError) as info:
        pair(plan(a), plan(b), local_rank=kw.get("rank", 0), direction=kw.get("direction", "READ"))
    assert info.value.report == rep
    assert f"[{code}]" in str(info.value)
    return found


# ============================================================================ identity
def test_same_spec_pairs_cleanly():
    """The base spec pairs with itself both ways with no finding at all."""
    for d in ("READ", "WRITE"):
        rep = report(base(), base(), direction=d)
        assert rep.ok and rep.findings == ()


def test_bad_direction_and_rank():
    """A direction other than READ/WRITE and a rank outside the local TP group are errors."""
    assert_refused(base(), base(), "direction", direction="PUSH")
    f = assert_refused(base(parallel={"tp_size": 2}), base(), "rank", rank=2)
    assert f[0].local == "2" and "[0, 2)" in f[0].fix


def test_model_name():
    """Different model names: 'model-name' with both names."""
    f = assert_refused(base(), edit(base(), lambda s: s["model"].update(name="other")), "model-name")
    assert (f[0].local, f[0].remote) == ("m", "other")


def test_model_layers():
    """Different layer counts: 'model-layers' with both counts."""
    f = assert_refused(base(), edit(base(), lambda s: s["model"].update(num_layers=3)), "model-layers")
    assert (f[0].local, f[0].remote) == ("2", "3")


def test_model_sizes():
    """A model size that differs (declared, KV heads, head_dim): 'model-size' naming it, both values."""
    f = assert_refused(edit(base(), lambda s: s["model"].update(sizes={"lat": 3})),
                       edit(base(), lambda s: s["model"].update(sizes={"lat": 5})), "model-size")
    assert "'lat'" in f[0].message and (f[0].local, f[0].remote) == ("3", "5")
    f = assert_refused(base(), edit(base(), lambda s: s["model"].update(num_kv_heads=8)), "model-size")
    assert any("'head'" in x.message for x in f)
    f = assert_refused(base(), edit(base(), lambda s: s["model"].update(head_dim=4)), "model-size")
    assert any("'head_dim'" in x.message for x in f)


def test_dcp_pairs_any_sizes():
    """Decode context parallelism on one side, both, or with different sizes and interleaves pairs."""
    dcp = lambda d, i=1: {"tp_size": 8, "dcp_size": d, **({"dcp_interleave": i} if i > 1 else {})}  # noqa: E731
    for a, b in ((dcp(2), base()), (base(), dcp(2)), (dcp(2), dcp(1)), (dcp(2, 2), dcp(2)), (dcp(1), dcp(2, 4))):
        a, b = (x if "kvlc" in x else base(parallel=x) for x in (a, b))
        assert report(a, b).ok and report(b, a, direction="WRITE").ok


def test_dcp_heads_refused_with_reason():
    """A DCP group wider than a head's replicas stores some tokens nowhere: 'dcp-heads' on that side."""
    for a, b, side in ((base(parallel={"tp_size": 4, "dcp_size": 2}), base(), "local"),
                       (base(), base(parallel={"tp_size": 8, "dcp_size": 4}), "remote")):
        f = assert_refused(a, b, "dcp-heads")
        assert getattr(f[0], side).startswith("tp_size") and "stored by no rank" in f[0].message
        assert "dcp_size <= tp_size / num_kv_heads" in f[0].fix


def test_dcp_state_pairs_by_tp():
    """Per-request state (Mamba) under DCP pairs (every DCP rank holds it whole)."""
    def mamba(s):
        s["groups"].append({"name": "m", "kind": "mamba"})
        s["layouts"]["st"] = {"fields": [{"name": "ssm", "dtype": "fp32", "dims": [{"name": "x", "size": 4}]}]}
        s["regions"].append({"name": "state.0", "storage": "gpu", "layout": "st", "num_blocks": 2, "groups": ["m"]})
    a = edit(base(parallel={"tp_size": 8, "dcp_size": 2}), mamba)
    assert report(a, edit(base(), mamba)).ok


def test_dcp_per_block_field_refused_unless_same_sharding():
    """A field without a token dim under different token sharding: 'dcp-per-block'; equal sharding pairs."""
    def scale(s):
        s["layouts"]["kv"]["fields"].append({"name": "scale", "dtype": "fp32", "dims": [{"name": "head",
                                                                                          "role": "head"}]})
    a = edit(base(parallel={"tp_size": 8, "dcp_size": 2}), scale)
    f = assert_refused(a, edit(base(), scale), "dcp-per-block")
    assert f[0].field == "scale" and "dcp_size 2" in f[0].local and "dcp_size 1" in f[0].remote
    assert report(a, edit(base(parallel={"tp_size": 4, "dcp_size": 2}), scale)).codes() == ("dcp-heads",)
    assert report(a, a).ok


def test_pp_layer_ranges():
    """Pipeline stages holding no layer in common: 'pp-layers' naming the layers each side holds."""
    f = assert_refused(base(parallel={"layers": [0, 1]}), base(parallel={"layers": [1, 2]}), "pp-layers")
    assert (f[0].message, f[0].local, f[0].remote) == ("engines hold no layer in common", "layers [0, 1)",
                                                       "layers [1, 2)")


# ============================================================================ groups
def with_swa(spec: dict, kind="sliding_window", window=64, region_group="swa") -> dict:
    g = {"name": "swa", "kind": kind}
    g.update({"window": window} if kind == "sliding_window" else {"chunk": window})

    def fn(s):
        s["groups"].append(g)
        s["regions"][1]["groups"] = [region_group]
    return edit(spec, fn)


def test_group_missing():
    """A group on one engine only that no region links to a group of the other (its one region is optional
    and absent there): 'group-missing' naming it, present vs absent. (A group whose regions are in another
    group on the other engine is linked by them: tests/test_group_links.py.)"""
    def optional_swa_layer(s):
        s["regions"][1]["optional"] = True
    one_layer = edit(base(), lambda s: s["regions"].pop())
    f = assert_refused(edit(with_swa(base()), optional_swa_layer), one_layer, "group-missing")
    assert "'swa'" in f[0].message and (f[0].local, f[0].remote) == ("present", "absent")


def test_group_kind_and_window():
    """A group of another kind, or a sliding window of another width: 'group-kind' with both."""
    f = assert_refused(with_swa(base()), with_swa(base(), kind="chunked_local"), "group-kind")
    assert "sliding_window" in f[0].local and "chunked_local" in f[0].remote
    f = assert_refused(with_swa(base()), with_swa(base(), window=128), "group-kind")
    assert "window=64" in f[0].local and "window=128" in f[0].remote


# ============================================================================ regions
def extra_region(spec: dict, optional=False) -> dict:
    r = {"name": "draft.0", "storage": "gpu", "layout": "kv", "num_blocks": 8, "groups": ["full"]}
    if optional:
        r["optional"] = True
    return edit(spec, lambda s: s["regions"].append(r))


def test_region_missing():
    """A region on one engine only: 'region-missing' naming it and the side that has it."""
    f = assert_refused(extra_region(base()), base(), "region-missing")
    assert f[0].region == "draft.0" and (f[0].local, f[0].remote) == ("present", "absent")
    f = assert_refused(base(), extra_region(base()), "region-missing")
    assert (f[0].local, f[0].remote) == ("absent", "present")


def test_optional_region_is_not_an_error():
    """A region marked optional may exist on one side only; the program skips it."""
    for a, b in ((extra_region(base(), True), base()), (base(), extra_region(base(), True))):
        for d in ("READ", "WRITE"):
            rep = report(a, b, direction=d)
            assert rep.ok, rep.render()
            prog = pair(plan(a), plan(b), local_rank=0, direction=d)
            assert {e.region for e in prog.entries} == {"attn.0", "attn.1"}


def test_region_order():
    """Common regions declared in another order: 'region-order' naming the first difference."""
    f = assert_refused(base(), edit(base(), lambda s: s["regions"].reverse()), "region-order")
    assert f[0].region == "attn.0" and "attn.1" in f[0].remote


def test_region_groups():
    """A region shared by several groups on one engine and in other groups on the other: 'region-groups' with
    both lists (no group's ids map to one group of the peer). One group on each side links them instead."""
    def shared(s):
        s["regions"][1]["groups"] = ["full", "swa"]
    f = assert_refused(edit(with_swa(base()), shared), with_swa(base()), "region-groups")
    assert f[0].region == "attn.1" and (f[0].local, f[0].remote) == ("full,swa", "swa")
    assert report(with_swa(base(), region_group="full"), with_swa(base()), direction="WRITE").ok


# ============================================================================ fields
def set_fields(spec: dict, fields: list) -> dict:
    return edit(spec, lambda s: s["layouts"]["kv"].update(fields=fields))


def test_field_set():
    """Regions that hold different fields: 'field-set' with both field lists."""
    f = assert_refused(base(), set_fields(base(), [kv_field("k")]), "field-set")
    assert f[0].region == "attn.0" and (f[0].local, f[0].remote) == ("k,v", "k")


def test_field_dtype():
    """A field of another dtype: 'field-dtype' with both dtypes."""
    f = assert_refused(base(), set_fields(base(), [kv_field("k", "fp16"), kv_field("v")]), "field-dtype")
    assert (f[0].field, f[0].local, f[0].remote) == ("k", "bf16", "fp16")


def test_field_dims():
    """A field whose dims have other names: 'field-dims' with both dim lists."""
    other = {"name": "k", "dtype": "bf16", "dims": [{"name": "token", "role": "token"},
                                                    {"name": "head", "role": "head"},
                                                    {"name": "d", "size": 2}]}
    f = assert_refused(base(), set_fields(base(), [other, kv_field("v")]), "field-dims")
    assert f[0].field == "k" and "head_dim" in f[0].local and "d" in f[0].remote.split(",")


def test_dim_role():
    """A dim that is the head axis on one side and plain on the other: 'dim-role'."""
    plain_head = {"name": "k", "dtype": "bf16", "dims": [{"name": "token", "role": "token"},
                                                         {"name": "head"}, {"name": "head_dim"}]}
    f = assert_refused(base(), set_fields(base(), [plain_head, kv_field("v")]), "dim-role")
    assert (f[0].local, f[0].remote) == ("head", "plain")


def test_dim_size():
    """A plain dim of another size, or another head count: 'dim-size' with both sizes."""
    def sc(n):
        return {"name": "scale", "dtype": "fp32", "dims": [{"name": "head", "role": "head"},
                                                            {"name": "sc", "size": n}]}
    f = assert_refused(set_fields(base(), [kv_field("k"), kv_field("v"), sc(1)]),
                       set_fields(base(), [kv_field("k"), kv_field("v"), sc(2)]), "dim-size")
    assert (f[0].field, f[0].local, f[0].remote) == ("scale", "1", "2")
    f = assert_refused(base(), edit(base(), lambda s: s["model"].update(num_kv_heads=8)), "dim-size")
    assert (f[0].local, f[0].remote) == ("4", "8")


# ============================================================================ token tiling
SSM_DIMS = [{"name": "head", "role": "head"}, {"name": "x", "size": 3}]


def test_per_block_field_across_block_sizes():
    """A per-block field (no token dim) cannot be re-tiled across kernel block sizes: 'token-tiling'."""
    scale = {"name": "scale", "dtype": "fp32", "dims": [{"name": "head", "role": "head"}]}
    a = set_fields(base(), [kv_field("k"), kv_field("v"), scale])
    b = set_fields(base(block_size=8), [kv_field("k"), kv_field("v"), scale])
    f = assert_refused(a, b, "token-tiling")
    assert f[0].field == "scale" and "4 tokens" in f[0].local and "8 tokens" in f[0].remote
    # same kernel block size (8 = 2 x 4 kernel blocks): allowed
    c = set_fields(base(block_size=8, kernel_block_size=4), [kv_field("k"), kv_field("v"), scale])
    assert report(a, c).ok


def test_state_region_vs_token_region():
    """A region that is per-request state on one engine and per-token on the other: 'token-tiling'."""
    def state(s, group):
        s["groups"].append({"name": "mamba", "kind": "mamba"})
        s["layouts"]["st"] = {"fields": [{"name": "ssm", "dtype": "fp32", "dims": SSM_DIMS}]}
        s["regions"].append({"name": "st.0", "storage": "gpu", "layout": "st", "num_blocks": 4,
                             "groups": [group]})
    f = assert_refused(edit(base(), lambda s: state(s, "mamba")), edit(base(), lambda s: state(s, "full")),
                       "token-tiling")
    assert f[0].region == "st.0" and f[0].local == "state" and f[0].remote == "4 tokens"


# ============================================================================ warnings
def test_descriptor_explosion_warns_naming_hnd():
    """NHD under heterogeneous TP: a warning (not an error) naming the head-major order that avoids it."""
    rep = report(base(parallel={"tp_size": 2}, block_size=16), base(block_size=16))
    assert rep.ok
    warn = [f for f in rep.findings if f.code == "descriptor-explosion"]
    assert warn and all(f.severity == "warning" for f in warn)
    assert "(head, token, head_dim)" in warn[0].fix and warn[0].local == "(token, head, head_dim)"
    pair(plan(base(parallel={"tp_size": 2}, block_size=16)), plan(base(block_size=16)), local_rank=0)
    hnd = set_fields(base(block_size=16), [kv_field("k", order=("head", "token", "head_dim")),
                                           kv_field("v", order=("head", "token", "head_dim"))])
    rep = report(edit(hnd, lambda s: s.update(parallel={"tp_size": 2})), hnd)
    assert rep.ok and "descriptor-explosion" not in rep.codes()
    assert "descriptor-explosion" not in report(base(block_size=16), base(block_size=16)).codes()


def test_large_tile_warns():
    """Block sizes whose lcm exceeds 4096 tokens: a 'tile-size' warning, not an error."""
    rep = report(base(block_size=100), base(block_size=99))
    assert rep.ok and "tile-size" in rep.codes()


def test_every_error_at_once():
    """The report lists every mismatch, not just the first, errors before warnings."""
    b = edit(base(), lambda s: (s["model"].update(name="x", num_layers=3), s["regions"].reverse()))
    rep = report(base(parallel={"tp_size": 4, "dcp_size": 2}), b)
    assert {"model-name", "model-layers", "dcp-heads", "region-order"} <= set(rep.codes())
    sev = [f.severity for f in rep.findings]
    assert sev == sorted(sev, key=lambda s: s != "error")


# ============================================================================ instantiate refuses
def host_spec(host_blocks=3) -> dict:
    """attn.0 on the GPU with 8 blocks, attn.1 on the host with fewer (the group's capacity)."""
    return edit(base(), lambda s: s["regions"][1].update(storage="host", num_blocks=host_blocks))


def program(spec: dict, other: dict | None = None):
    a, b = plan(spec), plan(other or spec)
    return pair(a, b, local_rank=0, direction="READ"), a, b


def bases(p):
    return {s.name: (1 << 32) * (i + 1) for i, s in enumerate(p.storages)}


@pytest.fixture
def no_descriptors(monkeypatch):
    """Fail the test if instantiate reaches descriptor building (refusals must come first)."""
    import kvlc.compiler.request.index as index_mod
    import kvlc.compiler.request.instantiate as inst_mod
    import kvlc.compiler.request.rows as rows_mod

    def boom(*a, **k):
        raise AssertionError("descriptors built before the request was refused")
    monkeypatch.setattr(rows_mod, "coalesce_rows", boom)
    monkeypatch.setattr(index_mod.ProgramIndex, "tail_runs", boom)
    monkeypatch.setattr(inst_mod, "emit", boom)
    return boom


def test_instantiate_accepts_valid_request():
    """The request used below is valid: it instantiates (a sanity check of the refusal tests)."""
    prog, a, b = program(host_spec())
    parts = instantiate(bind(prog, bases(a), {0: bases(b)}), {"full": [2, 0]}, {"full": [1, 2]}, 7)
    assert sum(len(p) for p in parts.values()) > 0


@pytest.mark.parametrize("bad", [-1, 3, 7, 8, 1 << 40])
def test_out_of_range_ids_name_smallest_region(bad, no_descriptors):
    """Ids < 0 or >= the smallest capacity of the group (3-block DRAM) are refused: region, id, capacity."""
    prog, a, b = program(host_spec())
    for side in ("local", "remote"):
        ids_l, ids_r = {"full": [0, 1]}, {"full": [0, 1]}
        (ids_l if side == "local" else ids_r)["full"] = [1, bad]
        with pytest.raises(TransferError) as info:
            instantiate(bind(prog, bases(a), {0: bases(b)}), ids_l, ids_r, 8)
        msg = str(info.value)
        assert side in msg and str(bad) in msg and "'attn.1'" in msg and "capacity 3" in msg


def test_capacity_counts_logical_blocks(no_descriptors):
    """With 2 kernel blocks per block, 8 kernel blocks hold 4 logical blocks: id 4 is refused, 3 accepted."""
    spec = base(block_size=8, kernel_block_size=4)
    prog, a, b = program(spec)
    with pytest.raises(TransferError, match="capacity 4"):
        instantiate(bind(prog, bases(a), {0: bases(b)}), {"full": [4]}, {"full": [0]}, 8)


def test_kernel_block_ids_in_range_are_accepted():
    """The largest logical id of a kernel-block spec instantiates (no off-by-one at capacity)."""
    prog, a, b = program(base(block_size=8, kernel_block_size=4))
    assert instantiate(bind(prog, bases(a), {0: bases(b)}), {"full": [3]}, {"full": [3]}, 8)


def test_remote_capacity_checked_on_remote_plan(no_descriptors):
    """Remote ids are checked against the remote plan's capacities (here smaller than the local ones)."""
    prog, a, b = program(base(), host_spec(2))
    with pytest.raises(TransferError) as info:
        instantiate(bind(prog, bases(a), {0: bases(b)}), {"full": [5]}, {"full": [2]}, 4)
    assert "remote" in str(info.value) and "capacity 2" in str(info.value)


@pytest.mark.parametrize("tokens", [0, -4])
def test_num_tokens_must_be_positive(tokens, no_descriptors):
    """A token group with num_tokens <= 0 is refused, naming the group."""
    prog, a, b = program(base())
    with pytest.raises(TransferError, match="'full'"):
        instantiate(bind(prog, bases(a), {0: bases(b)}), {"full": []}, {"full": []}, tokens)


@pytest.mark.parametrize("n_ids,tokens", [(1, 5), (3, 5), (0, 1), (2, 4)])
def test_wrong_id_count_for_tokens(n_ids, tokens, no_descriptors):
    """The number of block ids must be ceil(num_tokens / block_size) per group, on each side."""
    prog, a, b = program(base())
    ids = {"full": list(range(n_ids))}
    need = {"full": list(range(-(-tokens // 4)))}
    for l, r in ((ids, need), (need, ids)):
        with pytest.raises(TransferError, match="block ids for"):
            instantiate(bind(prog, bases(a), {0: bases(b)}), l, r, tokens)


def test_missing_group_ids(no_descriptors):
    """Block ids missing for a group the program copies are refused, naming the group."""
    prog, a, b = program(with_swa(base()))
    with pytest.raises(TransferError, match="'swa'"):
        instantiate(bind(prog, bases(a), {0: bases(b)}), {"full": [0]}, {"full": [0], "swa": [0]}, 4)
    with pytest.raises(TransferError, match="'swa'"):
        instantiate(bind(prog, bases(a), {0: bases(b)}), {"full": [0], "swa": [0]}, {"full": [0]}, 4)


def test_missing_bases(no_descriptors):
    """A storage without a base address, or a peer rank without remote bases, is refused by name."""
    prog, a, b = program(base(parallel={"tp_size": 2}), base(parallel={"tp_size": 2}))
    ids = {"full": [0]}
    local = bases(a)
    with pytest.raises(TransferError, match="'host'"):
        instantiate(bind(prog, {k: v for k, v in local.items() if k != "host"}, {0: bases(b)}), ids, ids, 4)
    with pytest.raises(TransferError, match="'gpu'"):
        instantiate(bind(prog, local, {0: {"host": 1}}), ids, ids, 4)
    prog1 = pair(a, plan(base()), local_rank=0, direction="READ")   # TP2 -> TP1: needs peer 0
    with pytest.raises(TransferError, match="peer rank 0"):
        instantiate(bind(prog1, local, {1: bases(b)}), ids, ids, 4)


def test_state_group_needs_one_block_per_side(no_descriptors):
    """A state (Mamba) group takes whole blocks; local and remote must give as many."""
    def state(s):
        s["groups"].append({"name": "mamba", "kind": "mamba"})
        s["layouts"]["st"] = {"fields": [{"name": "ssm", "dtype": "fp32", "dims": SSM_DIMS}]}
        s["regions"].append({"name": "st.0", "storage": "gpu", "layout": "st", "num_blocks": 2,
                             "groups": ["mamba"]})
    prog, a, b = program(edit(base(), state))
    with pytest.raises(TransferError, match="state blocks"):
        instantiate(bind(prog, bases(a), {0: bases(b)}), {"full": [0], "mamba": [0]},
                         {"full": [0], "mamba": [0, 1]}, 4)
    with pytest.raises(TransferError, match="capacity 2"):
        instantiate(bind(prog, bases(a), {0: bases(b)}),
                    {"full": [0], "mamba": [2]}, {"full": [0], "mamba": [0]}, 4)


def test_replicated_section_vs_split_section():
    """A one-group Mamba-2 conv state whose B and C one engine states replicated and the other split by TP:
    'dim-role' on conv.B and conv.C (the same bytes mean other channels), not a silent mix."""
    from tests.test_compile_basic import one_group_mamba

    a = kvlc.compile_spec(one_group_mamba(2))
    b = kvlc.compile_spec(one_group_mamba(2, replicated=()))
    rep = check_pair(a, b, local_rank=0, direction="READ")
    found = {(f.field, f.local, f.remote) for f in rep.findings if f.code == "dim-role"}
    assert not rep.ok and found == {("conv.B", "plain", "head"), ("conv.C", "plain", "head")}
