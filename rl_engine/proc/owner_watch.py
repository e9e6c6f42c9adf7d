"""Processes that must not outlive the process that started them (their owner).

vLLM's EngineCore and worker processes, and torchrun's trainer ranks, outlive an owner that is
SIGKILLed (they are re-parented and keep running). The owner passes its PID in
`RFT_ENGINE_OWNER_PID` to what it starts; `start_owner_watch()`, called in the process at the
bottom of the chain (a vLLM worker imports rl_engine.sync.worker_ext, a trainer rank runs
rl_engine.roles.trainer_rank), starts a daemon thread that does the rest.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Any

OWNER_PID_ENV = "RFT_ENGINE_OWNER_PID"
_OWNER_POLL_S = 0.5  # how often a worker checks that its owner is still there
_owner_watch: threading.Thread | None = None


def _is_gone(proc: Any) -> bool:
    """True once `proc` (a psutil.Process) has exited: gone, PID reused, or a zombie nobody reaped yet."""
    import psutil

    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _stop_engine_after_owner(owner: Any, chain: list[Any]) -> None:
    """Wait until the owner is gone, then kill the processes between it and this one, and exit."""
    import psutil

    while not _is_gone(owner):
        time.sleep(_OWNER_POLL_S)
    print(
        f"[rft] the process that owns this one (pid {owner.pid}) is gone; "
        f"stopping {[p.pid for p in chain] + [os.getpid()]}",
        file=sys.stderr,
        flush=True,
    )
    # SIGKILL, not SIGTERM: nobody is left to read a graceful shutdown, and the EngineCore's
    # SIGTERM path waits for its workers (seconds). Shared-memory segments vLLM leaves behind are
    # unlinked by the owner's multiprocessing resource tracker once the last process exits.
    for p in chain:
        with contextlib.suppress(psutil.Error):
            p.kill()
    os._exit(1)


def start_owner_watch() -> threading.Thread | None:
    """In a process started with RFT_ENGINE_OWNER_PID set: exit once that owner is gone.

    Idempotent; does nothing in the owner itself or without the variable. The processes between
    this one and the owner (vLLM's EngineCore, torchrun's agent: launchers we cannot run code in)
    are taken down too; PIDs are held as psutil handles, so a PID reused after an exit is never
    signalled.
    """
    global _owner_watch
    raw = os.environ.get(OWNER_PID_ENV, "")
    if _owner_watch is not None or not raw.isdigit() or int(raw) == os.getpid():
        return _owner_watch
    import psutil

    owner_pid = int(raw)
    chain: list[Any] = []
    try:
        owner = psutil.Process(owner_pid)
        for p in psutil.Process().parents():
            if p.pid == owner_pid:
                break
            chain.append(p)
        else:
            chain = []  # the owner is not an ancestor (it died already): stop only this process
    except psutil.Error:
        os._exit(1)  # the owner died before this worker even started
    _owner_watch = threading.Thread(
        target=_stop_engine_after_owner, args=(owner, chain), daemon=True, name="rft-owner-watch"
    )
    _owner_watch.start()
    return _owner_watch
