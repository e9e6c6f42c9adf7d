"""vLLM's EngineCore in the explorer's process (the CPU path of `rl_engine.rollout.engine`).

On CPU the engine runs its EngineCore (scheduler, the loop of model steps) in the process that
builds it and spawns only the worker. Three things vLLM 0.32 does there assume a process of its
own, and this module undoes or replaces each:

- its set-up caches vLLM's environment variables, freezes the garbage collector's heap and sets
  torch to one thread (`starting` undoes the first two and skips the third);
- its teardown destroys torch.distributed's default group, which here is the trainer's
  (`adopt` detaches it and returns a shutdown without that step);
- it busy-waits for the worker's reply to every model step (`adopt`: it sleeps instead, `shm_wait`).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Any

from rl_engine.rollout.shm_wait import wait_with_backoff


@contextlib.contextmanager
def starting() -> Iterator[None]:
    """Around one engine start: vLLM's environment cache cleared before and after (the next engine
    would get this one's, its CPU binding included), the heap vLLM froze unfrozen (everything
    alive at the end of the start would never be collected), and torch's thread count untouched.

    vLLM sets torch to one thread for serving (its executor: set_torch_threads_for_runtime; its
    chat-template warm-up: set_default_torch_num_threads(1)), right for a process that only
    schedules. Here that count is the process's: a thread takes it at its first torch op, and
    keeps it. A trainer that loaded its model during the engine's start trained its first 9 steps
    of bench.real at ~40 s each, then ~19 s; the bench's plain-torch reference step, run after,
    took 27.2 s instead of 14.6 s. Both calls are skipped while this engine starts (the starts are
    serialised), and the count is put back at the end in case another path set it."""
    import torch
    import vllm.envs as vllm_envs
    import vllm.renderers.base as renderers
    import vllm.v1.executor.multiproc_executor as executor

    threads = torch.get_num_threads()
    kept = executor.set_torch_threads_for_runtime, renderers.set_default_torch_num_threads
    executor.set_torch_threads_for_runtime = lambda: None
    renderers.set_default_torch_num_threads = lambda num_threads=None: contextlib.nullcontext()
    vllm_envs.disable_envs_cache()
    try:
        yield
    finally:
        executor.set_torch_threads_for_runtime, renderers.set_default_torch_num_threads = kept
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
        wait_with_backoff(queue)  # its reply to each model step: sleep, not spin (shm_wait)
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
