"""Modes (a) synchronous and (b) one-step off-policy: the rendezvous schedule for any k, m.

The explorer syncs after explorer step e iff e > m and (e - m) % k == 0, receiving version
e - m; the trainer, after a step t that sync delivers, sends it and waits for the load. Between
sync points both loops run concurrently as two long-lived tasks of one flow run.

    rft run configs/synchronous.yaml          # k=1, m=0
    rft run configs/one_step_off_policy.yaml  # k=1, m=1
"""

from __future__ import annotations

import threading

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.common import finish_run, open_or_start, save_due, stop_on_error, wait_all, watch_cancellation
from rl_engine.config import RFTConfig
from rl_engine.run import ResumePoint, RunContext
from rl_engine.schedule import resumed_rendezvous_syncs
from tasks.report import log_step
from tasks.sync import receive_weights, send_weights
from tasks.workers import explore_step, start_explorer, start_learner, train_step


def _plan(run: RunContext, at: ResumePoint) -> dict[int, int]:
    s = run.cfg.synchronizer
    return resumed_rendezvous_syncs(run.cfg.trainer.total_steps, s.sync_interval, s.sync_offset, at.trainer_version, at.first_steps[0])


@task(cache_policy=NO_CACHE, task_run_name="explorer-loop")
def explorer_loop(run: RunContext, at: ResumePoint, stop: threading.Event) -> list[dict]:
    syncs, first, metrics = _plan(run, at), at.first_steps[0], []
    with stop_on_error(stop):
        explorer = start_explorer(run, 0)
        try:
            if at.resumed and first <= run.cfg.trainer.total_steps:
                receive_weights(explorer, at.trainer_version, stop)  # catch up to the restored trainer
            for e in range(first, run.cfg.trainer.total_steps + 1):
                if stop.is_set():
                    break
                metrics.append(log_step("explorer", explore_step(explorer, e)))
                if e in syncs:
                    receive_weights(explorer, syncs[e], stop)
        finally:
            explorer.close()
    return metrics


@task(cache_policy=NO_CACHE, task_run_name="trainer-loop")
def trainer_loop(run: RunContext, at: ResumePoint, stop: threading.Event) -> list[dict]:
    cfg, sends, metrics = run.cfg, set(_plan(run, at).values()), []
    with stop_on_error(stop):
        learner = start_learner(run, at.resumed)
        try:
            if at.resumed and at.first_steps[0] <= cfg.trainer.total_steps:
                send_weights(learner, learner.version, stop)
            while learner.version < cfg.trainer.total_steps and not stop.is_set():
                metrics.append(log_step("trainer", train_step(learner, learner.version + 1, stop)))
                t = learner.version
                if t in sends:
                    send_weights(learner, t, stop)
                save_due(learner, cfg)
        finally:
            learner.close()
    return metrics


def _rendezvous(cfg: RFTConfig, resume: str | None = None):
    run, at = open_or_start(cfg, resume)
    stop = threading.Event()
    with watch_cancellation(stop) as cancel:
        explorer = explorer_loop.submit(run, at, stop)
        trainer = trainer_loop.submit(run, at, stop)
        trainer_metrics, explorer_metrics = wait_all([trainer, explorer], stop)
    return finish_run(run, trainer_metrics, explorer_metrics, cancelled=cancel.cancelled)


@flow(name="synchronous", log_prints=True)
def synchronous(cfg: RFTConfig, resume: str | None = None):
    """Mode (a): rollout with v(t-1), train t, sync vt; generalised to any sync_interval."""
    return _rendezvous(cfg, resume)


@flow(name="one-step-off-policy", log_prints=True)
def one_step_off_policy(cfg: RFTConfig, resume: str | None = None):
    """Mode (b): the explorer runs sync_offset steps ahead, rollout e+1 overlaps train e."""
    return _rendezvous(cfg, resume)
