"""vLLM's EngineCore in the explorer's process (the CPU path of `rl_engine.rollout.engine`).

On CPU the engine runs its EngineCore (scheduler, the loop of model steps) in the process that
builds it and spawns only the worker. Three things vLLM 0.32 does there assume a process of its
own, and this module undoes or replaces each:

- its set-up caches vLLM's environment variables, freezes the garbage collector's heap and sets
  torch to one thread (`starting`);
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
