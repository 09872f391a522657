"""The ``kvlc`` command line: compile | check | explain | size | schema | render | init | pair | demo |
from-vllm | proxy.

Exit codes: 0 success, 2 a spec / pairing problem (every problem printed), 1 a
failed run (transfer mismatch). One module per kind of command; importing
this package registers them all on :func:`main`.
"""

from kvlc.cli import proxy_cmd, run_cmds, show_cmds, spec_cmds  # noqa: F401  (importing registers the commands)
from kvlc.cli.base import EXIT_SPEC, entry, main, write_atomic

__all__ = ["EXIT_SPEC", "entry", "main", "write_atomic"]
