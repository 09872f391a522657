"""Engine adapters: kvlc loaded by inference engines.

``kvlc.engines.vllm`` is a vLLM KV connector (needs the ``vllm`` extra). Nothing here is
imported by ``import kvlc``; each adapter imports its engine only when it is used.
"""
