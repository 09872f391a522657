"""Loading kvlc's C libraries: plain C (no Python API), built by ``pip install`` as optional extensions,
loaded with ctypes so that one build loads under any CPython of its platform.

Each library has a Python reference that runs where it is not loaded; ``KVLC_NATIVE=0`` turns every one
off. :func:`load` says why a library is not used, in one line, for the callers' ``status()``.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path


def load(folder: Path, stem: str, source: str, abi_symbol: str, abi: int, fallback: str
         ) -> tuple[ctypes.CDLL | None, str]:
    """The library ``<stem>*.so`` (or .dylib / .pyd) in ``folder`` built from ``source`` whose ``abi_symbol()``
    returns ``abi``, and ``"native (<file>)"``; or None and why not (each reason ends in ``fallback``:
    what runs instead)."""
    if os.environ.get("KVLC_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None, f"off (KVLC_NATIVE=0): {fallback}"
    found = [p for ext in ("so", "dylib", "pyd") for p in sorted(folder.glob(f"{stem}*.{ext}"))]
    if not found:
        return None, (f"not built (no {stem} library next to {source}; reinstall with a C compiler: "
                      f"pip install -e .): {fallback}")
    try:
        lib = ctypes.CDLL(str(found[0]))
    except OSError as exc:
        return None, f"{found[0].name} does not load ({exc}): {fallback}"
    got = getattr(lib, abi_symbol)()
    if got != abi:
        return None, f"{found[0].name} is ABI {got}, this kvlc wants {abi} (a stale build: pip install -e . again): {fallback}"
    return lib, f"native ({found[0].name})"
