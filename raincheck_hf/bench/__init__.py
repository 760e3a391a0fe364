"""Benchmarks (``python -m raincheck_hf.bench <name> ...``): each prints a table and writes JSON."""
