"""KvlcConnector, vLLM's KV connector on top of kvlc: scheduler side, worker side, their metadata and settings."""
