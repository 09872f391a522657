"""The ``kvlc`` command line: compile | check | explain | render | pair | demo | bench.

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
    from kvlc.compiler import compile_spec
    from kvlc.compiler.plan import Plan
    if path.endswith(".json"):
        try:
            return Plan.from_json(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise KvlcError(f"{path}: not a kvlc plan: {exc}") from None
    cfg, ovr = _overrides(sets, config)
    return compile_spec(path, cfg, ovr)


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
def check(specs: tuple[str, ...], config: str | None, sets: tuple[str, ...]) -> None:
    """Check one or more specs; print every problem found (exit 2 if any)."""
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


@main.command()
@click.argument("template", type=click.Path(exists=True, dir_okay=False))
@_config_opt
@_set_opt
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the YAML here.")
def render(template: str, config: str | None, sets: tuple[str, ...], output: str | None) -> None:
    """Render a .yaml.j2 TEMPLATE with a model config into concrete YAML (validated first)."""
    from kvlc.compiler import compile_spec
    from kvlc.compiler.source import render_template
    try:
        cfg, ovr = _overrides(sets, config)
        text = render_template(template, cfg, ovr)
        compile_spec(text if "\n" in text else text + "\n")
    except KvlcError as exc:
        _fail(exc)
    if output:
        write_atomic(output, text)
        click.echo(f"{output}: written", err=True)
    else:
        click.echo(text, nl=False)


if __name__ == "__main__":
    main()
