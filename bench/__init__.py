"""Benchmarks: `python -m bench.<name> [--quick]`; each prints a table and a final JSON line."""
