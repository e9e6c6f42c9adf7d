"""Prefect tasks around the explorer and the learner: start, step, sync, checkpoint.

Live objects (engines) are passed between tasks of one flow run by reference, so every task
here uses NO_CACHE. Retries only where the call is idempotent I/O (checkpoint save).
"""

from __future__ import annotations

import threading
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from rl_engine.explorer import Explorer
from rl_engine.learner import Learner
from rl_engine.run import RunContext


@task(cache_policy=NO_CACHE, task_run_name="start-explorer-{explorer_id}")
def start_explorer(run: RunContext, explorer_id: int) -> Explorer:
    """Start explorer `explorer_id`: its vLLM engine, task stream and buffer writer."""
    return Explorer(run, explorer_id)


@task(cache_policy=NO_CACHE, task_run_name="explore-{explorer.name}-step-{step}")
def explore_step(explorer: Explorer, step: int) -> dict[str, Any]:
    """One explorer step: rollout, reward, commit to the buffer."""
    return explorer.step(step)


@task(cache_policy=NO_CACHE, task_run_name="start-trainer")
def start_learner(run: RunContext, resume: bool) -> Learner:
    """Start the DeepSpeed trainer and its buffer reader (restoring state on resume)."""
    return Learner(run, resume=resume)


@task(cache_policy=NO_CACHE, task_run_name="train-step-{step}")
def train_step(learner: Learner, step: int, stop: threading.Event) -> dict[str, Any]:
    """One trainer step from `train_batch_size` committed experiences."""
    return learner.step(stop)


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1, task_run_name="save-trainer-state-v{version}")
def save_trainer_state(learner: Learner, version: int) -> str:
    """Write resumable trainer state + buffer cursor (idempotent: same version, same files)."""
    return learner.save_state()


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1, task_run_name="save-model-v{version}")
def save_model(learner: Learner, version: int) -> str:
    """Write the trained policy to `<run>/model/` (Hugging Face layout, loadable by vLLM)."""
    return learner.save_model()
