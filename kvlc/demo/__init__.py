"""``kvlc demo``: a producer and a consumer process move a content-coded workload, every byte checked.

* :mod:`kvlc.demo.content`: content-coded memory, bytes that say what they are (the oracle that tests
  and benchmarks also use to prove transfers byte by byte).
* :mod:`kvlc.demo.workload`: rounds of requests that fit both engines' pools, and their check.
* :mod:`kvlc.demo.procs`: :class:`~kvlc.runtime.agent.KvAgent` s hosted in child processes, driven
  over a pipe.
* :mod:`kvlc.demo.run`: the demo itself: scaled CPU variants of layouts, the run, the report.

It imports nixl and torch only inside the child processes it starts.
"""
