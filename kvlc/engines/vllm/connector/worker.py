"""The connector's worker side: bind the KV cache, start loads, serve producers, report results.

Runs in each vLLM worker process (one per TP rank). What it knows comes from the
step's :class:`~kvlc.engines.vllm.connector.metadata.KvlcConnectorMetadata`; what it reports
goes back through vLLM's outputs (``get_transfer_results`` / ``get_block_ids_with_load_errors``).
Its hooks keep vLLM's names. Loads are asynchronous: the request waits in the scheduler until
every rank reports it received, so :meth:`WorkerSide.wait_for_layer_load` never has to block.
:meth:`WorkerSide.get_transfer_results` is the one method that polls the agent (NIXL).

Sleep (vLLM 0.34's sleep mode, levels 1 and 2): :meth:`WorkerSide.unregister_kv_caches` closes the
rank's transport (NIXL deregisters the KV cache; sessions, connections and transfers end; peers see
the side channel close). Loads still in flight fail, reported once at the next poll; blocks held
for consumers are given back. :meth:`WorkerSide.restore_kv_caches` binds the KV cache again (its
tensors may have moved) as a new agent, so a new epoch, on the same two addresses: a peer's next
request connects again, as after a restart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvlc.engines.vllm.connector.config import ConnectorSettings
from kvlc.engines.vllm.connector.layout import CPU_MLA_BACKENDS, engine_plan, runnable_state
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


def _merged(polls: list):
    """Several polls' completions as one (the agent closed for sleep, then the agent woken)."""
    c = polls[-1]
    for left in polls[:-1]:
        c = replace(c, finished=left.finished + c.finished, failed={**left.failed, **c.failed},
                    held={**left.held, **c.held}, freeable=left.freeable + c.freeable)
    return c


@dataclass(frozen=True)
class _Asleep:
    """A rank between sleep and wake: the addresses its peers know, and the plan they paired with."""

    address: str
    push_address: str
    digest: str

    @property
    def channel_port(self) -> int:
        return int(self.address.rpartition(":")[2])

    @property
    def push_port(self) -> int:
        return int(self.push_address.rpartition(":")[2])


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
        self._asleep: _Asleep | None = None  # between unregister_kv_caches and restore_kv_caches
        self._closed: Transport | None = None  # closed for sleep: its last events not polled yet
        self._stats = KvlcConnectorStats()  # since vLLM last asked (get_kv_connector_stats)
        self._moved = (0, 0)  # the agent's bytes and descriptors when vLLM last asked
        # vLLM's default policy is "fail" (a config object without the field: an older vLLM, same default)
        kv = getattr(vllm_config, "kv_transfer_config", None)
        self._recompute = getattr(kv, "kv_load_failure_policy", "fail") == "recompute"

    # ------------------------------------------------------------------ set-up
    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.rank = int(get_tensor_model_parallel_rank())
        self.kv_caches = dict(kv_caches)
        runnable_state(self.kv_cache_config)
        self.transport = self._bind(None)
        log.info("kvlc: rank %d bound plan %s (%s) at %s", self.rank, self.transport.ep.plan.name,
                 self.transport.ep.plan.digest[:12], self.transport.address)
        kv = getattr(self.vllm_config, "kv_transfer_config", None)
        if self.transport.ep.backend in CPU_MLA_BACKENDS and getattr(kv, "is_kv_consumer", False):
            log.warning("kvlc: rank %d: vLLM's %s backend recomputes a prompt's last token after loaded KV with "
                        "other RoPE keys than its own prefill gives it, so this decode engine's tokens will differ "
                        "from the engine alone, whatever connector loads the KV (the KV kvlc moves is exact); "
                        "docs/vllm.md, 'MLA on CPU'", self.rank, self.transport.ep.backend)

    def _bind(self, ports: tuple[int, int] | None) -> Transport:
        """This rank's plan over the KV cache tensors as they are now, served by a new agent."""
        ep = engine_plan(self.vllm_config, self.kv_cache_config, self.kv_caches, self.rank, self.settings.spec)
        engine_id = str(self.vllm_config.kv_transfer_config.engine_id)
        return Transport(ep, self.settings, engine_id, ports)

    # ------------------------------------------------------------------ sleep mode (vLLM 0.34)
    def unregister_kv_caches(self) -> None:
        """Before vLLM sleeps: end the agent (see the module docstring). Idempotent."""
        t = self.transport
        if t is None:
            return
        self.transport = None
        self._asleep = _Asleep(t.address, t.push_address, t.ep.plan.digest)
        self._ready_after_step = []
        t.close()  # transfers in flight end failed (reported by its next poll); NIXL deregisters the KV cache
        self._closed = t
        why = "vLLM put this engine to sleep while the load was in flight; nothing lands after it"
        for kid in self._loads:  # loads the close did not end (a push not started): failed too, reported once
            self._failed.setdefault(kid, why)
        self._early.update(dict.fromkeys(self._holds, time.monotonic()))  # no consumer can read them now
        log.info("kvlc: rank %d asleep: KV cache unregistered at %s (%d load(s) failed, %d hold(s) given back)",
                 self.rank, t.address, len(self._failed), len(self._holds))

    def restore_kv_caches(self) -> None:
        """After vLLM woke: bind the KV cache again under a new epoch, on the same addresses. Idempotent."""
        asleep = self._asleep
        if asleep is None or self.transport is not None:
            return
        try:
            t = self._bind((asleep.channel_port, asleep.push_port))
        except KvlcError as exc:
            raise KvlcError(f"kvlc: rank {self.rank} cannot register its KV cache again after sleep at "
                            f"{asleep.address} (its peers know this address): {exc}") from exc
        if t.ep.plan.digest != asleep.digest:
            t.close()
            raise KvlcError(f"kvlc: rank {self.rank}: after sleep the KV cache derives plan {t.ep.plan.digest[:12]}, "
                            f"before it {asleep.digest[:12]}; peers paired with the old one: restart the engine")
        self.transport, self._asleep = t, None
        log.info("kvlc: rank %d awake: KV cache registered again at %s (agent %s, epoch %s)",
                 self.rank, t.address, t.agent.name, t.agent.epoch[:8])

    def get_handshake_metadata(self) -> KvlcHandshake | None:
        t = self.transport
        if t is None:
            return None
        return KvlcHandshake(self.rank, t.address, t.push_address, t.ep.plan.digest, t.ep.block_size,
                             t.ep.groups, t.ep.cpu_isa)

    def _t(self) -> Transport:
        if self.transport is None:
            if self._asleep is not None:
                raise KvlcError("kvlc connector used while vLLM sleeps (unregister_kv_caches ran, "
                                "restore_kv_caches did not yet)")
            raise KvlcError("kvlc connector used before register_kv_caches bound the KV cache")
        return self.transport

    # ------------------------------------------------------------------ per step
    def bind_connector_metadata(self, meta: KvlcConnectorMetadata) -> None:
        now = time.monotonic()
        if self.transport is None and self._asleep is not None:
            for h in meta.holds:  # no consumer can read them while asleep: given back at the next poll
                self._holds[h.req_id], self._early[h.req_id] = now, now
            return
        t = self._t()
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
        for load in meta.loads:
            self._loads[load.kvlc_id] = load
            timing = self._timing[load.kvlc_id] = _Timing(time.monotonic())
            r = load.remote
            log.info("kvlc: rank %d loads request %s (tokens [%d, %d), %s) from %s: local %s remote %s",
                     self.rank, load.req_id, load.tokens.start, load.tokens.stop, load.mode.value,
                     r.kvlc_addresses[0], dict(load.local_block_ids), dict(load.remote_block_ids))
            try:
                t = self._t()
                _check_isas(t.ep.cpu_isa, r.kvlc_cpu_isa)
                timing.out = t.load(load, ask=self.rank == 0)
                timing.posted = time.monotonic()
            except (KvlcError, OSError) as exc:
                log.error("kvlc: load of request %s from engine %s failed: %s",
                          load.req_id, r.remote_engine_id, exc)
                if self.transport is not None:
                    self.transport.forget_peer(r.kvlc_addresses)
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
        polls = [t.poll() for t in (self._closed, self.transport) if t is not None]  # closed for sleep: first
        if self.transport is not None:
            self._closed = None  # its last events are in this poll
        if not polls:
            return KVConnectorTransferResults()
        c = _merged(polls)  # c.held: failed, but bytes may still land: wait for c.failed
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
                if self.transport is not None:
                    self.transport.drop_source(req)
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
