"""The ``kvlc`` command line: compile | check | explain | size | schema | render | init | pair | demo | bench | from-vllm.

Exit codes: 0 success, 2 a spec / pairing problem (every problem printed), 1 a
failed run (transfer mismatch, benchmark failure).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import click

from kvlc.errors import KvlcError

EXIT_SPEC = 2


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename: never half-written."""
    path = Path(path)
    mode = "wb" if isinstance(data, bytes) else "w"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=str(path.parent or "."))
    try:
        with os.fdopen(fd, mode) as fh:
            fh.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual mode
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _fail(exc: KvlcError) -> None:
    click.echo(str(exc), err=True)
    n = len(getattr(exc, "problems", ())) or 1
    click.echo(f"kvlc: {n} problem{'s' if n != 1 else ''}", err=True)
    sys.exit(EXIT_SPEC)


def _overrides(sets: tuple[str, ...], config: str | None):
    from kvlc.compiler.source import load_config, parse_set
    return (load_config(config) if config else None), parse_set(sets)


def _load_plan(path: str, config: str | None = None, sets: tuple[str, ...] = ()):
    """A compiled plan from a spec (``.yaml``/``.yaml.j2``) or a plan (``.json``)."""
    from kvlc.compiler import load_plan
    if path.endswith(".json"):
        return load_plan(path)
    cfg, ovr = _overrides(sets, config)
    return load_plan(path, cfg, ovr)


_config_opt = click.option("--config", "config", type=click.Path(exists=True, dir_okay=False),
                           help="HuggingFace-style config.json for a .yaml.j2 template.")
_set_opt = click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
                        help="Template variable (repeatable), e.g. --set tp_size=8.")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvlc")
def main() -> None:
    """kvlc: compile KV-cache layout specs into plans and move KV blocks with NIXL."""


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
    from kvlc.explain.docs import check_doc, problem_doc
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
    from kvlc.compiler import compile_spec
    from kvlc.compiler.source import parse_yaml, render_template, rendered_name
    from kvlc.compiler.validate import validate
    try:
        cfg, ovr = _overrides(sets, config)
        text = render_template(template, cfg, ovr)
        source = parse_yaml(text, rendered_name(template))
        spec = validate(source)
        spec._source = source
        compile_spec(spec)
    except KvlcError as exc:
        _fail(exc)
    if output:
        write_atomic(output, text)
        click.echo(f"{output}: written", err=True)
    else:
        click.echo(text, nl=False)


@main.command("from-vllm")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--backend", default="CPU_ATTN", show_default=True,
              help="vLLM attention backend: CPU_ATTN, FLASH_ATTN, FLASHINFER, TRITON_ATTN, or an MLA one "
                   "(FLASHMLA, FLASHINFER_MLA, CUTLASS_MLA, TRITON_MLA, ...).")
@click.option("--block-size", type=int, default=None, help="Tokens per block [default: 128 on CPU_ATTN, else 16].")
@click.option("--kernel-block-size", type=int, default=None, help="Tokens per kernel block [default: block size].")
@click.option("--tp-size", type=int, default=1, show_default=True)
@click.option("--tp-rank", type=int, default=0, show_default=True)
@click.option("--kv-dtype", default="bf16", show_default=True, help="bf16, fp16, fp32, fp8_e4m3, fp8_e5m2.")
@click.option("--num-blocks", type=int, default=None, help="KV-cache blocks [default: 1024; with --from-engine "
              "the engine's own count].")
@click.option("--layout", default=None, help="vLLM KV-cache layout: LBHNC, LBNHC, BLHNC, BLNHC; older vLLM: "
              "split-NHD/split-HND (FLASH_ATTN), blockkv-NHD/blockkv-HND (FLASHINFER).")
@click.option("--from-engine", is_flag=True, help="Start a real vLLM engine on CPU and derive from its tensors.")
@click.option("--kv-cache-mib", type=int, default=64, show_default=True, help="KV-cache memory of the engine.")
@click.option("--save-view", type=click.Path(dir_okay=False), help="Also write the engine view as JSON here.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the YAML here.")
def from_vllm(model_dir: str, backend: str, block_size: int | None, kernel_block_size: int | None, tp_size: int,
              tp_rank: int, kv_dtype: str, num_blocks: int | None, layout: str | None, from_engine: bool,
              kv_cache_mib: int, save_view: str | None, output: str | None) -> None:
    """The kvlc spec of a vLLM engine serving MODEL_DIR, as commented YAML.

    Derived from MODEL_DIR/config.json and vLLM's published backend layouts without
    starting an engine (so GPU backends work here too), or with --from-engine from a
    real CPU engine's live KV-cache tensors.
    """
    import json

    from kvlc.compiler import compile_spec
    from kvlc.engines.vllm.derive import spec_yaml
    block_size = block_size or (128 if backend == "CPU_ATTN" else 16)
    try:
        if from_engine:
            from kvlc.engines.vllm.derive_engine import live_views
            dtypes = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
            if num_blocks or kv_dtype not in dtypes:
                raise KvlcError("--from-engine: the engine sizes its cache from --kv-cache-mib (drop --num-blocks) "
                                f"and runs in {', '.join(dtypes)} (got --kv-dtype {kv_dtype})")
            views = live_views(model_dir, block_size=block_size, tp_size=tp_size, dtype=dtypes[kv_dtype],
                               kv_cache_memory_bytes=kv_cache_mib << 20,
                               attention_backend=None if backend == "CPU_ATTN" else backend)
            view = views[min(tp_rank, len(views) - 1)]
        else:
            from kvlc.engines.vllm.derive_offline import published_view
            config_path = Path(model_dir) / "config.json"
            try:
                config = json.loads(config_path.read_text())
            except (OSError, ValueError) as exc:
                raise KvlcError(f"{config_path}: cannot read the model config: {exc}; "
                                "fix: point MODEL_DIR at a HuggingFace model folder") from None
            view = published_view(config, model_dir, backend=backend, block_size=block_size,
                                  num_blocks=num_blocks or 1024, tp_size=tp_size, tp_rank=tp_rank,
                                  kv_dtype=kv_dtype, layout=layout, kernel_block_size=kernel_block_size)
        text = spec_yaml(view)
        compile_spec(text)
    except KvlcError as exc:
        _fail(exc)
    if save_view:
        write_atomic(save_view, json.dumps(view.to_dict(), indent=1) + "\n")
    if output:
        write_atomic(output, text)
        click.echo(f"{output}: {len(view.layers)} layers from {view.provenance.value}", err=True)
    else:
        click.echo(text, nl=False)


@main.command()
@click.argument("spec", metavar="SPEC|PLAN", type=click.Path(exists=True, dir_okay=False))
@click.option("--full", is_flag=True, help="One row per region and storage (no collapsing of per-layer runs).")
@click.option("--html", "html_out", type=click.Path(dir_okay=False),
              help="Also write a standalone HTML page: storages to scale per memory type, one block's byte map.")
@click.option("--json", "as_json", is_flag=True, help="Print every number as JSON instead of tables.")
@_config_opt
@_set_opt
def explain(spec: str, full: bool, html_out: str | None, as_json: bool, config: str | None,
            sets: tuple[str, ...]) -> None:
    """Explain a spec or plan .json: regions, groups, storages, memory-type totals and token capacity.

    Byte counts are per rank; the engine totals multiply them by tp_size.
    """
    from kvlc.explain import render_html, render_table
    from kvlc.explain.terminal import console
    try:
        plan = _load_plan(spec, config, sets)
    except KvlcError as exc:
        _fail(exc)
    if html_out:
        write_atomic(html_out, render_html(plan))
        click.echo(f"{html_out}: written ({len(plan.regions)} regions, digest {plan.digest[:16]})", err=True)
    if as_json:
        from kvlc.explain.docs import explain_doc
        _echo_json(explain_doc(plan))
    else:
        render_table(plan, console(), full=full)


def _echo_json(doc: dict) -> None:
    import json
    click.echo(json.dumps(doc, indent=2))


def _layer_window(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    start, sep, stop = text.partition(":")
    if not sep or not start.strip().isdigit() or not stop.strip().isdigit():
        from kvlc.init import InitError
        raise InitError(f"--layers {text!r}: expected START:STOP, e.g. --layers 0:40 (layers [0, 40))")
    return int(start), int(stop)


@main.command("init")
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
@click.option("--engine", default="kvlc", show_default=True, help="Engine whose cache shapes to use.")
@click.option("--backend", default="paged-nhd", show_default=True, help="The engine's attention backend.")
@click.option("--tp-size", type=int, default=1, show_default=True)
@click.option("--pp-size", type=int, default=1, show_default=True, help="Pipeline stages (even split).")
@click.option("--pp-rank", type=int, default=0, show_default=True, help="This engine's pipeline stage.")
@click.option("--layers", "layers", metavar="START:STOP", help="This stage's layers [START, STOP) (instead of --pp-*).")
@click.option("--dcp-size", type=int, default=1, show_default=True)
@click.option("--block-size", type=int, default=16, show_default=True, help="Tokens per scheduler block.")
@click.option("--kernel-block-size", type=int, default=None, help="Tokens per attention-kernel block.")
@click.option("--kv-dtype", default="bf16", show_default=True)
@click.option("--mem", type=click.Choice(["VRAM", "DRAM"]), default="VRAM", show_default=True)
@click.option("--device", type=int, default=0, show_default=True)
@click.option("--num-blocks", type=int, default=4096, show_default=True, help="Blocks per full-attention region.")
@click.option("--sliding-blocks", type=int, default=None, help="Blocks per sliding-window region (default: --num-blocks).")
@click.option("--state-slots", type=int, default=None, help="State slots per Mamba/linear layer (default: --num-blocks).")
@click.option("--mtp/--no-mtp", "mtp", default=True, show_default=True, help="Optional regions for MTP draft layers.")
@click.option("--name", default="", help="Spec name (default: from the model, TP, layers and block size).")
@click.option("--model-name", default="", help="model.name (default: config's _name_or_path or model_type).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the spec here.")
@click.option("--json", "as_json", is_flag=True, help="Write the spec as JSON instead of commented YAML.")
def init_cmd(config: str, engine: str, backend: str, tp_size: int, pp_size: int, pp_rank: int, layers: str | None,
             dcp_size: int, block_size: int, kernel_block_size: int | None, kv_dtype: str, mem: str, device: int,
             num_blocks: int, sliding_blocks: int | None, state_slots: int | None, mtp: bool, name: str,
             model_name: str, output: str | None, as_json: bool) -> None:
    """Write the spec of a HuggingFace CONFIG (config.json) on the engine the options describe."""
    import json as _json

    from kvlc.compiler import compile_spec
    from kvlc.compiler.source import load_config
    from kvlc.init import EngineOptions, init_spec, init_yaml
    try:
        opts = EngineOptions(engine=engine, backend=backend, tp_size=tp_size, pp_size=pp_size, pp_rank=pp_rank,
                             layers=_layer_window(layers), dcp_size=dcp_size, block_size=block_size,
                             kernel_block_size=kernel_block_size, kv_dtype=kv_dtype, mem=mem, device=device,
                             num_blocks=num_blocks, sliding_blocks=sliding_blocks, state_slots=state_slots,
                             draft_layers=mtp, name=name, model_name=model_name)
        cfg = load_config(config)
        text = init_yaml(cfg, opts)
        compile_spec(text)  # what init writes always compiles; a bad combination fails here, located
        if as_json:
            text = _json.dumps(init_spec(cfg, opts), indent=2) + "\n"
    except KvlcError as exc:
        _fail(exc)
    if output:
        write_atomic(output, text)
        click.echo(f"{output}: written", err=True)
    else:
        click.echo(text, nl=False)


@main.command("pair")
@click.argument("producer", type=click.Path(exists=True, dir_okay=False))
@click.argument("consumer", type=click.Path(exists=True, dir_okay=False))
@click.option("--rank", "rank", type=int, default=0, show_default=True,
              help="The local rank: the consumer's for a pull, the producer's for a push.")
@click.option("--direction", type=click.Choice(["pull", "push"]), default="pull", show_default=True,
              help="pull: the consumer READs from producer ranks; push: the producer WRITEs to consumer ranks.")
@click.option("--json", "as_json", is_flag=True, help="Print the report and summary as JSON.")
@click.option("--program", "show_program", is_flag=True, help="Also print the program, one line per entry.")
@click.option("--html", "html_out", type=click.Path(dir_okay=False),
              help="Also write a page drawing which consumer rank reads which producer heads and tokens, "
                   "and the descriptors of one block.")
def pair_cmd(producer: str, consumer: str, rank: int, direction: str, as_json: bool, show_program: bool,
             html_out: str | None) -> None:
    """Pair PRODUCER and CONSUMER (specs or plan .json): compatibility report and program summary."""
    import json as _json

    from kvlc.compiler.pair import pair_and_check
    try:
        prod, cons = _load_plan(producer), _load_plan(consumer)
    except KvlcError as exc:
        _fail(exc)
    local, remote = (cons, prod) if direction == "pull" else (prod, cons)
    op = "READ" if direction == "pull" else "WRITE"
    report, program = pair_and_check(local, remote, local_rank=rank, direction=op)
    if html_out:
        _pair_html(html_out, prod, cons, rank, op, program is not None)
    if as_json:
        from kvlc.explain.docs import pair_doc
        click.echo(_json.dumps(pair_doc(report, program, rank), indent=2))
    else:
        from kvlc.explain.terminal import console as _console
        console = _console()
        console.print(report.render(), markup=False, highlight=False)
        if program is not None:
            from kvlc.explain.tables import program_table
            from kvlc.explain.terminal import print_line, print_table
            print_table(program_table(program, op, rank), console)
            counts = ", ".join(f"rank {k}: {v}" for k, v in sorted(program.consumer_counts.items()))
            print_line(console, f"consumer ranks reading from each producer rank: {counts}")
            if show_program:
                click.echo(program.text(), nl=False)
    if not report.ok:
        sys.exit(EXIT_SPEC)


def _pair_html(path: str, producer, consumer, rank: int, op: str, compatible: bool) -> None:
    """``kvlc pair --html``: the rank / head / token mapping of every consumer rank, and one block's runs."""
    if not compatible:
        click.echo(f"{path}: not written (the engines do not pair; the report says why)", err=True)
        return
    from kvlc.explain.pairing import render_pair_html
    write_atomic(path, render_pair_html(producer, consumer, rank=rank, direction=op))
    click.echo(f"{path}: written", err=True)


@main.command()
@click.argument("spec", metavar="SPEC|PLAN", type=click.Path(exists=True, dir_okay=False))
@click.option("--tokens", type=click.IntRange(min=1), required=True, help="Prompt length of the request, in tokens.")
@click.option("--peer", type=click.Path(exists=True, dir_okay=False),
              help="The other engine's spec or plan (default: an engine of the same plan).")
@click.option("--rank", "ranks", type=int, multiple=True,
              help="Only this rank of SPEC (repeatable; default every rank: per-rank rows and the engine total).")
@click.option("--direction", type=click.Choice(["pull", "push"]), default="pull", show_default=True,
              help="pull: SPEC reads from PEER (SPEC consumes); push: SPEC writes to PEER (SPEC produces).")
@click.option("--json", "as_json", is_flag=True, help="Print the numbers as JSON.")
def size(spec: str, tokens: int, peer: str | None, ranks: tuple[int, ...], direction: str, as_json: bool) -> None:
    """Bytes and NIXL descriptors of one request of --tokens tokens, per rank and per engine.

    Each rank's program is paired and instantiated for the request; descriptors are counted
    for scattered block ids (none adjacent: the worst case) and contiguous ones (the best).
    """
    from kvlc.explain.size import request_size
    try:
        plan = _load_plan(spec)
        other = _load_plan(peer) if peer else None
        result = request_size(plan, tokens, other, "READ" if direction == "pull" else "WRITE",
                              tuple(ranks) if ranks else None)
    except KvlcError as exc:
        _fail(exc)
    if as_json:
        from kvlc.explain.docs import size_doc
        _echo_json(size_doc(result))
    else:
        from kvlc.explain.sizetext import render_size
        from kvlc.explain.terminal import console
        render_size(result, console())


@main.command()
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the schema here.")
def schema(output: str | None) -> None:
    """Print the JSON Schema of the spec language, for editors (yaml-language-server).

    Put `# yaml-language-server: $schema=kvlc.schema.json` on a spec's first line.
    """
    from kvlc.schema import schema_json
    text = schema_json()
    if output:
        write_atomic(output, text)
        click.echo(f"{output}: written", err=True)
    else:
        click.echo(text, nl=False)


@main.command()
@click.argument("layout", required=False, type=click.Path(exists=True, dir_okay=False))
@click.option("--consumer", type=click.Path(exists=True, dir_okay=False),
              help="The consumer's layout (default: the same as LAYOUT), e.g. another TP or block size.")
@click.option("--mode", type=click.Choice(["pull", "push", "pull_via_push"]), default="pull", show_default=True)
@click.option("--requests", type=int, default=64, show_default=True)
@click.option("--tokens", type=int, default=None, help="Tokens per request (default: what the pools allow).")
@click.option("--pool-mib", type=int, default=64, show_default=True,
              help="Shrink every storage pool to about this many MiB (layouts keep their geometry).")
@click.option("--check", type=click.Choice(["all", "first", "none"]), default="all", show_default=True,
              help="Which rounds to verify byte by byte.")
@click.option("--ids", type=click.Choice(["random", "contiguous"]), default="random", show_default=True,
              help="Producer block ids: scattered over the pool, or contiguous runs (descriptors coalesce).")
@click.option("--descriptors", type=click.Choice(["rows", "prepped"]), default="rows", show_default=True,
              help="rows: coalesced (N, 3) rows per request; prepped: strided lists prepared once, indices per request.")
def demo(layout: str | None, consumer: str | None, mode: str, requests: int, tokens: int | None, pool_mib: int,
         check: str, ids: str, descriptors: str) -> None:
    """Producer and consumer processes on loopback move a content-coded workload; every byte is checked.

    The producer fills its cache with bytes that encode what they are (region, field, head,
    token); the consumer pulls (or the producer pushes) the requests with real NIXL agents over
    UCX, then compares every destination byte. LAYOUT defaults to layouts/llama-3.1-8b.yaml of
    the kvlc source tree the package runs from (found next to the package, from any directory).
    The pair is checked before any engine starts (exit 2 with the report); exit 1 on any mismatch
    or failed request.
    """
    _demo_needs_extras()
    from kvlc.testing.demo import DEFAULT_LAYOUT, DemoError, check_pair, make_workload, run_demo, scaled_plan

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
    _run_demo(run_demo, layout, consumer, mode, requests, tokens, pool_mib, check, ids, descriptors)


def _demo_needs_extras() -> None:
    import importlib.util

    missing = [m for m in ("msgpack", "torch", "nixl", "rich") if importlib.util.find_spec(m) is None]
    if missing:
        click.echo(f"kvlc demo needs the runtime extra, missing: {', '.join(missing)}; "
                   "install it with: pip install 'kvlc[runtime]' (and rich)", err=True)
        sys.exit(EXIT_SPEC)


def _run_demo(run_demo, layout, consumer, mode, requests, tokens, pool_mib, check, ids, descriptors) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    console = Console()
    console.print(f"kvlc demo: {mode} {requests} requests, producer {layout}"
                  + (f", consumer {consumer}" if consumer else ""), highlight=False)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("requests", total=requests, rate="")

        def progress(done, total, nbytes, seconds):
            rate = f"{nbytes / seconds / 1e9:.2f} GB/s" if seconds else ""
            bar.update(task, completed=done, rate=rate)

        try:
            result = run_demo(layout, consumer, mode=mode, requests=requests, tokens=tokens,
                              max_bytes=pool_mib << 20, progress=progress, check=check, ids=ids,
                              descriptors=descriptors)
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


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option("--only", metavar="NAMES", help="Comma-separated benchmarks: compile, pair, prep, transfer.")
@click.option("--quick", is_flag=True, help="Smoke run: fewer repetitions, smaller sizes (no size-dependent verdicts).")
@click.option("--no-run", is_flag=True, help="Run nothing: summarize and plot the recorded results.")
@click.pass_context
def bench(ctx: click.Context, only: str | None, quick: bool, no_run: bool) -> None:
    """Run the benchmark suite of a source checkout (``python3 benchmarks/run.py``).

    Looks for ``benchmarks/run.py`` in the current directory and its parents. Results go to a
    fresh folder (``benchmarks/runs/<date-time>/``); the recorded results change only with
    ``--record``. Other options (``--out``, ``--record``) pass through to run.py.
    """
    import subprocess

    here = Path.cwd().resolve()
    script = next((d / "benchmarks" / "run.py" for d in (here, *here.parents)
                   if (d / "benchmarks" / "run.py").is_file()), None)
    if script is None:
        click.echo(f"kvlc bench: no benchmarks/ folder with run.py in {here} or above it; the benchmarks "
                   "are not installed with the package: run kvlc bench in a kvlc source checkout", err=True)
        sys.exit(1)
    args = ([f"--only={only}"] if only else []) + (["--quick"] if quick else []) + \
        (["--no-run"] if no_run else []) + list(ctx.args)
    sys.exit(subprocess.call([sys.executable, str(script), *args]))


def entry() -> None:
    """The ``kvlc`` program: :func:`main` as its own process.

    ``kvlc ... | head`` ends quietly instead of with a traceback. Only the program does this, not
    :func:`main`: called in-process (tests, an engine embedding the CLI) it must not change how
    the host handles SIGPIPE (a socket write to a closed peer would kill the host process).
    """
    import signal
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    main()


if __name__ == "__main__":
    entry()
