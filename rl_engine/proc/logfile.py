"""The run's log files for engine and library output (`<run>/logs/`), and pointing a process's
stdout and stderr at one.

vLLM's engine-core and worker processes print through tqdm, `print`, Python warnings and C++
(NUMA, Triton) on the file descriptors they inherit, and DeepSpeed's op builds print from ninja,
so logging settings alone cannot steer them. A process that starts engines points its fds 1 and
2 at a log file of the run (every child inherits them) and keeps a duplicate of the terminal for
what its user must see: `rft run` (its progress line, `logs/engines.log`), and a flow run that a
Prefect worker started (one line naming its log; `logs/engines.log` for a mode's flow, a role's
own `logs/engines-<role>.log` under placement `deployments`, since its process may be on another
host). The flow runs' own log lines are in Prefect (the UI, `prefect flow-run logs`).

    with run_log(url, opts) as log, terminal_to(log) as term:
        ...
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any, TextIO

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


@contextlib.contextmanager
def terminal_to(path: str) -> Iterator[TextIO]:
    """Point fds 1 and 2 (this process and every process it starts from now on) at `path`; yields
    a text stream on the terminal's stdout. Both fds are restored on the way out, before any error
    propagates, so the error reaches the terminal."""
    for s in (sys.stdout, sys.stderr):
        s.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    term = os.fdopen(os.dup(saved[0]), "w", buffering=1)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield term
    finally:
        for s in (sys.stdout, sys.stderr):
            s.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)
        term.close()
