"""Plans, specs and transfer programs are deeply immutable, and a plan's digest is the sha256 of its JSON."""

from __future__ import annotations

import hashlib
import json

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

import kvlc
from kvlc.compiler.frozen import FrozenMap
from test_compiler_properties import specs  # noqa: E402  (the random valid spec strategy)
from kvlc import bind, instantiate

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LAYOUTS = ["layouts/llama-3.1-8b.yaml", "layouts/nemotron-h-8b-tp2.yaml", "layouts/deepseek-v3.2-tp8.yaml"]


def _containers(value, path="plan"):
    """Every (path, object) reachable through model fields, tuples and mappings."""
    yield path, value
    if isinstance(value, BaseModel):
        for name in type(value).model_fields:
            yield from _containers(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            yield from _containers(v, f"{path}[{i}]")
    elif isinstance(value, (dict, FrozenMap)):
        for k, v in value.items():
            yield from _containers(v, f"{path}[{k!r}]")


def _assert_deeply_frozen(root, label):
    for path, obj in _containers(root, label):
        assert not isinstance(obj, (dict, list, set, bytearray)), f"{path} is a mutable {type(obj).__name__}"


@FAST
@given(specs(), st.data())
def test_digest_is_sha256_of_json_and_mutation_raises(spec, data):
    """digest == sha256(to_json()) for random plans; no dict/list inside; every mutation attempt raises."""
    text = yaml.safe_dump(spec, sort_keys=False)
    plan = kvlc.compile_spec(text)
    assert plan.digest == hashlib.sha256(plan.to_json().encode()).hexdigest()
    _assert_deeply_frozen(plan, "plan")
    _assert_deeply_frozen(kvlc.load_spec(text), "spec")
    before = plan.to_json()
    key = data.draw(st.sampled_from(sorted(plan.model.sizes)))
    with pytest.raises(TypeError):
        plan.model.sizes[key] = 99
    with pytest.raises(Exception):
        plan.model.sizes.clear()
    region = data.draw(st.sampled_from(plan.regions))
    with pytest.raises(Exception):
        region.num_blocks = region.num_blocks + 1
    with pytest.raises(Exception):
        plan.regions[0].fields[0].dims[0].stride = 1
    with pytest.raises(Exception):
        plan.name = "other"
    assert plan.to_json() == before
    assert plan.digest == hashlib.sha256(before.encode()).hexdigest()


def test_model_copy_and_json_keep_the_digest_honest():
    """A copy with an update gets its own digest; the JSON of sizes is a plain object as before."""
    plan = kvlc.compile_spec(LAYOUTS[0])
    other = plan.model_copy(update={"name": "renamed"})
    assert other.name == "renamed" and other.digest == hashlib.sha256(other.to_json().encode()).hexdigest()
    assert other.digest != plan.digest
    assert json.loads(plan.to_json())["model"]["sizes"] == {"head": 8, "head_dim": 128}


@pytest.mark.parametrize("path", LAYOUTS)
def test_program_is_frozen(path):
    """A TransferProgram refuses field assignment, holds read-only run arrays and a frozen count map."""
    plan = kvlc.compile_spec(path)
    prog = kvlc.pair(plan, plan, local_rank=0, direction="READ")
    with pytest.raises(Exception):
        prog.local_rank = 1
    with pytest.raises(TypeError):
        prog.consumer_counts[0] = 5
    runs = prog.entries[0].runs
    with pytest.raises(ValueError):
        runs.length[0] = 1
    with pytest.raises(Exception):
        prog.entries[0].region = "x"
    digest = prog.digest
    instantiate(bind(prog, {s.name: 1 << 40 for s in plan.storages}, {0: {s.name: 2 << 40 for s in plan.storages}}),
                {g.name: [0] for g in plan.groups}, {g.name: [0] for g in plan.groups},
                     {g.name: 1 for g in plan.groups})
    assert prog.digest == digest


def test_lookups_raise_kvlc_errors_naming_valid_names():
    """Plan.region/storage/group and PlanRegion.field: a KvlcError with a did-you-mean, not StopIteration."""
    plan = kvlc.compile_spec(LAYOUTS[0])
    for call, bad, want in ((plan.region, "layer.0.k", "did you mean 'layer.0'"),
                            (plan.storage, "kv.100", "did you mean 'kv.10'"),
                            (plan.group, "ful", "did you mean 'full'"),
                            (plan.regions[0].field, "q", "valid names: 'k', 'v'")):
        with pytest.raises(kvlc.KvlcError, match=want):
            call(bad)
    with pytest.raises(kvlc.KvlcError, match="has no group 'nope'"):
        plan.group_capacity("nope")


def test_load_plan_reads_specs_and_plan_json(tmp_path):
    """kvlc.load_plan: a spec compiles, a plan JSON loads to the same plan, anything else is a SpecError."""
    plan = kvlc.load_plan(LAYOUTS[0])
    p = tmp_path / "plan.json"
    p.write_text(plan.to_json())
    assert kvlc.load_plan(p) == plan and kvlc.load_plan(str(p)).digest == plan.digest
    bad = tmp_path / "bad.json"
    bad.write_text('{"kvlc": 1}')
    with pytest.raises(kvlc.SpecError, match="not a kvlc plan"):
        kvlc.load_plan(bad)
    with pytest.raises(kvlc.SpecError, match="cannot read plan"):
        kvlc.load_plan(tmp_path / "missing.json")
