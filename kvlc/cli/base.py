"""The ``kvlc`` command group and what every command shares: loading, failing, atomic writes.

Exit codes: 0 success, 2 a spec / pairing problem (every problem printed), 1 a
failed run (transfer mismatch).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import click

from kvlc.compiler import load_plan
from kvlc.compiler.spec.source import load_config, parse_set
from kvlc.errors import KvlcError, did_you_mean

EXIT_SPEC = 2


class Choice(click.Choice):
    """click's Choice (listed in --help) whose refusal names the closest choice: "did you mean ...?"."""

    def convert(self, value, param, ctx):
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter:
            self.fail(f"{value!r} is not a choice; {did_you_mean(value, self.choices)} "
                      f"(every choice is listed in --help)", param, ctx)


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
    return (load_config(config) if config else None), parse_set(sets)


def _load_plan(path: str, config: str | None = None, sets: tuple[str, ...] = ()):
    """A compiled plan from a spec (``.yaml``/``.yaml.j2``) or a plan (``.json``)."""
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


def emit(text: str, output: str | None, note: str = "written") -> None:
    """Write ``text`` to ``output`` atomically (saying so on stderr), or print it."""
    if output:
        write_atomic(output, text)
        click.echo(f"{output}: {note}", err=True)
    else:
        click.echo(text, nl=False)


def _echo_json(doc: dict) -> None:
    import json
    click.echo(json.dumps(doc, indent=2))


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
