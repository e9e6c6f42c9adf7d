"""`rft-eval`: the held-out evaluation of every saved version of a run, as a flow of its own.

Deployed as `rft-eval/default` (prefect.yaml); a completed run whose config names it in
`eval.after_run` starts it with the run's URL (`flows.common.finish_run`), and so does a lineage's
every run. By hand: `prefect deployment run 'rft-eval/default' --param run_url=runs/my-run`.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from flows.common import output_to_run_log
from rl_engine.config import EvalTasksetConfig
from rl_engine.errors import UserError
from rl_engine.roles.evaluate_run import evaluate_versions
from rl_engine.run.context import open_run
from rl_engine.run.logs import role_log_name
from rl_engine.run.versions import saved_versions
from tasks.evaluation import artifact_prefix, evaluations_card


@task(cache_policy=NO_CACHE, task_run_name="score-saved-versions")
def score_saved_versions(
    run_url: str, tasksets: list[str] | None, n: int, storage_options: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """Every saved version of the run, scored on `tasksets` (default: the run's eval.tasksets)."""
    run = open_run(run_url, storage_options)
    sets = [
        EvalTasksetConfig(name=f"set{i}" if len(tasksets) > 1 else "heldout", path=p, n=n)
        for i, p in enumerate(tasksets or [])
    ] or run.cfg.eval.tasksets
    if not sets:
        raise UserError(f"rft-eval {run_url}: no task set to score: pass tasksets, or give the run eval.tasksets")
    return evaluate_versions(run.cfg, saved_versions(run), sets, run.storage_options, log=get_run_logger().info)


@flow(name="rft-eval", log_prints=True)
def evaluate_run(
    run_url: str, tasksets: list[str] | None = None, n: int = 4, storage_options: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Score every saved version of the run at `run_url` (its start model, the kept best, retained
    sync checkpoints, the final model) on held-out task files; the curve and table as one artifact.
    On a worker, the engine's output goes to `<run>/logs/engines-eval.log`."""
    with output_to_run_log(run_url, storage_options, role_log_name("eval")):
        records = score_saved_versions(run_url, tasksets, n, storage_options)
    name = open_run(run_url, storage_options).cfg.name
    create_markdown_artifact(
        evaluations_card(records, None, f"run {name}'s saved versions"),
        key=f"{artifact_prefix(name)}-saved-versions",
        description=f"Held-out scores of every saved version of run {name} (curve and table)",
    )
    return records
