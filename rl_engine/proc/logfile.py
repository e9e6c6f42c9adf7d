"""Pointing a process's stdout and stderr at a log file, keeping the terminal for its user.

vLLM's engine-core and worker processes print through tqdm, `print`, Python warnings and C++
(NUMA, Triton) on the file descriptors they inherit, and DeepSpeed's op builds print from ninja,
so logging settings alone cannot steer them. A process that starts engines points its fds 1 and
2 at a log file of the run (every child inherits them) and keeps a duplicate of the terminal for
what its user must see: `rft run` and `rft demo` (a progress line, `logs/engines.log`; `--model
smollm2`'s held-out scorings too), `rft eval` (a line per version), and a flow run that a
Prefect worker started (one line naming its log; `logs/engines.log` for a mode's flow, a role's
own `logs/engines-<role>.log` under placement `deployments`, since its process may be on another
host). The run's log files themselves are rl_engine/run/logs.py's. The flow runs' own log lines
are in Prefect (the UI, `prefect flow-run logs`).

    with run_log(url, opts) as log, terminal_to(log) as term:
        ...
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import TextIO


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


@contextlib.contextmanager
def output_logged(path: str, said: str, on_error: str) -> Iterator[TextIO]:
    """`terminal_to(path)` for a command: first `said` on the terminal (where the log is), then
    the block with its output in the log; an error leaving the block prints `on_error` on the
    terminal's stderr (where to look) before it propagates."""
    print(said, flush=True)
    try:
        with terminal_to(path) as term:
            yield term
    except BaseException:
        print(on_error, file=sys.stderr, flush=True)
        raise
