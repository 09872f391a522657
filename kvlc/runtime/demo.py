"""Moved to :mod:`kvlc.testing.demo` (the demo harness is not part of the runtime); kept so older
scripts still import."""

from kvlc.testing.demo import *  # noqa: F401,F403
from kvlc.testing.demo import (  # noqa: F401
    MODES, DemoResult, cpu_plan, default_tokens, make_workload, run_demo, scaled_plan, verify,
)
