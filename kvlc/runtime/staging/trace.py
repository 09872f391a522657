"""A timeline of staged chunks, for finding where a staged transfer spends its time.

Off unless ``KVLC_STAGING_TRACE`` names a folder: every :class:`~kvlc.runtime.staging.endpoint.StagingEndpoint`
of the process then records one row per step of each chunk (``queued``, ``gather``, ``gathered``,
``posted``, ``written`` on the sender; ``landed``, ``scatter``, ``scattered`` on the receiver;
``freed`` back on the sender; on a GPU also ``gather_gpu`` / ``scatter_gpu``, whose ``value`` is
the copy's time on the GPU in µs, between CUDA events around it) with ``time.monotonic_ns()`` (one clock for every process of a
machine), this agent's and the peer's names, and writes them as JSON lines to ``<folder>/staging-<pid>-<n>.jsonl`` when the
endpoint's agent closes (and at exit). At most :data:`LIMIT` rows are kept per endpoint; the
rest are counted, not stored. ``benchmarks/staging_timeline.py`` turns the files into
per-step durations.

>>> t = Trace("/tmp/unused")
>>> t("queued", "r1", 0, slot=-1, nbytes=64, peer="decode-0")
>>> t.rows[0].step, t.rows[0].req, t.rows[0].nbytes, t.rows[0].peer
('queued', 'r1', 64, 'decode-0')
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import time
from pathlib import Path
from typing import NamedTuple

ENV = "KVLC_STAGING_TRACE"
LIMIT = 1 << 20
_seq = itertools.count()


class Row(NamedTuple):
    """One step of one chunk."""

    t_ns: int
    step: str
    req: str
    seq: int
    slot: int
    nbytes: int
    peer: str
    value: float


class Trace:
    """The rows (:class:`Row`) of one endpoint; :meth:`dump` writes them once."""

    def __init__(self, folder: str | os.PathLike, agent: str = ""):
        self.agent = agent  # this endpoint's NIXL agent name (a chunk is keyed by request, chunk, sender)
        self.path = Path(folder) / f"staging-{os.getpid()}-{next(_seq)}.jsonl"
        self.rows: list[Row] = []
        self.dropped = 0
        self._written = False
        atexit.register(self.dump)

    def __call__(self, step: str, req: str, seq: int, slot: int = -1, nbytes: int = 0, peer: str = "",
                 value: float = 0.0) -> None:
        if len(self.rows) < LIMIT:
            self.rows.append(Row(time.monotonic_ns(), step, req, seq, slot, nbytes, peer, value))
        else:
            self.dropped += 1

    def gpu_time(self, step: str, req: str, seq: int, started, ended, peer: str) -> None:
        """Record how long a traced copy ran on the GPU (between its timing CUDA events, if both exist), in µs."""
        if started is not None and ended is not None:
            self(step, req, seq, peer=peer, value=started.elapsed_time(ended) * 1e3)

    def dump(self) -> Path | None:
        """Write the rows (first call only); returns the file, or None if there was nothing."""
        if self._written or not self.rows:
            return None
        self._written = True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w") as fh:
            for row in self.rows:
                fh.write(json.dumps({"pid": os.getpid(), "agent": self.agent, **row._asdict()}) + "\n")
            if self.dropped:
                fh.write(json.dumps({"dropped": self.dropped}) + "\n")
        return self.path


def from_env(agent: str = "", env=os.environ) -> Trace | None:
    """A :class:`Trace` into the folder ``KVLC_STAGING_TRACE`` names, or None when it is unset or empty."""
    folder = env.get(ENV, "")
    return Trace(folder, agent) if folder else None
