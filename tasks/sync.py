"""Prefect tasks around weight sync: the trainer sends a version, explorers receive it."""

from __future__ import annotations

import threading

from prefect import task
from prefect.cache_policies import NO_CACHE

from rl_engine.explorer import Explorer
from rl_engine.learner import Learner


@task(cache_policy=NO_CACHE, task_run_name="send-weights-v{version}")
def send_weights(learner: Learner, version: int, stop: threading.Event, wait_for_explorers: bool = True) -> float:
    """Send version `version` to every explorer (collective broadcast or committed checkpoint)."""
    return learner.publish(version, stop, wait_for_explorers=wait_for_explorers)


@task(cache_policy=NO_CACHE, task_run_name="receive-weights-{explorer.name}-v{version}")
def receive_weights(explorer: Explorer, version: int, stop: threading.Event) -> int:
    """Wait for the trainer to reach `version`, then load it into the explorer's live engine."""
    return explorer.receive(version, stop)


@task(cache_policy=NO_CACHE, task_run_name="pick-up-weights-{explorer.name}")
def pick_up_newest(explorer: Explorer, stop: threading.Event) -> int:
    """Load the newest published version if there is one; wait only if max_staleness requires it."""
    return explorer.pick_up_newest(stop)
