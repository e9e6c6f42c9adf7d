"""The control board: tiny JSON markers under `<run>/control/` through which workers see each other.

Explorers and the trainer may be threads of one flow run, processes, or deployments on other
machines; they coordinate only through the run's storage (local disk or S3), never through
shared memory. The trainer posts its version, explorers post their step/version and their
acknowledgements of loaded weights; a waiter polls with a timeout and a stop event, and its
timeout message says what it was waiting for.

    board = Board(run.url, run.storage_options)
    board.post("trainer", {"version": 3})
    board.wait("trainer", lambda v: v["version"] >= 3, what="trainer version 3", timeout_s=60)
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from rl_engine.storage import join, open_storage, poll_interval, read_json, write_json


class Stopped(Exception):
    """The run was asked to stop (cancelled) while a worker was waiting."""


class WaitTimeout(TimeoutError):
    """A rendezvous did not happen in time; the message names what was awaited."""


class Board:
    """JSON markers of a run, one file per key, each written atomically."""

    def __init__(self, run_url: str, storage_options: dict[str, Any] | None = None, poll_s: float | None = None):
        self.fs, root = open_storage(run_url, storage_options)
        self.root = join(root, "control")
        self.poll_s = poll_interval(self.fs, poll_s)

    def post(self, key: str, value: dict[str, Any]) -> None:
        write_json(self.fs, join(self.root, f"{key}.json"), {**value, "time": time.time()})

    def get(self, key: str) -> dict[str, Any] | None:
        try:
            return read_json(self.fs, join(self.root, f"{key}.json"))
        except FileNotFoundError:
            return None

    def clear(self) -> None:
        """Remove every marker (a resumed run must not see the crashed run's progress)."""
        if self.fs.exists(self.root):
            self.fs.rm(self.root, recursive=True)
        self.fs.invalidate_cache()

    def wait(
        self,
        key: str,
        ready: Callable[[dict[str, Any]], bool],
        *,
        what: str,
        timeout_s: float,
        stop: threading.Event | None = None,
    ) -> dict[str, Any]:
        """Poll `key` until `ready(value)`; raise Stopped on `stop`, WaitTimeout after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.get(key)
            if value is not None and ready(value):
                return value
            if stop is not None and stop.is_set():
                raise Stopped(f"stopped while waiting for {what}")
            if time.monotonic() > deadline:
                raise WaitTimeout(f"waited {timeout_s:.0f} s for {what}; last {key!r} marker: {value} (synchronizer.wait_timeout_s)")
            self.fs.invalidate_cache()
            time.sleep(self.poll_s)
