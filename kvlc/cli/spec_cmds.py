"""``kvlc compile | check | render | init | schema``: specs in, plans and specs out."""

from __future__ import annotations

import sys

import click

from kvlc.cli.base import (EXIT_SPEC, Choice, _config_opt, _echo_json, _fail, _load_plan, _overrides, _set_opt,
                           emit, main, write_atomic)
from kvlc.compiler import compile_spec
from kvlc.compiler.spec.schema import schema_json
from kvlc.compiler.spec.source import load_config, parse_yaml, rendered_name
from kvlc.compiler.spec.template import render_template
from kvlc.compiler.spec.validate import validate
from kvlc.engines.vllm.derive.cpu import ISA_CHOICES
from kvlc.engines.vllm.derive.state import SSM_CACHE_DTYPES   # vLLM's choices, one list
from kvlc.errors import KvlcError
from kvlc.explain.docs import check_doc, problem_doc
from kvlc.compiler.spec.dtypes import DTYPE_SIZES
from kvlc.engines.vllm.derive.offline import ATTENTION_BACKENDS, MLA_BACKENDS
from kvlc.init import ENGINES, EngineOptions, InitError, default_block_size, init_checked, init_spec
from kvlc.init.ds_mla import DS_MLA


@main.command()
@click.argument("spec", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the plan JSON here.")
@click.option("--text", is_flag=True, help="Print the one-line-per-region text form instead of JSON.")
@_config_opt
@_set_opt
def compile(spec: str, output: str | None, text: bool, config: str | None, sets: tuple[str, ...]) -> None:
    """Compile SPEC into a plan (canonical JSON; its sha256 digest goes to stderr)."""
    try:
        plan = _load_plan(spec, config, sets)
    except KvlcError as exc:
        _fail(exc)
    body = plan.text() if text else plan.to_json() + "\n"
    if output:
        write_atomic(output, body)
        click.echo(f"{output}: {len(plan.regions)} regions, digest {plan.digest}", err=True)
    else:
        click.echo(body, nl=False)
        click.echo(f"digest {plan.digest}", err=True)


@main.command()
@click.argument("specs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@_config_opt
@_set_opt
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document: per spec ok and digest, or problems.")
def check(specs: tuple[str, ...], config: str | None, sets: tuple[str, ...], as_json: bool) -> None:
    """Check one or more specs; print every problem found (exit 2 if any)."""
    if as_json:
        _check_json(specs, config, sets)
        return
    failed = 0
    for spec in specs:
        try:
            plan = _load_plan(spec, config, sets)
        except KvlcError as exc:
            failed += 1
            click.echo(str(exc), err=True)
            continue
        click.echo(f"{spec}: ok, {len(plan.regions)} regions, digest {plan.digest[:16]}")
    if failed:
        click.echo(f"kvlc: {failed} of {len(specs)} spec(s) have problems", err=True)
        sys.exit(EXIT_SPEC)


def _check_json(specs: tuple[str, ...], config: str | None, sets: tuple[str, ...]) -> None:
    """``kvlc check --json``: the same checks, as one document on stdout (exit 2 if any failed)."""
    results = []
    for spec in specs:
        try:
            plan = _load_plan(spec, config, sets)
        except KvlcError as exc:
            problems = getattr(exc, "problems", None)
            results.append({"spec": spec, "ok": False, "problems": [problem_doc(p) for p in problems]
                            if problems else [{"what": str(exc)}]})
            continue
        results.append({"spec": spec, "ok": True, "plan": plan.name, "regions": len(plan.regions),
                        "digest": plan.digest})
    doc = check_doc(results)
    _echo_json(doc)
    if not doc["ok"]:
        sys.exit(EXIT_SPEC)


@main.command()
@click.argument("template", type=click.Path(exists=True, dir_okay=False))
@_config_opt
@_set_opt
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the YAML here.")
def render(template: str, config: str | None, sets: tuple[str, ...], output: str | None) -> None:
    """Render a .yaml.j2 TEMPLATE with a model config into concrete YAML (validated first)."""
    try:
        cfg, ovr = _overrides(sets, config)
        text = render_template(template, cfg, ovr)
        source = parse_yaml(text, rendered_name(template))
        spec = validate(source)
        spec._source = source
        compile_spec(spec)
    except KvlcError as exc:
        _fail(exc)
    emit(text, output)

def _layer_window(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    start, sep, stop = text.partition(":")
    if not sep or not start.strip().isdigit() or not stop.strip().isdigit():
        raise InitError(f"--layers {text!r}: expected START:STOP, e.g. --layers 0:40 (layers [0, 40))")
    return int(start), int(stop)


INIT_ENGINES = [*ENGINES, "vllm"]
INIT_BACKENDS = [*(b for e in ENGINES.values() for b in e), *sorted(ATTENTION_BACKENDS), *sorted(MLA_BACKENDS)]
INIT_KV_DTYPES = [*DTYPE_SIZES, DS_MLA]


@main.command("init")
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
@click.option("--engine", type=Choice(INIT_ENGINES), default="kvlc", show_default=True,
              help="Engine whose cache shapes to use.")
@click.option("--backend", type=Choice(INIT_BACKENDS), default="paged-nhd", show_default=True,
              help="The engine's attention backend: engine kvlc's are lower case (paged-nhd ...), engine vllm's "
                   "upper case (FLASH_ATTN ..., MLA ones for MLA models).")
@click.option("--tp-size", type=int, default=1, show_default=True)
@click.option("--pp-size", type=int, default=1, show_default=True, help="Pipeline stages (even split).")
@click.option("--pp-rank", type=int, default=0, show_default=True, help="This engine's pipeline stage.")
@click.option("--layers", "layers", metavar="START:STOP", help="This stage's layers [START, STOP) (instead of --pp-*).")
@click.option("--pcp-size", type=int, default=1, show_default=True,
              help="Prefill context parallel ranks (vLLM's prefill_context_parallel_size): tp x pcp ranks.")
@click.option("--dcp-size", type=int, default=1, show_default=True, help="Decode context parallel ranks.")
@click.option("--dcp-interleave", type=int, default=1, show_default=True,
              help="Tokens a DCP rank stores in a row (vLLM's cp_kv_cache_interleave_size).")
@click.option("--block-size", type=int, default=None,
              help="Tokens per scheduler block (default: the engine's own: 128 on vLLM's CPU_ATTN, else 16).")
@click.option("--kernel-block-size", type=int, default=None, help="Tokens per attention-kernel block.")
@click.option("--kv-dtype", type=Choice(INIT_KV_DTYPES), default="bf16", show_default=True,
              help="K/V (or MLA latent) dtype; fp8_ds_mla: vLLM's packed MLA record.")
@click.option("--mem", type=Choice(["VRAM", "DRAM"]), default="VRAM", show_default=True)
@click.option("--device", type=int, default=0, show_default=True)
@click.option("--num-blocks", type=int, default=4096, show_default=True, help="Blocks per full-attention region.")
@click.option("--sliding-blocks", type=int, default=None, help="Blocks per sliding-window region (default: --num-blocks).")
@click.option("--state-slots", type=int, default=None, help="State slots per Mamba/linear layer (default: --num-blocks).")
@click.option("--mtp/--no-mtp", "mtp", default=True, show_default=True, help="Optional regions for MTP draft layers.")
@click.option("--mamba-ssm-cache-dtype", "ssm_dtype", type=Choice(SSM_CACHE_DTYPES),
              default="auto", show_default=True, help="vLLM's flag of that name: a hybrid's SSM state dtype.")
@click.option("--cpu-avx512-bf16/--no-cpu-avx512-bf16", "avx512_bf16", default=None,
              help="vLLM CPU_ATTN engine: its host has AVX-512 BF16 (vLLM then keeps SSM state in fp32); "
                   "default: whether this host has it.")
@click.option("--cpu-isa", type=Choice(ISA_CHOICES), default="auto", show_default=True,
              help="vLLM CPU_ATTN engine: the attention ISA vLLM picks, which orders each block (amx: bf16 "
                   "on a host with AMX, tokens in entries of 16); auto: as vLLM picks on this host.")
@click.option("--name", default="", help="Spec name (default: from the model, TP, layers and block size).")
@click.option("--model-name", default="", help="model.name (default: config's _name_or_path or model_type).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the spec here.")
@click.option("--json", "as_json", is_flag=True, help="Write the spec as JSON instead of commented YAML.")
def init_cmd(config: str, engine: str, backend: str, tp_size: int, pp_size: int, pp_rank: int, layers: str | None,
             pcp_size: int, dcp_size: int, dcp_interleave: int, block_size: int | None,
             kernel_block_size: int | None,
             kv_dtype: str,
             mem: str, device: int, num_blocks: int, sliding_blocks: int | None, state_slots: int | None,
             mtp: bool, ssm_dtype: str, avx512_bf16: bool | None, cpu_isa: str, name: str, model_name: str,
             output: str | None, as_json: bool) -> None:
    """Write the spec of a HuggingFace CONFIG (config.json) on the engine the options describe."""
    import json as _json

    try:
        opts = EngineOptions(engine=engine, backend=backend, tp_size=tp_size, pp_size=pp_size, pp_rank=pp_rank,
                             layers=_layer_window(layers), pcp_size=pcp_size, dcp_size=dcp_size,
                             dcp_interleave=dcp_interleave,
                             block_size=block_size or default_block_size(engine, backend),
                             kernel_block_size=kernel_block_size, kv_dtype=kv_dtype,
                             mem=mem, device=device, num_blocks=num_blocks, sliding_blocks=sliding_blocks,
                             state_slots=state_slots, draft_layers=mtp, mamba_ssm_cache_dtype=ssm_dtype,
                             cpu_avx512_bf16=avx512_bf16, cpu_isa=cpu_isa, name=name, model_name=model_name)
        cfg = load_config(config)
        text = init_checked(cfg, opts)  # what init writes always compiles; a bad combination names its option
        if as_json:
            text = _json.dumps(init_spec(cfg, opts), indent=2) + "\n"
    except KvlcError as exc:
        _fail(exc)
    emit(text, output)


@main.command()
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the schema here.")
def schema(output: str | None) -> None:
    """Print the JSON Schema of the spec language, for editors (yaml-language-server).

    Put `# yaml-language-server: $schema=kvlc.compiler.spec.schema.json` on a spec's first line.
    """
    text = schema_json()
    emit(text, output)
