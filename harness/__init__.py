"""The run harness that tests and benchmarks share: a live Prefect server and workers, an S3
outage proxy, small run configs, kill-and-resume trials and the bad-input table.

Tests import it and so do the benchmarks (bench/); it imports nothing from tests/. Like tests/
and bench/, it runs from a checkout (the repo root on sys.path) and is not installed.
"""
