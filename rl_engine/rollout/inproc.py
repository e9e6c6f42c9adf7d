"""vLLM's EngineCore in the explorer's process (the CPU path of `rl_engine.rollout.engine`).

On CPU the engine runs its EngineCore (scheduler, the loop of model steps) in the process that
builds it and spawns only the worker. Three things vLLM 0.32 does there assume a process of its
own, and this module undoes or replaces each:

- its set-up caches vLLM's environment variables, freezes the garbage collector's heap and sets
  torch to one thread (`starting`);
- its teardown destroys torch.distributed's default group, which here is the trainer's
  (`adopt` detaches it and returns a shutdown without that step);
- it busy-waits for the worker's reply to every model step (`adopt`: it sleeps instead).
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

_SPIN_S = 0.0002  # right after a message, the next is often a moment away: yield the core, do not sleep
_MAX_SLEEP_S = 0.001  # the most a reply can wait unseen once it arrives


@contextlib.contextmanager
def starting() -> Iterator[None]:
    """Around one engine start: vLLM's environment cache cleared before and after (the next engine
    would get this one's, its CPU binding included), the heap vLLM froze unfrozen (everything
    alive at the end of the start would never be collected), and torch's thread count put back.

    vLLM's executor sets torch to one thread for serving (set_torch_threads_for_runtime), right
    for a process that only schedules; here the setting is the default of every thread started
    after it, the trainer's included: bench.real's trainer step went 13.9 -> 23.4 s, and its
    plain-torch reference step, run later in the same process, 14.6 -> 27.2 s."""
    import torch
    import vllm.envs as vllm_envs

    threads = torch.get_num_threads()
    vllm_envs.disable_envs_cache()
    try:
        yield
    finally:
        vllm_envs.disable_envs_cache()
        gc.unfreeze()
        torch.set_num_threads(threads)


def adopt(client: Any) -> Callable[[], None]:
    """Make vLLM's in-process client (InprocClient) safe to live beside a trainer; returns how to
    shut its EngineCore down."""
    core = client.engine_core
    # Its own teardown (EngineCore.shutdown, also the client's finalizer when it is collected)
    # ends in cleanup_dist_env_and_memory(): torch.distributed's default process group is
    # destroyed, and in this process that group is the trainer's.
    finalizer = getattr(client, "_finalizer", None)
    if finalizer is not None:
        finalizer.detach()
    for queue in getattr(core.model_executor, "response_mqs", None) or []:
        _wait_with_backoff(queue)
    return lambda: _shutdown(core)


def _shutdown(core: Any) -> None:
    """vLLM 0.32's EngineCore.shutdown() without its last step, cleanup_dist_env_and_memory()
    (the trainer's process group; `starting` unfroze the heap already): the executor stops its
    workers, the scheduler and the structured-output backend let go of theirs."""
    core.structured_output_manager.clear_backend()
    if core.model_executor:
        core.model_executor.shutdown()
    if core.scheduler:
        core.scheduler.shutdown()


class _BackoffWait:
    """What a reader of one of vLLM's shared-memory queues does while its next message is not
    there: yield for `_SPIN_S` after the last message, then sleep, each sleep a tenth of the time
    waited so far and at most `_MAX_SLEEP_S` (a reply is seen at most ~10% or 1 ms late).

    vLLM's own wait (SpinCondition.wait) spins with sched_yield for a second after every message.
    In a process of its own, pinned to the worker's core, that cost nothing; here it holds a core
    of the trainer's through every model step of the real model (~0.1-0.3 s each): bench.real's
    overlapped trainer step got 25% slower. Its other mode, a zmq notification, is no fix: a
    notification can be dropped (its PUB socket keeps one), and the reader then sleeps out vLLM's
    5 s recheck (the demo's synchronous step median went 0.10 -> 5.1 s)."""

    def __init__(self, condition: Any):
        self._condition = condition

    def __call__(self, timeout_ms: int | None = None) -> None:
        waited = time.monotonic() - self._condition.last_read
        if waited < _SPIN_S:
            os.sched_yield()
            return
        sleep = min(_MAX_SLEEP_S, waited / 10)
        time.sleep(sleep if timeout_ms is None else min(sleep, timeout_ms / 1000))


def _wait_with_backoff(queue: Any) -> None:
    condition = getattr(queue, "_spin_condition", None)
    if condition is not None and condition.is_reader:
        condition.wait = _BackoffWait(condition)
