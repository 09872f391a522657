"""``kvlc explain | size | pair``: what a plan holds, what a request costs, how two engines pair."""

from __future__ import annotations

import sys

import click

from kvlc.cli.base import EXIT_SPEC, Choice, _config_opt, _echo_json, _fail, _load_plan, _set_opt, main, write_atomic
from kvlc.compiler.pairing.pair import pair_and_check
from kvlc.compiler.request.windows import window_stats
from kvlc.errors import KvlcError
from kvlc.explain.docs import explain_doc, pair_doc, size_doc
from kvlc.explain.page import render_html
from kvlc.explain.pairing import render_pair_html
from kvlc.explain.size import request_size
from kvlc.explain.sizetext import render_size
from kvlc.explain.tables import program_table, render_table
from kvlc.explain.terminal import console, print_line, print_table


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
    try:
        plan = _load_plan(spec, config, sets)
    except KvlcError as exc:
        _fail(exc)
    if html_out:
        write_atomic(html_out, render_html(plan))
        click.echo(f"{html_out}: written ({len(plan.regions)} regions, digest {plan.digest[:16]})", err=True)
    if as_json:
        _echo_json(explain_doc(plan))
    else:
        render_table(plan, console(), full=full)

@main.command("pair")
@click.argument("producer", type=click.Path(exists=True, dir_okay=False))
@click.argument("consumer", type=click.Path(exists=True, dir_okay=False))
@click.option("--rank", "rank", type=int, default=0, show_default=True,
              help="The local rank: the consumer's for a pull, the producer's for a push.")
@click.option("--direction", type=Choice(["pull", "push"]), default="pull", show_default=True,
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
        click.echo(_json.dumps(pair_doc(report, program, rank), indent=2))
    else:
        _print_pair(report, program, op, rank, show_program)
    if not report.ok:
        sys.exit(EXIT_SPEC)


def _print_pair(report, program, op: str, rank: int, show_program: bool) -> None:
    """``kvlc pair`` on a terminal: the report, then (compatible) the program's parts, consumer counts,
    decode context parallelism and sliding windows (and, with --program, every entry)."""
    con = console()
    con.print(report.render(), markup=False, highlight=False)
    if program is None:
        return
    print_table(program_table(program, op, rank), con)
    counts = ", ".join(f"rank {k}: {v}" for k, v in sorted(program.consumer_counts.items()))
    print_line(con, f"consumer ranks reading from each producer rank: {counts}")
    if program.dcp_text():
        print_line(con, program.dcp_text())
    for w in window_stats(program):
        print_line(con, w.text())
    if show_program:
        click.echo(program.text(), nl=False)


def _pair_html(path: str, producer, consumer, rank: int, op: str, compatible: bool) -> None:
    """``kvlc pair --html``: the rank / head / token mapping of every consumer rank, and one block's runs."""
    if not compatible:
        click.echo(f"{path}: not written (the engines do not pair; the report says why)", err=True)
        return
    write_atomic(path, render_pair_html(producer, consumer, rank=rank, direction=op))
    click.echo(f"{path}: written", err=True)

@main.command()
@click.argument("spec", metavar="SPEC|PLAN", type=click.Path(exists=True, dir_okay=False))
@click.option("--tokens", type=click.IntRange(min=1), required=True, help="Prompt length of the request, in tokens.")
@click.option("--peer", type=click.Path(exists=True, dir_okay=False),
              help="The other engine's spec or plan (default: an engine of the same plan).")
@click.option("--rank", "ranks", type=int, multiple=True,
              help="Only this rank of SPEC (repeatable; default every rank: per-rank rows and the engine total).")
@click.option("--direction", type=Choice(["pull", "push"]), default="pull", show_default=True,
              help="pull: SPEC reads from PEER (SPEC consumes); push: SPEC writes to PEER (SPEC produces).")
@click.option("--json", "as_json", is_flag=True, help="Print the numbers as JSON.")
def size(spec: str, tokens: int, peer: str | None, ranks: tuple[int, ...], direction: str, as_json: bool) -> None:
    """Bytes and NIXL descriptors of one request of --tokens tokens, per rank and per engine.

    Each rank's program is paired and instantiated for the request; descriptors are counted
    for scattered block ids (none adjacent: the worst case) and contiguous ones (the best).
    """
    try:
        plan = _load_plan(spec)
        other = _load_plan(peer) if peer else None
        result = request_size(plan, tokens, other, "READ" if direction == "pull" else "WRITE",
                              tuple(ranks) if ranks else None)
    except KvlcError as exc:
        _fail(exc)
    if as_json:
        _echo_json(size_doc(result))
    else:
        render_size(result, console())
