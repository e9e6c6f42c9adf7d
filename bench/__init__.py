"""Benchmarks: `python -m bench.<name> [--quick | --smoke]`; each prints a table and a final JSON line.

`--smoke` (every benchmark but bench.faults) is the smallest run of the same path, which
tests/bench/test_bench_smoke.py runs in CI; its figures mean nothing."""
