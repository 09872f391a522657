"""kvlc as a vLLM KV connector (``pip install 'kvlc[vllm]'``).

Load it in vLLM with::

    KVTransferConfig(kv_connector="KvlcConnector", kv_connector_module_path="kvlc.engines.vllm",
                     kv_role="kv_producer" | "kv_consumer" | "kv_both",
                     kv_connector_extra_config={"host": "127.0.0.1", "port": 7100, "mode": "pull"})

vLLM is imported only when :class:`KvlcConnector` is first looked up, so
``import kvlc.engines.vllm`` works without vLLM installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvlcConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvlcConnector":
        from kvlc.engines.vllm.connector.connector import KvlcConnector

        return KvlcConnector
    raise AttributeError(f"module 'kvlc.engines.vllm' has no attribute {name!r}")
