"""Moved to :mod:`kvlc.testing.procs` (the process harness is not part of the runtime); kept so
older scripts still import."""

from kvlc.testing.procs import *  # noqa: F401,F403
from kvlc.testing.procs import AgentHandle, EngineConfig, EngineProcess, start_engines, stop_engines  # noqa: F401
