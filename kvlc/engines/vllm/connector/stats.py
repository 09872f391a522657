"""The connector's transfer metrics, in vLLM's connector stats (``KVConnectorStats``).

vLLM asks each worker for its stats after every step (``get_kv_connector_stats``), adds the
scheduler's, ships the ``data`` dict to the frontend with the scheduler stats, and rebuilds it
there with the connector class's ``build_kv_connector_stats``: its logger aggregates the steps of
an interval and logs ``reduce()`` ("KV Transfer metrics: ..."). Here ``data`` holds counters and
the seconds of each finished load; a worker hands over what it gathered since it was last asked.

>>> s = KvlcConnectorStats()
>>> s.is_empty()
True
>>> s.record_load(0.002, 0.0005); s.record_moved(4096, 2)
>>> s.record_failure(recompute=True)
>>> r = s.aggregate(KvlcConnectorStats(data={**KvlcConnectorStats().data, "loads": 1, "bytes": 4096,
...                                          "transfer_s": [0.004], "overhead_s": [0.0015]})).reduce()
>>> r["loads"], r["bytes"], r["failures"], r["recomputes"], r["transfer_ms_p50"], r["overhead_ms_p50"]
(2, 8192, 1, 1, 3.0, 1.0)
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

COUNTERS = ("loads", "bytes", "descriptors", "failures", "recomputes")
SERIES = ("transfer_s", "overhead_s")  # per finished load: posted to received; the connector's own share


def _empty() -> dict[str, Any]:
    return {**{k: 0 for k in COUNTERS}, **{k: [] for k in SERIES}}


def _ms(values: list[float], how) -> float:
    """``how(values)`` (seconds) in milliseconds, 3 decimals (0.0 when empty)."""
    return round(1000 * how(values), 3) if values else 0.0


@dataclass
class KvlcConnectorStats(KVConnectorStats):
    """kvlc's counters (``loads``, ``bytes``, ``descriptors``, ``failures``, ``recomputes``) and per-load
    seconds (``transfer_s``: load posted to received; ``overhead_s``: the connector's own time around it)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = _empty()

    def record_load(self, transfer: float, overhead: float) -> None:
        """A load finished: its bytes moved in ``transfer`` seconds; the connector spent ``overhead``
        seconds around that (handed to the worker to reported received, less the transfer)."""
        self.data["loads"] += 1
        self.data["transfer_s"].append(float(transfer))
        self.data["overhead_s"].append(float(overhead))

    def record_moved(self, nbytes: int, descriptors: int) -> None:
        """This rank's agent moved ``nbytes`` in ``descriptors`` (READs it posted, pushes it served)."""
        self.data["bytes"] += int(nbytes)
        self.data["descriptors"] += int(descriptors)

    def record_failure(self, *, recompute: bool) -> None:
        """A load failed (or could not start); ``recompute``: vLLM computes its tokens instead."""
        self.data["failures"] += 1
        self.data["recomputes"] += int(recompute)

    def record_recompute(self) -> None:
        """A request given a remote prefill computes its prompt locally (never loaded)."""
        self.data["recomputes"] += 1

    def clone_and_reset(self) -> KvlcConnectorStats:
        """What was gathered so far (a new object); this one starts empty again."""
        out = KvlcConnectorStats(data=self.data)
        self.reset()
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in COUNTERS + SERIES)

    def aggregate(self, other: KVConnectorStats) -> KvlcConnectorStats:
        for k in COUNTERS:
            self.data[k] = self.data.get(k, 0) + other.data.get(k, 0)
        for k in SERIES:
            self.data[k] = list(self.data.get(k, [])) + list(other.data.get(k, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        t, o = list(d.get("transfer_s", [])), list(d.get("overhead_s", []))
        mb_s = d.get("bytes", 0) / sum(t) / 1e6 if t and sum(t) > 0 else 0.0
        return {**{k: d.get(k, 0) for k in COUNTERS},
                "transfer_ms_p50": _ms(t, statistics.median), "transfer_ms_max": _ms(t, max),
                "overhead_ms_p50": _ms(o, statistics.median), "overhead_ms_max": _ms(o, max),
                "throughput_MB_s": round(mb_s, 1)}
