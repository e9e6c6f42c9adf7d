"""Prefect tasks that run a role inside the mode's flow run (placement `local`): same entry points,
same handles, as the role flows of placement `deployments` (flows/roles.py). Each opens the run
once (its RunContext: config, filesystem, board) and hands it to the role and its callbacks."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from rl_engine.roles import entry as roles
from rl_engine.run.context import open_run
from tasks.continuations import explorer_step_done
from tasks.evaluation import evaluation_done
from tasks.report import off_the_loop, trainer_step_done


@task(cache_policy=NO_CACHE, task_run_name="explorer-{explorer_id}")
def explorer_task(run_url: str, explorer_id: int, storage_options: dict[str, Any] | None = None) -> int:
    """Explorer `explorer_id` of the run, in a thread of this flow run (its step reports in another,
    `off_the_loop`); returns its step count."""
    run = open_run(run_url, storage_options)
    on_eval = evaluation_done(run) if explorer_id == 0 else None
    with off_the_loop(explorer_step_done) as on_step:
        return len(roles.explorer_role(run, explorer_id, on_step=on_step, on_eval=on_eval).metrics)


@task(cache_policy=NO_CACHE, task_run_name="trainer")
def trainer_task(run_url: str, storage_options: dict[str, Any] | None = None, progress_id: str | None = None) -> int:
    """The trainer of the run, in a thread of this flow run, moving the run's progress artifact
    (`progress_id`) every step from another (`off_the_loop`); returns its step count."""
    run = open_run(run_url, storage_options)
    with off_the_loop(trainer_step_done(run, progress_id)) as on_step:
        return len(roles.trainer_role(run, on_step=on_step).metrics)
