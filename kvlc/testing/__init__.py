"""Test and demo harness for kvlc's runtime: not part of the product API.

* :mod:`kvlc.testing.procs`: :class:`~kvlc.runtime.agent.KvAgent` s in child processes, driven
  over a pipe (the demo, the runtime tests, the benchmarks and the soak use it).
* :mod:`kvlc.testing.demo`: the loopback demo behind ``kvlc demo``: scaled CPU variants of
  layouts, a workload generator, a byte checker.

It imports nixl and torch only inside the child processes it starts.
"""
