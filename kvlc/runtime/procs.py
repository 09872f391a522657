"""Moved to :mod:`kvlc.testing.procs` (the process harness is not part of the runtime); kept so
older scripts still import."""

from kvlc.testing.procs import AgentHandle, EngineConfig, EngineProcess, RemoteError, start_engines, stop_engines

__all__ = ['AgentHandle', 'EngineConfig', 'EngineProcess', 'RemoteError', 'start_engines', 'stop_engines']
