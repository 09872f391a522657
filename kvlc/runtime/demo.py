"""Moved to :mod:`kvlc.testing.demo` (the demo harness is not part of the runtime); kept so older
scripts still import."""

from kvlc.testing.demo import MODES, DemoResult, cpu_plan, default_tokens, make_workload, run_demo, scaled_plan, verify

__all__ = ['MODES', 'DemoResult', 'cpu_plan', 'default_tokens', 'make_workload', 'run_demo', 'scaled_plan', 'verify']
