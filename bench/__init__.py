"""Developer benchmarks and probes, run from a checkout (``python -m bench.<name>``, see the Makefile).

What an operator runs ships as ``hpkv bench`` (ttft, serve, cold, l2, valkey); these measure hpkv's
parts on their own (tiers, the GPU mover, SGLang's controller on CPU, a decode beside a load).
"""
