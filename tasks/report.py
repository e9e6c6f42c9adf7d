"""Prefect-side reporting: per-step progress lines, and the artifacts of a finished run
(metrics table, reward curve, timeline Gantt chart, utilization summary).
"""

from __future__ import annotations

import base64
import json
from typing import Any

from prefect import task
from prefect.artifacts import create_image_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from rl_engine.report import build_report
from rl_engine.run import RunContext


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
    get_run_logger().info(line)
    return m


def _key(run: RunContext, what: str) -> str:
    # Artifact keys: lowercase letters, digits and dashes only.
    slug = "".join(c if c.isalnum() else "-" for c in run.cfg.name.lower()).strip("-")
    return f"{slug}-{what}"


@task(cache_policy=NO_CACHE, task_run_name="publish-report")
def publish_report(run: RunContext) -> dict[str, Any]:
    """Write report files to the run and mirror them as Prefect artifacts; returns the summary."""
    rep = build_report(run)
    if run.cfg.monitor.artifacts:
        if rep.table:
            create_table_artifact(rep.table, key=_key(run, "metrics"), description=f"Per trainer step metrics of {run.url}")
        for name, png in rep.images.items():
            url = "data:image/png;base64," + base64.b64encode(png).decode()
            create_image_artifact(url, key=_key(run, name), description=f"{name} of {run.url}")
        create_markdown_artifact(rep.markdown, key=_key(run, "summary"), description=f"Summary of {run.url}")
    get_run_logger().info("run summary: %s", json.dumps(rep.summary))
    return rep.summary
