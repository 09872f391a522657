"""Test and benchmark support that is not product: vLLM test engines with tiny random-weight models,
and a two-process staging pair. Not installed with kvlc; tests and benchmarks import it from the repository root."""
