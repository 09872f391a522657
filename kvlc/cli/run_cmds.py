"""``kvlc demo | from-vllm``: commands that start processes or engines."""

from __future__ import annotations

import sys
from pathlib import Path

import click
import yaml

from kvlc.cli.base import EXIT_SPEC, Choice, _fail, emit, main, write_atomic
from kvlc.compiler import compile_spec
from kvlc.compiler.spec.dtypes import DTYPE_SIZES
from kvlc.engines.vllm.derive.cpu import ISA_CHOICES, backend_isa, resolve_isa
from kvlc.engines.vllm.derive.state import SSM_CACHE_DTYPES
from kvlc.engines.vllm.derive.offline import (ATTENTION_BACKENDS, CPU_BACKENDS, MLA_BACKENDS, check_engine_block,
                                               published_view)
from kvlc.engines.vllm.derive.spec import derive_spec, spec_yaml
from kvlc.errors import KvlcError
from kvlc.init import EngineOptions, default_block_size, init_checked, read_model
from kvlc.init.vllm import HYBRID_FAMILIES, vllm_config


@main.command("from-vllm")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--backend", type=Choice(sorted(ATTENTION_BACKENDS | MLA_BACKENDS)), default="CPU_ATTN",
              show_default=True, help="vLLM attention backend (an MLA one for an MLA model).")
@click.option("--block-size", type=int, default=None, help="Tokens per block [default: 128 on CPU_ATTN, else 16].")
@click.option("--kernel-block-size", type=int, default=None, help="Tokens per kernel block [default: block size].")
@click.option("--tp-size", type=int, default=1, show_default=True)
@click.option("--tp-rank", type=int, default=0, show_default=True)
@click.option("--kv-dtype", type=Choice(list(DTYPE_SIZES)), default="bf16", show_default=True,
              help="The KV cache's dtype (vLLM's --kv-cache-dtype fp8 is fp8_e4m3).")
@click.option("--num-blocks", type=int, default=None, help="KV-cache blocks [default: 1024; with --from-engine "
              "the engine's own count].")
@click.option("--layout", default=None, help="vLLM KV-cache layout: LBHNC, LBNHC, BLHNC, BLNHC; older vLLM: "
              "split-NHD/split-HND (FLASH_ATTN), blockkv-NHD/blockkv-HND (FLASHINFER).")
@click.option("--from-engine", is_flag=True, help="Start a real vLLM engine on CPU and derive from its tensors.")
@click.option("--kv-cache-mib", type=int, default=64, show_default=True, help="KV-cache memory of the engine.")
@click.option("--save-view", type=click.Path(dir_okay=False), help="Also write the engine view as JSON here.")
@click.option("--mamba-ssm-cache-dtype", "ssm_dtype", type=Choice(SSM_CACHE_DTYPES), default="auto",
              show_default=True, help="vLLM's flag of that name (offline, a hybrid's SSM state dtype).")
@click.option("--cpu-avx512-bf16/--no-cpu-avx512-bf16", "avx512_bf16", default=None,
              help="Offline CPU_ATTN hybrid: the engine's host has AVX-512 BF16 (vLLM then keeps SSM state in "
                   "fp32); default: whether this host has it.")
@click.option("--cpu-isa", type=Choice(ISA_CHOICES), default="auto", show_default=True,
              help="Offline CPU_ATTN: the attention ISA vLLM picks, which orders each block (amx: bf16 on a host "
                   "with AMX); auto: as vLLM picks on this host (with --from-engine: the engine's own).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the YAML here.")
@click.option("--json", "as_json", is_flag=True, help="Write the spec as JSON instead of commented YAML.")
def from_vllm(model_dir: str, backend: str, block_size: int | None, kernel_block_size: int | None, tp_size: int,
              tp_rank: int, kv_dtype: str, num_blocks: int | None, layout: str | None, from_engine: bool,
              kv_cache_mib: int, save_view: str | None, ssm_dtype: str, avx512_bf16: bool | None, cpu_isa: str,
              output: str | None, as_json: bool) -> None:
    """The kvlc spec of a vLLM engine serving MODEL_DIR, as commented YAML.

    Derived from MODEL_DIR/config.json and vLLM's published backend layouts without
    starting an engine (so GPU backends work here too), or with --from-engine from a
    real CPU engine's live KV-cache tensors.
    """
    import json

    block_size = block_size or default_block_size("vllm", backend)
    hybrid = None
    try:
        if from_engine:
            from kvlc.engines.vllm.derive.engine import live_views
            dtypes = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
            if cpu_isa != "auto":
                raise KvlcError(f"--from-engine --cpu-isa {cpu_isa}: a live engine's ISA is the one vLLM picked "
                                "on this host; fix: drop --cpu-isa")
            if num_blocks or kv_dtype not in dtypes:
                raise KvlcError("--from-engine: the engine sizes its cache from --kv-cache-mib (drop --num-blocks) "
                                f"and runs in {', '.join(dtypes)} (got --kv-dtype {kv_dtype})")
            views = live_views(model_dir, block_size=block_size, tp_size=tp_size, dtype=dtypes[kv_dtype],
                               kv_cache_memory_bytes=kv_cache_mib << 20,
                               attention_backend=None if backend == "CPU_ATTN" else backend)
            view = views[min(tp_rank, len(views) - 1)]
        else:
            view, hybrid = _offline(model_dir, backend=backend, block_size=block_size, num_blocks=num_blocks or 1024,
                                    tp_size=tp_size, tp_rank=tp_rank, kv_dtype=kv_dtype, layout=layout,
                                    kernel_block_size=kernel_block_size, save_view=save_view,
                                    state=(ssm_dtype, avx512_bf16), cpu_isa=cpu_isa)
        if hybrid is not None:   # a hybrid page pool: derived from config.json, no engine view
            text = json.dumps(yaml.safe_load(hybrid), indent=2) + "\n" if as_json else hybrid
        else:
            text = spec_yaml(view)
            compile_spec(text)
            if as_json:
                text = json.dumps(derive_spec(view), indent=2) + "\n"
    except KvlcError as exc:
        _fail(exc)
    if hybrid is not None:
        emit(text, output, "a hybrid page pool from config.json (offline)")
        return
    if save_view:
        write_atomic(save_view, json.dumps(view.to_dict(), indent=1) + "\n")
    emit(text, output, f"{len(view.layers) + len(view.states)} layers from {view.provenance.value}")


def _offline(model_dir: str, *, backend: str, block_size: int, num_blocks: int, tp_size: int, tp_rank: int,
             kv_dtype: str, layout: str | None, kernel_block_size: int | None, save_view: str | None,
             state: tuple[str, bool | None] = ("auto", None), cpu_isa: str = "auto"):
    """``(view, None)`` of MODEL_DIR/config.json on these options, or ``(None, spec YAML)`` for a hybrid with
    state layers: the layer kinds are kvlc init's reader's (:func:`kvlc.init.read_model`), so from-vllm and
    ``kvlc init --engine vllm`` write the same spec; a config whose layer kinds it cannot tell is refused."""
    import json

    isa = backend_isa(cpu_isa, backend)
    config_path = Path(model_dir) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise KvlcError(f"{config_path}: cannot read the model config: {exc}; "
                        "fix: point MODEL_DIR at a HuggingFace model folder") from None
    m = read_model(config)
    if m.family not in HYBRID_FAMILIES:
        check_engine_block(backend, block_size, kernel_block_size)
        view = published_view(vllm_config(config, m), model_dir, backend=backend, block_size=block_size,
                              num_blocks=num_blocks, tp_size=tp_size, tp_rank=tp_rank, kv_dtype=kv_dtype,
                              layout=layout, kernel_block_size=kernel_block_size, cpu_isa=isa)
        if isa not in ("", "auto"):  # one asked for: one vLLM picks for these options on some host
            resolve_isa(isa, kv_dtype=kv_dtype, block_size=view.kernel_block_size, head_size=view.model.head_dim)
        return view, None
    for flag, value in (("--layout", layout), ("--save-view", save_view)):
        if value:
            raise KvlcError(f"{flag} {value}: {model_dir} is a {m.family.value} model, whose spec (vLLM's hybrid page "
                            "pool) is derived from config.json without an engine view, in the backend's default "
                            f"layout; fix: drop {flag}")
    opts = EngineOptions(engine="vllm", backend=backend, tp_size=tp_size, block_size=block_size,
                         kernel_block_size=kernel_block_size, kv_dtype=kv_dtype, num_blocks=num_blocks,
                         mem="DRAM" if backend in CPU_BACKENDS else "VRAM", model_name=model_dir,
                         mamba_ssm_cache_dtype=state[0], cpu_avx512_bf16=state[1], cpu_isa=cpu_isa)
    text = init_checked(config, opts)
    return None, (f"# kvlc from-vllm (offline), {m.family.value} model: vLLM 0.32's hybrid page pool as `kvlc init "
                  "--engine vllm` derives it from config.json (kvlc/engines/vllm/derive/hybrid.py);\n# not read from "
                  "a live engine (`--from-engine` reads one).\n" + text)


@main.command()
@click.argument("layout", required=False, type=click.Path(exists=True, dir_okay=False))
@click.option("--consumer", type=click.Path(exists=True, dir_okay=False),
              help="The consumer's layout (default: the same as LAYOUT), e.g. another TP or block size.")
@click.option("--mode", type=Choice(["pull", "push", "pull_via_push"]), default="pull", show_default=True)
@click.option("--requests", type=int, default=64, show_default=True)
@click.option("--tokens", type=int, default=None, help="Tokens per request (default: what the pools allow).")
@click.option("--pool-mib", type=int, default=64, show_default=True,
              help="Shrink every storage pool to about this many MiB (layouts keep their geometry).")
@click.option("--check", type=Choice(["all", "first", "none"]), default="all", show_default=True,
              help="Which rounds to verify byte by byte.")
@click.option("--ids", type=Choice(["random", "scattered", "contiguous"]), default="random", show_default=True,
              help="Block ids: the producer's scattered over its pool (random), both sides' (scattered), "
                   "or contiguous runs on both (descriptors coalesce).")
@click.option("--descriptors", type=Choice(["rows", "prepped"]), default="rows", show_default=True,
              help="rows: coalesced (N, 3) rows per request; prepped: strided lists prepared once, indices per request.")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True,
              help="Requests per write_many / read_many call (one NIXL request per part for all of them).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
              help="Seconds each request may take.")
@click.option("--start-timeout", type=click.FloatRange(min=0, min_open=True), default=120.0, show_default=True,
              help="Seconds the engines may take to start and connect (raise it on a busy machine).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON document (no progress display).")
def demo(layout: str | None, consumer: str | None, mode: str, requests: int, tokens: int | None, pool_mib: int,
         check: str, ids: str, descriptors: str, batch: int, timeout: float, start_timeout: float,
         as_json: bool) -> None:
    """Producer and consumer processes on loopback move a content-coded workload; every byte is checked.

    The producer fills its cache with bytes that encode what they are (region, field, head,
    token); the consumer pulls (or the producer pushes) the requests with real NIXL agents over
    UCX, then compares every destination byte. LAYOUT defaults to layouts/llama-3.1-8b.yaml of
    the kvlc source tree the package runs from (found next to the package, from any directory).
    The pair is checked before any engine starts (exit 2 with the report); exit 1 on any mismatch
    or failed request.
    """
    _demo_needs_extras()
    from kvlc.demo.run import DEFAULT_LAYOUT, DemoError, check_pair, make_workload, run_demo, scaled_plan

    if layout is None:
        if not DEFAULT_LAYOUT.exists():
            _fail(DemoError(f"no LAYOUT given and the default {DEFAULT_LAYOUT} is not there (an installed "
                            "package has no layouts/): pass a layout file, e.g. kvlc demo my-model.yaml"))
        layout = str(DEFAULT_LAYOUT)
    try:  # every option and the pairing are checked before engines start
        if pool_mib < 1:
            raise DemoError(f"--pool-mib {pool_mib}: give at least 1 (MiB per rank)")
        prod = scaled_plan(layout, pool_mib << 20, to_dram=True)
        cons = scaled_plan(consumer, pool_mib << 20, to_dram=True) if consumer else prod
        check_pair(cons, prod)
        if requests < 1:
            raise DemoError(f"--requests {requests}: give at least 1")
        make_workload(cons, prod, 1, tokens)
    except KvlcError as exc:
        _fail(exc)
    args = dict(mode=mode, requests=requests, tokens=tokens, max_bytes=pool_mib << 20, check=check, ids=ids,
                descriptors=descriptors, batch=batch, timeout=timeout, start_timeout=start_timeout)
    if as_json:
        _demo_json(run_demo, layout, consumer, args)
    else:
        _run_demo(run_demo, layout, consumer, args)


def _demo_json(run_demo, layout: str, consumer: str | None, args: dict) -> None:
    """``kvlc demo --json``: the whole result as data; exit 1 on any mismatch or failed request."""
    import dataclasses
    import json

    try:
        result = run_demo(layout, consumer, **args)
    except KvlcError as exc:
        _fail(exc)
    doc = {"producer": layout, "consumer": consumer or layout, **dataclasses.asdict(result),
           "gbps": result.gbps, "descriptors_per_request": result.descriptors_per_request, "ok": result.ok}
    click.echo(json.dumps(doc, indent=2))
    if not result.ok:
        sys.exit(1)


def _demo_needs_extras() -> None:
    import importlib.util

    missing = [m for m in ("msgpack", "torch", "nixl", "rich") if importlib.util.find_spec(m) is None]
    if missing:
        click.echo(f"kvlc demo needs the runtime extra, missing: {', '.join(missing)}; "
                   "install it with: pip install 'kvlc[runtime]' (and rich)", err=True)
        sys.exit(EXIT_SPEC)


def _run_demo(run_demo, layout: str, consumer: str | None, args: dict) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    console = Console()
    requests = args["requests"]
    console.print(f"kvlc demo: {args['mode']} {requests} requests, producer {layout}"
                  + (f", consumer {consumer}" if consumer else ""), highlight=False)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("requests", total=requests, rate="")

        def progress(done, total, nbytes, seconds):
            rate = f"{nbytes / seconds / 1e9:.2f} GB/s" if seconds else ""
            bar.update(task, completed=done, rate=rate)

        try:
            result = run_demo(layout, consumer, progress=progress, **args)
        except KvlcError as exc:
            _fail(exc)
    table = Table(title="result")
    table.add_column("what")
    table.add_column("value", justify="right")
    for k, v in (("requests", f"{result.requests}"), ("bytes moved", f"{result.nbytes:,}"),
                 ("start-up (compile, pair, start engines, connect)", f"{result.startup_seconds:.2f} s"),
                 ("transfer time", f"{result.seconds:.3f} s"), ("throughput", f"{result.gbps:.2f} GB/s"),
                 ("verification time", f"{result.verify_seconds:.2f} s"),
                 ("descriptors per request", f"{result.descriptors_per_request:.1f}"),
                 ("requests verified", f"{result.verified_requests} of {result.requests} "
                                       f"({result.verified_rounds} of {result.rounds} rounds)"),
                 ("bytes verified", f"{result.checked_bytes:,}"),
                 ("failed requests", f"{len(result.failed)}"), ("mismatches", f"{len(result.mismatches)}")):
        table.add_row(k, v)
    console.print(table)
    for line in result.mismatches[:20]:
        console.print(f"[red]mismatch[/red] {line}", highlight=False)
    for req, why in list(result.failed.items())[:20]:
        console.print(f"[red]failed[/red] {req}: {why}", highlight=False)
    if not result.ok:
        sys.exit(1)
    if result.verified_requests == result.requests and result.requests:
        console.print(f"[green]every byte of all {result.requests} requests verified[/green]"
                      f" ({result.checked_bytes:,} bytes)")
    elif result.verified_requests:
        console.print(f"[yellow]{result.verified_requests} of {result.requests} requests verified "
                      f"({result.checked_bytes:,} bytes); the rest moved unchecked[/yellow]")
    else:
        console.print("done: nothing verified (--check none)")
