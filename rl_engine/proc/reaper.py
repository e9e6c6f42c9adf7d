"""Nothing a run started outlives its main process: a small watcher process for `rft run`.

A SIGKILL of the `rft run` process alone (not its process group) re-parents whatever it had
started and leaves it running: above all Prefect's ephemeral server (`uvicorn ... prefect.server`,
started by Prefect, which gives us no hook into its start). vLLM's engine processes watch their
owner themselves (rl_engine/sync/worker_ext.py); this covers everything else. `start_reaper()`
starts `python -m rl_engine.proc.reaper PID`, which notes the descendants of PID every `interval_s`
and, once PID is gone (its own parent changes: the kernel re-parents it at once), stops those it
saw that still run (SIGTERM, then SIGKILL after `grace_s`) and exits. A process group killed as a whole
takes the reaper along.

Processes started in the last `interval_s` before the death are not seen; they are children of
ones that are (or, like vLLM's, watch for themselves).

    .venv/bin/python -m pytest tests/rl_engine/proc/test_reaper.py
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable

import psutil

_reaper: subprocess.Popen | None = None


def start_reaper(interval_s: float = 0.5, grace_s: float = 5.0, ready_timeout_s: float = 30.0) -> subprocess.Popen:
    """Start this process's reaper (once per process); returns once it watches (its first look
    at our children is taken), so whatever this process starts from then on is covered."""
    global _reaper
    if _reaper is None or _reaper.poll() is not None:
        cmd = [sys.executable, "-m", "rl_engine.proc.reaper", str(os.getpid()), str(interval_s), str(grace_s)]
        _reaper = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, close_fds=True)
        ready, _, _ = select.select([_reaper.stdout], [], [], ready_timeout_s)
        line = _reaper.stdout.readline() if ready else b""
        _reaper.stdout.close()
        if line.strip() != b"watching":
            _reaper.kill()
            raise RuntimeError(
                f"rl_engine.proc.reaper did not start watching within {ready_timeout_s} s (exit code {_reaper.poll()})"
            )
    return _reaper


def watch(parent: int, interval_s: float, grace_s: float, on_watching: Callable[[], None] | None = None) -> list[int]:
    """Until `parent` is gone, note its descendants; then stop those left. Returns their pids.
    `on_watching` is called once, after the first look."""
    me, seen = os.getpid(), {}
    while os.getppid() == parent:
        # Kept across samples, not replaced: a sample taken while the parent exits finds its
        # children already re-parented (none), and must not forget them.
        with contextlib.suppress(psutil.Error):
            seen.update((p.pid, p) for p in psutil.Process(parent).children(recursive=True) if p.pid != me)
        seen = {pid: p for pid, p in seen.items() if _running(p)}
        if on_watching is not None:
            on_watching()
            on_watching = None
        time.sleep(interval_s)
    left = [p for p in seen.values() if _running(p)]
    if left:
        print(
            f"[rft] rft (pid {parent}) is gone; stopping what it started: {[p.pid for p in left]}",
            file=sys.stderr,
            flush=True,
        )
    for p in left:  # psutil refuses a pid that was reused by another process
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(left, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    return [p.pid for p in left]


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _announce() -> None:
    with contextlib.suppress(OSError):  # nobody reading is no reason to stop watching
        print("watching", flush=True)
        sys.stdout.close()


if __name__ == "__main__":
    import signal

    # A terminal's Ctrl-C reaches the whole foreground group, this watcher too: it is meant for the
    # command (which then stops what it started), not for the watcher, which would die printing a
    # KeyboardInterrupt traceback and leave the command unwatched while it stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch(int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), on_watching=_announce)
