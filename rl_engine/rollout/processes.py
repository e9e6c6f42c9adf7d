"""The processes of one local vLLM engine, watched from the process that started it: which one died
and how (`EngineProcesses.first_dead`), killing what is left (`kill`), and failing the calls a
death leaves blocked inside vLLM's client (`wake_pending_calls`). `rl_engine.rollout.engine`
polls these while a call waits, so a dead worker fails the call within a bounded time.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from rl_engine.proc.exits import describe_exit


class EngineProcesses:
    """The processes of one vLLM engine, as psutil handles (safe against PID reuse): its workers,
    children of this process where the EngineCore runs here (CPU), else grandchildren under
    spawned EngineCore(s), which are then multiprocessing children of this process (`cores`)."""

    def __init__(self, llm: Any):
        import psutil

        client = llm.llm_engine.engine_core
        manager = getattr(getattr(client, "resources", None), "engine_manager", None)
        self.cores: list[Any] = list(getattr(manager, "processes", None) or [])
        self.workers: list[tuple[Any, str]] = []  # (psutil.Process, its name at start)
        self._own: dict[int, Any] = {}  # pid -> multiprocessing handle of a worker this process spawned
        # An EngineCore in this process (the CPU default here): its executor's workers are our children.
        for handle in (
            getattr(getattr(getattr(client, "engine_core", None), "model_executor", None), "workers", None) or []
        ):
            with contextlib.suppress(psutil.Error):
                child = psutil.Process(handle.proc.pid)
                self.workers.append((child, child.name()))
                self._own[child.pid] = handle.proc
        for core in self.cores:
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(core.pid).children(recursive=True):
                    # A resource tracker is bookkeeping, not part of the engine; it exits on its own.
                    with contextlib.suppress(psutil.Error):
                        if "resource_tracker" not in " ".join(child.cmdline()):
                            self.workers.append((child, child.name()))

    def first_dead(self) -> str | None:
        """'<name> pid <pid> <how>' of the first engine process that is gone, else None."""
        import psutil

        for core in self.cores:
            code = core.exitcode
            if code is not None:
                return f"{core.name} pid {core.pid} {describe_exit(code)}"
        for w, name in self.workers:
            own = self._own.get(w.pid)
            try:
                gone = not w.is_running() or w.status() == psutil.STATUS_ZOMBIE  # unreaped counts as gone
            except psutil.Error:
                gone = True
            if gone:
                if own is not None:
                    # vLLM's own monitor may be reaping it this moment (its exit code is set a
                    # moment after): the handle's sentinel is ready, so this returns at once.
                    own.join(1.0)
                return f"{name} pid {w.pid} {describe_exit(own.exitcode) if own is not None else 'exited'}"
        return None

    def kill(self, timeout: float) -> None:
        """SIGKILL every engine process still running and wait up to `timeout` s for them to exit."""
        import psutil

        for core in self.cores:
            with contextlib.suppress(Exception):
                if core.exitcode is None:
                    core.kill()
        for w, _ in self.workers:
            with contextlib.suppress(psutil.Error):
                w.kill()
        deadline = time.monotonic() + timeout
        for core in self.cores:
            with contextlib.suppress(Exception):
                core.join(max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(Exception):
            psutil.wait_procs([w for w, _ in self.workers], timeout=max(0.0, deadline - time.monotonic()))


def wake_pending_calls(client: Any) -> None:
    """Fail every call blocked inside vLLM's synchronous client (SyncMPClient, vLLM 0.32).

    vLLM's own monitor marks a dead EngineCore but leaves `generate` blocked on
    `outputs_queue.get()` and utility calls (`collective_rpc`, `reset_prefix_cache`) on futures
    nobody completes (and it does not watch the workers at all).
    Internals, hence every step guarded: the caller's bounded wait (`_call`) is the backstop.
    """
    from vllm.v1.engine.exceptions import EngineDeadError

    resources = getattr(client, "resources", None)
    if resources is not None:
        resources.engine_dead = True  # set first: a call that sends after this fails in ensure_alive()
    outputs = getattr(client, "outputs_queue", None)
    if outputs is not None:
        with contextlib.suppress(Exception):
            outputs.put_nowait(EngineDeadError(suppress_context=True))
    for fut in list((getattr(client, "utility_results", None) or {}).values()):
        with contextlib.suppress(Exception):
            if not fut.done():
                fut.set_exception(EngineDeadError(suppress_context=True))
