"""Test and demo support shipped with kvlc: not part of the compiler's or the runtime's API.

* :mod:`kvlc.testing.content`: the content oracle, bytes that say what they are; tests,
  ``kvlc demo`` and benchmarks use it to prove transfers byte by byte.
* :mod:`kvlc.testing.procs`: :class:`~kvlc.runtime.agent.KvAgent` s in child processes, driven
  over a pipe (the demo, the runtime tests, the benchmarks and the soak use it).
* :mod:`kvlc.testing.demo`: the loopback demo behind ``kvlc demo``: scaled CPU variants of
  layouts, a workload generator, a byte checker.

It imports nixl and torch only inside the child processes it starts.
"""
