"""KvlcConnector: vLLM's KV connector interface (``KVConnectorBase_V1``) on top of kvlc.

vLLM creates it twice: with role SCHEDULER in the EngineCore process and with role
WORKER in each worker process (one process in single-process mode). Each role
delegates to :class:`~kvlc.engines.vllm.connector.scheduler.SchedulerSide` or
:class:`~kvlc.engines.vllm.connector.worker.WorkerSide`; nothing is shared between them but
vLLM's metadata and outputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from kvlc.engines.vllm.connector.config import ConnectorSettings
from kvlc.engines.vllm.connector.metadata import KvlcConnectorMetadata
from kvlc.engines.vllm.connector.scheduler import SchedulerSide
from kvlc.engines.vllm.connector.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


class KvlcConnector(KVConnectorBase_V1):
    """Prefill/decode KV transfer through kvlc (see ``docs/vllm.md``).

    Load it with ``KVTransferConfig(kv_connector="KvlcConnector",
    kv_connector_module_path="kvlc.engines.vllm", kv_role=..., kv_connector_extra_config=
    {"host": ..., "port": ..., "mode": "pull" | "push" | "pull_via_push", "spec": path})``.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = ConnectorSettings.from_extra(vllm_config.kv_transfer_config.kv_connector_extra_config)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(vllm_config, self.settings)
        else:
            self.worker = WorkerSide(vllm_config, kv_cache_config, self.settings)

    # ------------------------------------------------------------------ worker
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.worker.register(kv_caches)

    def get_handshake_metadata(self):
        return self.worker.handshake() if self.worker is not None else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, KvlcConnectorMetadata):
            self.worker.bind(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, KvlcConnectorMetadata):
            self.worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous: a request reaches the forward only once its KV has landed."""
        return None

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        """Nothing to save: consumers take the blocks where they are."""
        return None

    def wait_for_save(self) -> None:
        self.worker.after_forward()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self.worker.finished(finished_req_ids)
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving = self.worker.finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=self.worker.failed_recving())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors() if self.worker is not None else set()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()

    # ------------------------------------------------------------------ scheduler
    def set_xfer_handshake_metadata(self, metadata) -> None:
        self.scheduler.set_handshake(metadata)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self.scheduler.build_meta(scheduler_output, self._kv_cache_manager)

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))
