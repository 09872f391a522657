"""Checks of what callers hand a :class:`~kvlc.runtime.agent.KvAgent`: names, request ids, timeouts, settings.

Each raises a :mod:`kvlc.errors` error that names the value and says what is accepted.
"""

from __future__ import annotations

import re
from numbers import Real

from kvlc.compiler.plan.model import Plan
from kvlc.errors import KvlcError, TransferError

_NAME_OK = re.compile(r"^[A-Za-z0-9_.:@\-]{1,128}$")
_REQ_OK = re.compile(r"^[\x21-\x7e]{1,128}$")
PROGRESS = ("thread", "nixl", "manual")
MAX_SECONDS = 86400  # an agent's timeout and lease, and a request's timeout, at most (a day)


def valid_name(name: str, what: str = "agent name") -> str:
    """``name`` where it is 1-128 characters of A-Z a-z 0-9 _ . : @ - (an agent or engine name)."""
    if not isinstance(name, str) or not _NAME_OK.match(name):
        raise KvlcError(f"{what} {name!r}: use 1-128 characters of A-Z a-z 0-9 _ . : @ -")
    return name


def check_request_id(req: str) -> str:
    """``req`` where it is 1-128 printable ASCII characters without spaces."""
    if not isinstance(req, str) or not _REQ_OK.match(req):
        raise TransferError(f"request id {req!r:.40}: use 1-128 printable ASCII characters without spaces")
    return req


def request_timeout(timeout, default: float) -> float:
    """A request's seconds: ``default`` (the agent's) for None, else a number more than 0 and at most
    :data:`MAX_SECONDS`, as an agent's own timeout (a pull-via-push request carries it to the producer, whose frame
    takes no more; NaN, infinity, zero or less never make a request that cannot end or has ended)."""
    if timeout is None:
        return default
    if not _seconds(timeout):
        raise TransferError(f"timeout {timeout!r}: give seconds, more than 0 and at most {MAX_SECONDS} (None: the "
                            f"agent's {default:g} s); nothing was moved")
    return float(timeout)


def _seconds(v) -> bool:
    """Whether ``v`` is a number of seconds an agent takes: more than 0 and at most :data:`MAX_SECONDS` (NaN is not)."""
    return not isinstance(v, bool) and isinstance(v, Real) and 0 < v <= MAX_SECONDS


def check_agent_args(plan: Plan, rank, progress, timeout, lease) -> None:
    """The rank, progress mode, timeout and lease an agent of ``plan`` is made with."""
    if progress not in PROGRESS:
        raise KvlcError(f"progress {progress!r}: use 'thread', 'nixl' or 'manual'")
    for what, v in (("timeout", timeout), ("lease", lease)):
        if not _seconds(v):
            raise KvlcError(f"{what} {v!r}: give seconds, more than 0 and at most {MAX_SECONDS}")
    n = plan.parallel.ranks  # tp_size x pcp_size
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < n:
        raise KvlcError(f"rank {rank} outside plan '{plan.name}' ({_ranks_text(plan)}); use 0..{n - 1}")


def _ranks_text(plan: Plan) -> str:
    p = plan.parallel
    return f"tp_size {p.tp_size}" + (f" x pcp_size {p.pcp_size} = {p.ranks} ranks" if p.pcp_size > 1 else "")
