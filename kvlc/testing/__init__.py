"""Test support shipped with kvlc: the content oracle (bytes that say what they are).

Not part of the compiler or the runtime; tests, ``kvlc demo`` and benchmarks use it to prove
transfers byte by byte.
"""
