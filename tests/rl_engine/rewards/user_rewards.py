"""Rewards that misbehave on purpose, for test_isolation.py. A module of its own because pool
workers are spawned, not forked: they import the function by module path (this directory is on
the parent's sys.path, which spawned workers inherit)."""

from __future__ import annotations

import os
import signal
import time


def by_response(prompt: str, response: str, task: object, finish_reason: str) -> float | dict[str, float]:
    """What the response says: `pid` (the worker's pid, as a component), `sleep` (forever),
    `raise`, `segv`, `exit` (os._exit(3)), `slow:S` (sleep S seconds, reward S), else its length."""
    if response == "pid":
        return {"pid": float(os.getpid())}
    if response == "sleep":
        sleep_forever()
    if response == "raise":
        raise ValueError(f"cannot parse {response!r}")
    if response == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if response == "exit":
        os._exit(3)
    if response.startswith("slow:"):
        seconds = float(response.removeprefix("slow:"))
        time.sleep(seconds)
        return seconds
    return float(len(response))


def sleep_forever() -> None:
    while True:
        time.sleep(60)


def fail(message: str) -> None:
    raise KeyError(message)
