"""Held-out evaluations in Prefect: a task run per evaluation (explorer 0 ran it, rl_engine.roles.evaluation),
publishing the run's evaluations (held-out curve and table, one artifact) beside the timeline."""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from rl_engine.run.context import RunContext, open_run
from rl_engine.run.report import eval_markdown, eval_table, heldout_curve_png, load_evaluations, read_best
from tasks.report import _slug


def eval_line(record: dict[str, Any]) -> str:
    """`eval v4: heldout pass@1=0.531 avg@4=0.531 len=3.1 (2.1 s)`: each set's headline numbers."""
    sets = sorted({k.split("/", 1)[0] for k in record if k.endswith("/tasks")})
    parts = []
    for name in sets:
        avg = next((k for k in record if k.startswith(f"{name}/avg@")), None)
        parts.append(
            f"{name} pass@1={record[f'{name}/pass@1']:.3f} {avg.split('/', 1)[1]}={record[avg]:.3f} len={record[f'{name}/response_len_mean']:.1f}"
        )
    best = record.get("best")
    tail = f"; best v{best['version']}" if best else ""
    return f"eval v{record['version']}: {'  '.join(parts)} ({record['seconds']:.1f} s){tail}"


@task(cache_policy=NO_CACHE, task_run_name="eval-v{version}")
def publish_evaluation(run_url: str, storage_options: dict[str, Any] | None, version: int, keys: str) -> int:
    """Version `version` was evaluated: the run's evaluations so far as one artifact (`evaluations_card`)."""
    run = open_run(run_url, storage_options)
    records = load_evaluations(run)
    if run.cfg.monitor.artifacts and records:
        create_markdown_artifact(
            evaluations_card(records, read_best(run), f"run {run.cfg.name}"),
            key=f"{keys}-evaluations",
            description=f"Held-out evaluations of run {run.cfg.name} by trainer version (curve and table)",
        )
    return len(records)


def evaluations_card(records: list[dict[str, Any]], best: dict[str, Any] | None, of: str) -> str:
    """One artifact for evaluated versions (an evaluation during training: one card per evaluated
    version, not a table and a curve card that repeat each other): the held-out curve, then the
    table of every version and set, and the best version."""
    return (
        png_markdown(heldout_curve_png(records), f"held-out curve of {of}")
        + "\n\n"
        + eval_markdown(eval_table(records), best)
    )


@task(cache_policy=NO_CACHE, task_run_name="start-evaluation")
def start_evaluation(deployment: str, run_url: str, storage_options: dict[str, Any] | None) -> str | None:
    """The run completed: start a flow run of `deployment` (eval.after_run, e.g. `rft-eval/default`)
    on it, without waiting, named after the run from its creation (`eval_run_name`); its id, or
    None when it could not start (a warning: the run stays completed)."""
    from prefect.deployments import run_deployment

    log = get_run_logger()
    try:
        flow_run = run_deployment(
            deployment,
            parameters={"run_url": run_url, "storage_options": storage_options},
            timeout=0,
            as_subflow=False,
            flow_run_name=eval_run_name(run_url),
        )
    except Exception as e:  # noqa: BLE001 - the run is done; a missing deployment must not fail it
        log.warning(
            "eval.after_run: could not start deployment %r for %s: %s: %s (deploy it: `prefect deploy --all`)",
            deployment,
            run_url,
            type(e).__name__,
            e,
        )
        return None
    log.info("eval.after_run: started flow run %s of %s on %s", flow_run.name, deployment, run_url)
    return str(flow_run.id)


def eval_run_name(run_url: str) -> str:
    """The name of the rft-eval flow run that scores the run at `run_url`, from its creation: `<run name>-eval`."""
    return f"{run_url.rstrip('/').rsplit('/', 1)[-1]}-eval"


def png_markdown(png: bytes, what: str) -> str:
    """A PNG as a Markdown artifact's body (an image artifact would print the whole data: URL under it)."""
    return f"![{what}](data:image/png;base64,{base64.b64encode(png).decode()})"


def evaluation_done(run: RunContext) -> Callable[[dict[str, Any]], Any]:
    """Explorer 0's evaluation callback in Prefect: a log line, then the evaluation's task run
    (which takes the run's handles, as a task does)."""
    keys = artifact_prefix(run.cfg.name)

    def on_eval(record: dict[str, Any]) -> None:
        get_run_logger().info(eval_line(record))
        publish_evaluation(run.url, run.storage_options, record["version"], keys)

    return on_eval


def artifact_prefix(name: str | None) -> str:
    """`rft-<run name>` as an artifact key (lowercase letters, digits and dashes): stable for a run and its resumes."""
    return _slug(f"rft-{name}")
