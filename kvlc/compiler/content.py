"""Moved to :mod:`kvlc.testing.content` (a test oracle, not a compiler stage); this name stays importable."""

from kvlc.testing.content import code, expected_bytes, field_elements, fill  # noqa: F401
