"""The kvlc spec of a vLLM engine: read from a live engine, or computed offline from a model's config.json."""
