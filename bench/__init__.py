"""Benchmarks of coalescer against the baseline design: ``python -m bench.run``."""
