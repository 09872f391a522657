"""The connector's worker side: bind the KV cache, start loads, serve producers, report results.

Runs in each vLLM worker process (one per TP rank). What it knows comes from the
step's :class:`~kvlc.engines.vllm.connector.metadata.KvlcConnectorMetadata`; what it reports
goes back through vLLM's outputs (``get_transfer_results`` / ``get_block_ids_with_load_errors``).
Its hooks keep vLLM's names. Loads are asynchronous: the request waits in the scheduler until
every rank reports it received, so :meth:`WorkerSide.wait_for_layer_load` never has to block.
:meth:`WorkerSide.get_transfer_results` is the one method that polls the agent (NIXL).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvlc.engines.vllm.connector.config import ConnectorSettings
from kvlc.engines.vllm.connector.layout import engine_plan
from kvlc.engines.vllm.connector.metadata import KvlcConnectorMetadata, KvlcHandshake, Load, plan_block_ids
from kvlc.engines.vllm.connector.stats import KvlcConnectorStats
from kvlc.engines.vllm.connector.transport import Transport
from kvlc.engines.vllm.derive.cpu import isa_mismatch
from kvlc.errors import KvlcError

log = logging.getLogger("vllm.kvlc")  # under vLLM's logger: its handlers and levels apply
_EARLY_TTL_S = 600.0  # how long a consumer's "done" is remembered before the hold is known
_BACKSTOP_S = 5.0  # after the lease: free the blocks even if the agent said nothing


def _check_isas(mine: str, theirs: str) -> None:
    """Refuse a producer whose CPU attention ISA orders a block's tokens otherwise (before pairing, with why)."""
    why = isa_mismatch(mine, theirs)
    if why is not None:
        raise KvlcError(why)


class _Timing:
    """One load's clock (monotonic seconds): handed to the worker, posted to NIXL, and the READ
    it posted (pull: its ``started`` / ``finished``, as the agent saw them)."""

    __slots__ = ("started", "posted", "out")

    def __init__(self, started: float):
        self.started = started
        self.posted = started
        self.out = None

    def split(self, seen: float) -> tuple[float, float]:
        """(transfer, overhead) of a load reported received at ``seen``: the transfer is the READ's
        own time where this rank posted one (else posted to seen); the overhead is the rest."""
        out = self.out
        if out is not None and out.finished is not None:
            transfer = out.finished - out.started
        else:
            transfer = seen - self.posted
        return transfer, max(0.0, seen - self.started - transfer)


class WorkerSide:
    """Worker-side state of one TP rank (see the module docstring)."""

    def __init__(self, vllm_config, kv_cache_config, settings: ConnectorSettings):
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.settings = settings
        self.transport: Transport | None = None
        self.kv_caches: dict[str, Any] = {}
        self.rank = 0
        self._loads: dict[str, Load] = {}  # kvlc id -> load in flight
        self._failed: dict[str, str] = {}  # kvlc id -> why, found at start (reported next poll)
        self._holds: dict[str, float] = {}  # prefill request -> lease deadline
        self._early: dict[str, float] = {}  # freeable before its hold arrived -> when seen
        self._ready_after_step: list[str] = []
        self._load_errors: set[int] = set()
        self._failed_recving: set[str] = set()
        self._timing: dict[str, _Timing] = {}  # kvlc id -> its load's clock
        self.load_seconds: list[float] = []  # start to "received" of every finished load
        self._stats = KvlcConnectorStats()  # since vLLM last asked (get_kv_connector_stats)
        self._moved = (0, 0)  # the agent's bytes and descriptors when vLLM last asked
        self._recompute = vllm_config.kv_transfer_config.kv_load_failure_policy == "recompute"

    # ------------------------------------------------------------------ set-up
    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.rank = int(get_tensor_model_parallel_rank())
        self.kv_caches = dict(kv_caches)
        ep = engine_plan(self.vllm_config, self.kv_cache_config, kv_caches, self.rank, self.settings.spec)
        engine_id = str(self.vllm_config.kv_transfer_config.engine_id)
        self.transport = Transport(ep, self.settings, engine_id)
        log.info("kvlc: rank %d bound plan %s (%s) at %s", self.rank, ep.plan.name,
                 ep.plan.digest[:12], self.transport.address)

    def get_handshake_metadata(self) -> KvlcHandshake | None:
        t = self.transport
        if t is None:
            return None
        return KvlcHandshake(self.rank, t.address, t.push_address, t.ep.plan.digest, t.ep.block_size,
                             t.ep.groups, t.ep.cpu_isa)

    def _t(self) -> Transport:
        if self.transport is None:
            raise KvlcError("kvlc connector used before register_kv_caches bound the KV cache")
        return self.transport

    # ------------------------------------------------------------------ per step
    def bind_connector_metadata(self, meta: KvlcConnectorMetadata) -> None:
        t = self._t()
        now = time.monotonic()
        for src in meta.sources:
            t.add_source(src.req_id, plan_block_ids(t.ep.groups, src.block_ids))
            if src.complete:
                self._ready_after_step.append(src.req_id)
        for req in meta.dropped:
            t.drop_source(req)
        for h in meta.holds:
            # the agent reports the blocks freeable when the consumer is done or the lease ends;
            # this deadline is only a backstop a little later
            t.offer(h.req_id, h.lease)
            self._holds[h.req_id] = now + h.lease + _BACKSTOP_S

    def start_load_kv(self, meta: KvlcConnectorMetadata) -> None:
        t = self._t()
        for load in meta.loads:
            self._loads[load.kvlc_id] = load
            timing = self._timing[load.kvlc_id] = _Timing(time.monotonic())
            r = load.remote
            log.info("kvlc: rank %d loads request %s (tokens [%d, %d), %s) from %s: local %s remote %s",
                     self.rank, load.req_id, load.tokens.start, load.tokens.stop, load.mode.value,
                     r.kvlc_addresses[0], dict(load.local_block_ids), dict(load.remote_block_ids))
            try:
                _check_isas(t.ep.cpu_isa, r.kvlc_cpu_isa)
                timing.out = t.load(load, ask=self.rank == 0)
                timing.posted = time.monotonic()
            except (KvlcError, OSError) as exc:
                log.error("kvlc: load of request %s from engine %s failed: %s",
                          load.req_id, r.remote_engine_id, exc)
                t.forget_peer(r.kvlc_addresses)
                self._failed[load.kvlc_id] = str(exc)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous: a request reaches the forward only once its KV has landed."""
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        """Nothing to save: consumers take the blocks where they are."""
        return None

    def wait_for_save(self) -> None:
        """This step's forward ran: the KV of sources that completed in it is ready to push."""
        ready, self._ready_after_step = self._ready_after_step, []
        for req in ready:
            self._t().source_ready(req)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Poll the agent once: requests whose blocks the producer may free, loads received (or failed:
        reported received, their blocks in :meth:`get_block_ids_with_load_errors` or failed_recving)."""
        if self.transport is None:
            return KVConnectorTransferResults()
        c = self.transport.poll()  # c.held: failed, but bytes may still land: wait for c.failed
        failed = dict(c.failed)
        failed.update(self._failed)
        self._failed = {}
        recving = set()
        now = time.monotonic()
        for kid in c.finished:
            load = self._loads.pop(kid, None)
            timing = self._timing.pop(kid, None)
            if load is not None and timing is not None:
                recving.add(load.req_id)
                self.load_seconds.append(now - timing.started)
                self._stats.record_load(*timing.split(now))
        for kid, why in failed.items():
            load = self._loads.pop(kid, None)
            self._timing.pop(kid, None)
            if load is not None:
                log.error("kvlc: request %s: KV load failed (%s); reporting its blocks to vLLM",
                          load.req_id, why)
                self._report_failure(load)
                self._stats.record_failure(recompute=self._recompute)
                recving.add(load.req_id)
        failed_recving, self._failed_recving = self._failed_recving, set()
        return KVConnectorTransferResults(finished_sending=self._sending(c.freeable), finished_recving=recving,
                                          failed_recving=failed_recving)

    def _report_failure(self, load: Load) -> None:
        if len(load.local_block_ids) > 1:
            self._failed_recving.add(load.req_id)
        else:
            self._load_errors.update(*load.local_block_ids.values())

    def _sending(self, freeable) -> set[str]:
        now = time.monotonic()
        for req in freeable:
            self._early[req] = now
        done = set()
        for req, deadline in list(self._holds.items()):
            if req in self._early or now >= deadline:
                if req not in self._early:
                    log.warning("kvlc: lease of request %s ended before its consumer finished", req)
                self._early.pop(req, None)
                del self._holds[req]
                self._t().drop_source(req)
                done.add(req)
        for req, seen in list(self._early.items()):
            if now - seen > _EARLY_TTL_S:
                del self._early[req]
        return done

    def get_block_ids_with_load_errors(self) -> set[int]:
        errs, self._load_errors = self._load_errors, set()
        return errs

    def get_kv_connector_stats(self) -> KvlcConnectorStats | None:
        """What this rank did since vLLM last asked (None: nothing): loads and their seconds, failures,
        and the bytes and descriptors its agent moved (READs it posted, pushes it served)."""
        if self.transport is not None:
            moved = (int(self.transport.stats["bytes"]), int(self.transport.stats["descriptors"]))
            self._stats.record_moved(moved[0] - self._moved[0], moved[1] - self._moved[1])
            self._moved = moved
        return None if self._stats.is_empty() else self._stats.clone_and_reset()

    def stats(self) -> dict:
        """The agent's counters (requests, bytes, descriptors) and the seconds of each finished load."""
        if self.transport is None:
            return {}
        return {**self.transport.stats, "load_seconds": list(self.load_seconds)}

    def shutdown(self) -> None:
        t, self.transport = self.transport, None
        if t is not None:
            t.close()
