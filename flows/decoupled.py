"""Modes (c) fully asynchronous and (d) multi-explorer asynchronous: the decoupled schedule.

Explorers and the trainer never rendezvous. The trainer publishes its weights every
`sync_interval` trainer steps; each explorer, between its steps, picks up the newest published
version and waits only when `max_staleness` requires it. (c) is one explorer, (d) is
`explorer.count` explorers writing to one buffer, each with its own id and step counter.

    rft run configs/fully_async.yaml
    rft run configs/multi_explorer.yaml
"""

from __future__ import annotations

import threading

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.common import finish_run, open_or_start, save_due, stop_on_error, wait_all, watch_cancellation
from rl_engine.config import RFTConfig
from rl_engine.run import ResumePoint, RunContext
from rl_engine.schedule import decoupled_publish
from tasks.report import log_step
from tasks.sync import pick_up_newest, send_weights
from tasks.workers import explore_step, start_explorer, start_learner, train_step


@task(cache_policy=NO_CACHE, task_run_name="explorer-{explorer_id}-loop")
def explorer_loop(run: RunContext, explorer_id: int, at: ResumePoint, stop: threading.Event) -> list[dict]:
    metrics, e = [], at.first_steps[explorer_id]
    with stop_on_error(stop):
        explorer = start_explorer(run, explorer_id)
        try:
            while True:
                pick_up_newest(explorer, stop)  # also after stop: a broadcast in flight needs every explorer
                if stop.is_set():
                    break
                metrics.append(log_step("explorer", explore_step(explorer, e)))
                e += 1
        finally:
            explorer.close()
    return metrics


@task(cache_policy=NO_CACHE, task_run_name="trainer-loop")
def trainer_loop(run: RunContext, at: ResumePoint, stop: threading.Event) -> list[dict]:
    cfg, metrics = run.cfg, []
    with stop_on_error(stop):
        learner = start_learner(run, at.resumed)
        try:
            if at.resumed:  # explorers restart from the base model: offer them the restored weights
                send_weights(learner, learner.version, stop, wait_for_explorers=False)
            while learner.version < cfg.trainer.total_steps and not stop.is_set():
                metrics.append(log_step("trainer", train_step(learner, learner.version + 1, stop)))
                t = learner.version
                if decoupled_publish(t, cfg.synchronizer.sync_interval):
                    send_weights(learner, t, stop, wait_for_explorers=False)
                save_due(learner, cfg)
        finally:
            learner.close()
    return metrics


def _decoupled(cfg: RFTConfig, resume: str | None = None):
    run, at = open_or_start(cfg, resume)
    stop = threading.Event()
    with watch_cancellation(stop) as cancel:
        explorers = [explorer_loop.submit(run, i, at, stop) for i in range(run.cfg.explorer.count)]
        trainer = trainer_loop.submit(run, at, stop)
        [trainer_metrics] = wait_all([trainer], stop)
        stop.set()  # training is done: explorers finish their current step and exit
        explorer_metrics = [m for ms in wait_all(explorers, stop) for m in ms]
    return finish_run(run, trainer_metrics, explorer_metrics, cancelled=cancel.cancelled)


@flow(name="fully-async", log_prints=True)
def fully_async(cfg: RFTConfig, resume: str | None = None):
    """Mode (c): one explorer and the trainer as independent loops."""
    return _decoupled(cfg, resume)


@flow(name="multi-explorer", log_prints=True)
def multi_explorer(cfg: RFTConfig, resume: str | None = None):
    """Mode (d): explorer.count explorers and one trainer, one buffer."""
    return _decoupled(cfg, resume)
