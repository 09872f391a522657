"""Moved to :mod:`kvlc.testing.content` (a test oracle, not a compiler stage); this name stays importable."""

from kvlc.testing.content import code, expected_bytes, field_elements, fill

__all__ = ["code", "expected_bytes", "field_elements", "fill"]
