"""The roles as flows of their own: with `placement: {type: deployments}` the mode's flow starts
each role as a flow run of these flows' deployments (`rft-explorer/default`, `rft-trainer/default`
in prefect.yaml; `rft-reward/default` too when the run's reward is a model), so each runs in its
own process on whatever work pool serves it.

They take handles only (the run's URL, the explorer id, non-secret storage options); everything
else comes from the run's storage, which each opens once (its RunContext) for the role and its callbacks. A role ends its own child processes (vLLM engine cores) on
the way out, also when its process is cancelled (SIGTERM from the worker). Its process's output
(vLLM, DeepSpeed, libraries) goes to `<run>/logs/engines-<role>.log`, not the worker's terminal.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.common import end_cancelled, output_to_run_log
from rl_engine.board import role_name
from rl_engine.rewards.run_service import REWARD_ROLE
from rl_engine.roles import entry as roles
from rl_engine.run.context import open_run
from rl_engine.run.logs import role_log_name
from tasks.continuations import explorer_step_done
from tasks.evaluation import evaluation_done
from tasks.report import off_the_loop, trainer_step_done


def _outcome(role: str, run_url: str, result: roles.RoleResult) -> Any:
    """Completed with a summary, or Cancelled when the run stopped the role before its schedule ended
    (cleanly, exit status 0, in the role's own process: `end_cancelled`)."""
    if result.stopped_by is not None:
        return end_cancelled(f"{role} stopped after {len(result.metrics)} steps: {result.stopped_by['reason']}")
    return {"role": role, "run": run_url, "steps": len(result.metrics)}


@flow(name="rft-explorer", log_prints=True)
def explorer_role(run_url: str, explorer_id: int = 0, storage_options: dict[str, Any] | None = None) -> Any:
    """Explorer `explorer_id` of the run at `run_url` (started by the run's mode flow)."""
    role = role_name(explorer_id)
    with output_to_run_log(run_url, storage_options, role_log_name(role)):
        run = open_run(run_url, storage_options)
        on_eval = evaluation_done(run) if explorer_id == 0 else None
        with off_the_loop(explorer_step_done) as on_step:
            result = roles.explorer_role(run, explorer_id, on_step=on_step, on_eval=on_eval)
        return _outcome(role, run_url, result)


@flow(name="rft-trainer", log_prints=True)
def trainer_role(run_url: str, storage_options: dict[str, Any] | None = None, progress_id: str | None = None) -> Any:
    """The trainer of the run at `run_url` (started by the run's mode flow, which passes the id of
    the run's progress artifact, moved every trainer step)."""
    with output_to_run_log(run_url, storage_options, role_log_name("trainer")):
        run = open_run(run_url, storage_options)
        with off_the_loop(trainer_step_done(run, progress_id)) as on_step:
            result = roles.trainer_role(run, on_step=on_step)
        return _outcome("trainer", run_url, result)


@flow(name="rft-reward", log_prints=True)
def reward_role(run_url: str, storage_options: dict[str, Any] | None = None) -> Any:
    """The reward service of the run at `run_url`, which its explorers score with (started by the
    run's mode flow when its reward is `{type: model}`); it ends after the run's explorers."""
    with output_to_run_log(run_url, storage_options, role_log_name(REWARD_ROLE)):
        run = open_run(run_url, storage_options)
        return _outcome(REWARD_ROLE, run_url, roles.reward_role(run))
