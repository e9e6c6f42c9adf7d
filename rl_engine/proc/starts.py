"""A tally of expensive starts (vLLM engines, DeepSpeed inits, torchrun launches, Prefect and S3
servers), kept only when RFT_COUNT_STARTS names a file.

The test suite sets it (tests/suite_report.py) and prints the counts at the end of a run: the
suite's time is a handful of such starts each, and the count shows where sharing one would pay.
Any process of the run appends to the same file (one short line per start, a single O_APPEND
write, so lines from concurrent processes do not interleave); nothing happens when it is unset.
"""

from __future__ import annotations

import os

ENV = "RFT_COUNT_STARTS"


def count_start(kind: str) -> None:
    """Record one start of `kind` (e.g. "vllm_engine") in the tally file, if one is set."""
    path = os.environ.get(ENV)
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{kind} {os.getpid()}\n".encode())
        finally:
            os.close(fd)
    except OSError:  # a tally is never worth failing a run for
        pass


def read_counts(path: str) -> dict[str, int]:
    """{kind: starts} from a tally file (empty when there is none)."""
    counts: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                kind = line.split(" ", 1)[0].strip()
                if kind:
                    counts[kind] = counts.get(kind, 0) + 1
    except FileNotFoundError:
        pass
    return counts
