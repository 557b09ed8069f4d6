"""Foundations shared by every layer: config, keys, chunk records, layout, errors, stats.

Nothing in here imports another part of hpkv.
"""
