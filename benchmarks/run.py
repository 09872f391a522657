"""Run the benchmark suite and summarize it: ``python3 benchmarks/run.py [--only NAMES] [--quick] [--no-run]``.

Results, logs and plots go to a fresh folder ``benchmarks/runs/<date-time>/`` (or ``--out``);
``--record`` writes into ``benchmarks/results/``, the recorded results the README cites.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent))

import report  # noqa: E402


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--only", default="compile,pair,prep,transfer", show_default=True, metavar="NAMES",
              help="Comma-separated benchmarks to run: compile, pair, prep, transfer.")
@click.option("--quick", is_flag=True, help="Smoke run: fewer repetitions, smaller sizes (no size-dependent verdicts).")
@click.option("--no-run", is_flag=True, help="Run nothing: summarize and plot the recorded results.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder for results, logs and plots (default: a fresh benchmarks/runs/<date-time>/).")
@click.option("--record", is_flag=True, help="Write into benchmarks/results/ (replaces the recorded results).")
def main(only: str, quick: bool, no_run: bool, out: Path | None, record: bool) -> None:
    """Run the selected benchmark scripts, print their tables and targets, and plot them."""
    try:
        code = report.main_bench(only=only, quick=quick, run=not no_run, out=out, record=record)
    except report.BenchError as exc:
        click.echo(str(exc), err=True)
        sys.exit(1)
    sys.exit(code)


if __name__ == "__main__":
    main()
