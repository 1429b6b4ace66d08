"""Helpers every layer may use: counted nouns, redacted URLs, retrying loops with
backoff, fork safety and the metrics registry.

The lowest layer: imports nothing of coalescer but ``coalescer.errors``.
"""
