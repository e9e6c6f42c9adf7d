"""Prefect-side reporting: per-step progress lines, a progress artifact the trainer moves every
step, and the artifacts of a finished (or cancelled) run: metrics table, reward curve and timeline
Gantt chart (markdown images), summary, and a link to the trained model.

Artifact keys are stable per deployment (`<flow>-<deployment>-<what>`, e.g.
`synchronous-synchronous-summary`) or, for a run without one (`rft run`), per mode flow
(`synchronous-summary`), so the UI's Artifacts page shows their history across runs; the run's
name is in each artifact's description.
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect import task
from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from rl_engine.run.context import RunContext
from rl_engine.run.report import build_report, rounded, summary_lines
from rl_engine.run.state import latest_state_step
from rl_engine.run.trackers import TrackerFeed, build_trackers


def log_step(role: str, m: dict[str, Any]) -> dict[str, Any]:
    """Print one progress line for a role's step (terminal and Prefect logs) and pass the metrics on."""
    if role == "trainer":
        line = (
            f"train t={m['step']:>4} reward={m['reward_mean']:.3f}±{m['reward_std']:.3f} loss={m.get('loss', float('nan')):.4f} "
            f"kl={m.get('kl', 0.0):.4f} clip={m.get('clip_frac', 0.0):.3f} staleness<={m['staleness_max']} "
            f"wait={m['wait_experience_s']:.2f}s train={m['train_s']:.2f}s"
        )
    else:
        line = (
            f"explore {m['explorer_id']}:e={m['explorer_step']:>4} v{m['version']} reward={m['reward_mean']:.3f} "
            f"len={m['response_len_mean']:.1f} tok/s={m['tokens'] / max(m['rollout_s'], 1e-9):.0f}"
        )
        if "turns_mean" in m:  # a multi-turn workflow
            line += f" turns={m['turns_mean']:.2f} env_tokens={m['env_token_frac']:.2f} workflow_errors={m['workflow_errors']}"
    get_run_logger().info(line)
    return m


def _slug(text: str) -> str:
    # Artifact keys: lowercase letters, digits and dashes only.
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")


def report_key_prefix(flow_name: str) -> str:
    """`<flow>-<deployment>` for a deployment's flow run, `<flow>` for one without (see module doc)."""
    from prefect.runtime import deployment

    return _slug(f"{flow_name}-{deployment.name}" if deployment.name else flow_name)


def start_progress(run: RunContext, keys: str) -> str:
    """The run's progress artifact (trainer steps done / trainer.total_steps, in %), at where the
    run starts (0, or the resumed trainer version); returns its id for the trainer to move."""
    total, done = run.cfg.trainer.total_steps, latest_state_step(run) or 0
    return str(
        create_progress_artifact(
            rounded(100.0 * done / total), key=f"{keys}-progress", description=_progress_text(run.cfg.name, done, total)
        )
    )


def _progress_text(name: str | None, step: int, total: int) -> str:
    return f"Run {name}: trainer step {step}/{total}"


def trainer_step_done(run: RunContext, progress_id: str | None) -> Callable[[str, dict[str, Any]], Any]:
    """The trainer's step callback in Prefect: a progress line, then the progress artifact moved to this step."""
    cfg = run.cfg
    total = cfg.trainer.total_steps

    def on_step(role: str, m: dict[str, Any]) -> dict[str, Any]:
        log_step(role, m)
        if progress_id is not None:
            try:
                update_progress_artifact(
                    UUID(progress_id),
                    rounded(min(100.0, 100.0 * m["step"] / total)),
                    description=_progress_text(cfg.name, m["step"], total),
                )
            except Exception as e:  # noqa: BLE001 - a monitoring hiccup never stops training
                logging.getLogger(__name__).warning(
                    "progress artifact not updated at trainer step %s: %s", m["step"], e
                )
        return m

    return on_step


@contextlib.contextmanager
def off_the_loop(on_step: Callable[[str, dict[str, Any]], Any]) -> Iterator[Callable[[str, dict[str, Any]], None]]:
    """`on_step` (a step callback above) run in a thread of its own, in the caller's Prefect context:
    the role's loop hands each step over and goes on, so the progress line and the API calls
    (progress artifact, continuation artifacts: ~10 ms each) are not part of the step. Steps are
    handled one at a time in their order; the block's end waits until every step handed over is
    done. A callback that fails is one warning, as a failed progress update is: monitoring never stops training."""
    import queue

    steps: queue.SimpleQueue[tuple[str, dict[str, Any]] | None] = queue.SimpleQueue()

    def drain() -> None:
        while (item := steps.get()) is not None:
            try:
                on_step(*item)
            except Exception as e:  # noqa: BLE001 - a monitoring hiccup never stops training
                logging.getLogger(__name__).warning(
                    "step report of %s step %s failed: %s: %s",
                    item[0],
                    item[1].get("step", item[1].get("explorer_step")),
                    type(e).__name__,
                    e,
                )

    # In the caller's context: Prefect's run context and logging settings are context variables, which threads do not inherit.
    worker = threading.Thread(target=contextvars.copy_context().run, args=(drain,), name="step-reports", daemon=True)
    worker.start()
    try:
        yield lambda role, m: steps.put((role, m))
    finally:
        steps.put(None)
        worker.join()


@contextlib.contextmanager
def follow_trackers(run: RunContext) -> Iterator[None]:
    """The run's experiment trackers (`monitor.trackers`) fed from this flow's process while the
    roles run: the config at the start, every recorded step as it comes; drained and closed when
    the block ends, however it ends. A tracker's failure is one warning in the flow run's log."""
    if not run.cfg.monitor.trackers:
        yield
        return
    logger = get_run_logger()
    feed = TrackerFeed(run, build_trackers(run.cfg.monitor, run, warn=logger.warning), warn=logger.warning)
    # In the flow's context: Prefect's logging settings are context variables, which threads do not inherit.
    feed.start(run_in=contextvars.copy_context().run)
    try:
        yield
    finally:
        feed.stop()


def _link(url: str) -> str:
    """A URL the UI can link to: local paths become file:// URIs, fsspec URLs (s3://...) stay."""
    return url if "://" in url else Path(url).resolve().as_uri()


@task(cache_policy=NO_CACHE, task_run_name="publish-report")
def publish_report(run: RunContext, keys: str) -> dict[str, Any]:
    """Write report files to the run and mirror them as Prefect artifacts under `keys`; returns the summary."""
    rep = build_report(run)
    name = run.cfg.name
    if run.cfg.monitor.artifacts:
        if rep.table:
            create_table_artifact(
                rep.table, key=f"{keys}-metrics", description=f"Per trainer step metrics of run {name} ({run.url})"
            )
        for what, png in rep.images.items():
            # Markdown, not an image artifact: the UI would print the whole data: URL under the picture.
            image = f"![{what} of run {name}](data:image/png;base64,{base64.b64encode(png).decode()})"
            create_markdown_artifact(image, key=f"{keys}-{what}", description=f"{what} of run {name} ({run.url})")
        create_markdown_artifact(rep.markdown, key=f"{keys}-summary", description=f"Summary of run {name} ({run.url})")
        if model := rep.summary.get("model"):
            create_link_artifact(
                _link(model), link_text=model, key=f"{keys}-model", description=f"Trained model of run {name}"
            )
    get_run_logger().info("run summary:\n%s", "\n".join(summary_lines(rep.summary)))
    return rep.summary


def resume_commands(run: RunContext) -> list[str]:
    """How to continue a run that stopped short: a new flow run of this flow run's deployment with
    `resume` (when it has one), and `rft run` with the run's own config (which a resume must be)."""
    from prefect.runtime import deployment, flow_run

    from rl_engine.storage import is_local

    config = f"{run.url}/config.yaml" if is_local(run.fs()[0]) else "CONFIG"  # on object storage: a local copy of it
    cmds = [f"rft run {config} --resume {run.url}"]
    if deployment.name:
        cmds.insert(0, f"prefect deployment run '{flow_run.flow_name}/{deployment.name}' --param resume={run.url}")
    return cmds


@task(cache_policy=NO_CACHE, task_run_name="publish-resume")
def publish_resume(run: RunContext, keys: str, status: str) -> list[str]:
    """A run that stopped short (`status`: cancelled or failed) can be resumed: the commands, as a
    markdown artifact under `<keys>-resume` and in the flow run's log; returns them."""
    saved = latest_state_step(run) or 0
    cmds = resume_commands(run)
    text = (
        f"# Resume run `{run.cfg.name}`\n\nThe run was {status}. Resuming continues from its last trainer state (version {saved} "
        f"of {run.cfg.trainer.total_steps}); nothing trained is trained twice.\n\n```bash\n"
        + "\n".join(cmds)
        + "\n```\n"
    )
    if "CONFIG" in cmds[-1]:
        text += f"\n`CONFIG` is a local copy of the run's own config, `{run.url}/config.yaml`: a resumed run keeps its config.\n"
    if run.cfg.monitor.artifacts:
        create_markdown_artifact(text, key=f"{keys}-resume", description=f"How to resume run {run.cfg.name} ({status})")
    get_run_logger().info(
        "run %s %s at trainer state %d; resume it with: %s",
        run.cfg.name,
        status,
        saved,
        " or ".join(f"`{c}`" for c in cmds),
    )
    return cmds
