"""Benchmarks of coalescer against the baseline design (SPEC §6): ``python -m bench.run``."""
