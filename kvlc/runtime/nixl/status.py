"""NIXL statuses as kvlc sees them: every failure a :class:`~kvlc.runtime.errors.NixlError` that names
the operation, every transfer state an :class:`XferState` (no status string travels further).

:mod:`kvlc.runtime.nixl.core` wraps each NIXL call with :func:`call`, :func:`run` or :func:`check`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvlc.runtime.errors import NixlError

OPS = ("READ", "WRITE")
MEM_TYPES = ("DRAM", "VRAM")

class XferState(enum.Enum):
    """State of one NIXL transfer request."""

    DONE = "DONE"
    PROC = "PROC"
    ERR = "ERR"

    @property
    def terminal(self) -> bool:
        return self is not XferState.PROC

def _status_of(exc: BaseException) -> str:
    text = str(exc).strip()
    if text.startswith("NIXL_"):
        return text.split()[0]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def check(value: Any, what: str) -> Any:
    """Pass ``value`` through, or raise :class:`NixlError` naming ``what``.

    ``value`` may be what a NIXL call returned, or the exception it raised.

    >>> check(b"md", "get metadata")
    b'md'
    >>> check("ERR", "post transfer")
    Traceback (most recent call last):
    ...
    kvlc.runtime.errors.NixlError: NIXL post transfer failed: NIXL_ERR
    """
    if isinstance(value, NixlError):
        raise value
    if isinstance(value, BaseException):
        raise NixlError(what, _status_of(value)) from value
    if value is None:
        raise NixlError(what, "no result", "NIXL returned None")
    if isinstance(value, str) and value == "ERR":
        raise NixlError(what, "NIXL_ERR")
    return value


def call(what: str, fn: Callable, *args, **kwargs) -> Any:
    """Run one NIXL call; any failure becomes a :class:`NixlError` naming ``what``."""
    try:
        value = fn(*args, **kwargs)
    except NixlError:
        raise
    except Exception as exc:  # NIXL raises its own exception types, plus ValueError/KeyError
        raise NixlError(what, _status_of(exc)) from exc
    return check(value, what)


def run(what: str, fn: Callable, *args, **kwargs) -> None:
    """Run a NIXL call that returns nothing; an exception becomes a :class:`NixlError`."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        raise NixlError(what, _status_of(exc)) from exc


def _state(status: str) -> XferState:
    try:
        return XferState(status)
    except ValueError:
        return XferState.ERR

def _rows(rows: np.ndarray, what: str, width: Sequence[int] = (3,)) -> np.ndarray:
    arr = np.ascontiguousarray(rows, dtype=np.uint64)
    if arr.ndim != 2 or arr.shape[1] not in width:
        raise NixlError(
            what,
            "bad descriptors",
            f"expected an (N, {'|'.join(map(str, width))}) uint64 array, got shape {arr.shape}",
        )
    return arr
