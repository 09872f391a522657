"""`kvlc init --engine vllm --backend CPU_ATTN` and `kvlc from-vllm` state the attention ISA vLLM picks.

vLLM 0.32's CPU kernels order a block by ISA (docs/vllm.md, "Limits"); `amx` (bf16 on a host with AMX
tiles, blocks a multiple of 32) moves tokens in entries of 16, so its plan differs from a `vec` one. Offline,
`--cpu-isa auto` picks as vLLM does on the host running the command; these tests set that host's flags both
ways, so they hold on hosts with and without AMX (tests/engines/test_cpu_layout.py proves the choice equals
vLLM's own function).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvlc.cli import main as cli
from kvlc.compiler import compile_spec
from kvlc.engines.vllm.derive import cpu
from kvlc.engines.vllm.derive.offline import published_view
from kvlc.engines.vllm.derive.spec import derive_plan
from kvlc.init import EngineOptions, InitError, init_spec, init_yaml

ROOT = Path(__file__).resolve().parent
QWEN2 = json.loads((ROOT / "fixtures" / "configs" / "qwen2-7b.config.json").read_text())
FALCON_H1 = json.loads((ROOT / "fixtures" / "configs" / "falcon-h1-7b.config.json").read_text())
CPU = dict(engine="vllm", backend="CPU_ATTN", mem="DRAM", num_blocks=8, model_name="m", name="n")


@pytest.fixture(params=[False, True], ids=["host-vec", "host-amx"])
def host_amx(request, monkeypatch):
    """This host's CPU flags, with and without AMX tiles (the rest as they are)."""
    flags = cpu.host_flags() - {"amx_tile", "amx_bf16", "amx_int8"}
    flags |= {"amx_tile", "amx_bf16"} if request.param else set()
    monkeypatch.setattr(cpu, "host_flags", lambda: flags)
    return request.param


def _entries(plan) -> set[int]:
    return {g.tokens_per_entry for g in plan.groups if not g.is_state}


@pytest.mark.parametrize("kv_dtype, block", [("bf16", 32), ("bf16", 128), ("fp32", 32), ("fp16", 64)])
def test_auto_writes_the_isa_vllm_picks_on_this_host(host_amx, kv_dtype, block):
    """auto: bf16 at a block multiple of 32 is amx (entries of 16) exactly where the host has AMX; fp16/fp32
    never; the plan is the adapter's for that ISA, digest for digest, and the header says which."""
    opts = EngineOptions(**CPU, kv_dtype=kv_dtype, block_size=block)
    isa = "amx" if host_amx and kv_dtype == "bf16" else "vec"
    plan = compile_spec(init_yaml(QWEN2, opts))
    assert _entries(plan) == {16 if isa == "amx" else 1}
    view = published_view(QWEN2, "m", backend="CPU_ATTN", block_size=block, num_blocks=8, kv_dtype=kv_dtype,
                          cpu_isa=isa)
    assert plan.digest == derive_plan(view).model_copy(update={"name": "n"}).digest
    head = init_yaml(QWEN2, opts).splitlines()[0]
    assert ("CPU attention ISA amx, tokens in entries of 16" in head) == (isa == "amx")
    assert "(--cpu-isa auto: as vLLM picks on this host)" in head


def test_an_isa_named_is_written_whatever_the_host(host_amx):
    """--cpu-isa amx / vec describe an engine on another host: the same spec on hosts with and without AMX."""
    amx = compile_spec(init_yaml(QWEN2, EngineOptions(**CPU, block_size=32, cpu_isa="amx")))
    vec = compile_spec(init_yaml(QWEN2, EngineOptions(**CPU, block_size=32, cpu_isa="vec")))
    assert _entries(amx) == {16} and _entries(vec) == {1}
    assert init_yaml(QWEN2, EngineOptions(**CPU, block_size=32, cpu_isa="amx")).splitlines()[0].endswith(
        "CPU attention ISA amx, tokens in entries of 16.")


def test_a_hybrids_attention_groups_take_the_isa(host_amx):
    """Falcon-H1 (bf16, the pool's block grown to hold a state, a multiple of 32): its attention group moves
    entries of 16 where the host has AMX; its Mamba group holds states, no tokens."""
    plan = compile_spec(init_yaml(FALCON_H1, EngineOptions(**CPU)))
    full = next(g for g in plan.groups if g.name == "full")
    assert full.block_size % 32 == 0 and full.tokens_per_entry == (16 if host_amx else 1)
    assert next(g for g in plan.groups if g.is_state).tokens_per_entry == 1


@pytest.mark.parametrize("opts, message", [
    (dict(**CPU, block_size=32, kv_dtype="fp32", cpu_isa="amx"),
     "--cpu-isa 'amx': vLLM 0.32 picks vec for a fp32 cache of 32-token blocks and head size 128"),
    (dict(**CPU, block_size=32, cpu_isa="vec16"), "fix: --cpu-isa auto (this host) or amx / vec"),
    (dict(engine="vllm", backend="FLASH_ATTN", cpu_isa="amx"),
     "--cpu-isa amx: only vLLM's CPU_ATTN backend has a CPU attention ISA (--backend FLASH_ATTN); fix: drop"),
    (dict(cpu_isa="amx"), "--cpu-isa amx: only vLLM's CPU_ATTN backend has a CPU attention ISA (--engine kvlc)"),
])
def test_an_isa_vllm_never_picks_for_the_options_is_refused_naming_the_option(opts, message):
    with pytest.raises(InitError) as exc:
        init_spec(QWEN2, EngineOptions(**opts))
    assert message in str(exc.value)


def test_from_vllm_offline_writes_inits_isa(tmp_path, host_amx):
    """`kvlc from-vllm` (offline) takes --cpu-isa as init does: auto follows the host, a named one is kept, one
    vLLM never picks is refused (exit 2, the option named); --from-engine refuses it (the engine's own counts)."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(QWEN2))
    run = lambda *a: CliRunner().invoke(cli, ["from-vllm", str(d), "--block-size", "32", "--num-blocks", "8", *a])  # noqa: E731
    for args, entry in (((), 16 if host_amx else 1), (("--cpu-isa", "amx"), 16), (("--cpu-isa", "vec"), 1)):
        res = run(*args)
        assert res.exit_code == 0, res.output
        assert _entries(compile_spec(res.output)) == {entry}
    res = run("--cpu-isa", "amx", "--kv-dtype", "fp32")
    assert res.exit_code != 0 and "--cpu-isa 'amx': vLLM 0.32 picks vec" in res.output
    res = run("--cpu-isa", "amx", "--from-engine")
    assert res.exit_code != 0 and "--from-engine --cpu-isa amx" in res.output and "fix: drop --cpu-isa" in res.output
