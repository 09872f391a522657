"""Test and benchmark support that is not product: vLLM test engines with tiny random-weight models,
a two-process staging pair, torch.cuda stood in for on a CPU (GPU copy logic). Not installed with kvlc; tests and benchmarks import it from the repository root."""
