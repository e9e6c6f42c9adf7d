"""The run's log files for engine and library output (`<run>/logs/`): `rft run`'s and a mode
flow's `engines.log`, a role's own `engines-<role>.log` under placement `deployments`.
rl_engine/proc/logfile.py points a process's stdout and stderr at one (`terminal_to`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from rl_engine.storage import is_local, join, open_storage

LOG_DIR = "logs"  # under the run
LOG_FILE = f"{LOG_DIR}/engines.log"  # `rft run`'s, and a mode flow's on a worker


def role_log_name(role: str) -> str:
    """The log file of a role's own process (placement `deployments`), under `<run>/logs/`."""
    return f"engines-{role}.log"


@contextlib.contextmanager
def run_log(run_url: str, storage_options: dict[str, Any] | None, name: str = "engines.log") -> Iterator[str]:
    """A local file for the run's engine and library output; yields its path.

    Local storage: `<run>/logs/<name>` itself (appended to on resume). Object stores: a local
    temp file, copied to `<run>/logs/<name>` when the block ends (if the run was created)."""
    fs, root = open_storage(run_url, storage_options)
    local = is_local(fs)
    run_name = root.rstrip("/").rsplit("/", 1)[-1]
    path = join(root, LOG_DIR, name) if local else os.path.join(tempfile.gettempdir(), "rft-logs", run_name, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        f.write(f"==== rft: run {run_url}, started {time.strftime('%Y-%m-%d %H:%M:%S')} (pid {os.getpid()})\n")
    try:
        yield path
    finally:
        if not local and fs.exists(join(root, "config.yaml")):
            fs.put_file(path, join(root, LOG_DIR, name))
