"""Buffer upkeep at the end of an attempt: removing data files a killed writer left without a commit record."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from rl_engine.buffer.sweep import remove_uncommitted
from rl_engine.run.context import RunContext


@task(cache_policy=NO_CACHE, task_run_name="remove-uncommitted")
def remove_uncommitted_files(run: RunContext) -> list[str]:
    """Delete the run's uncommitted buffer files (the flow holds the run's lease and its roles have stopped)."""
    removed = remove_uncommitted(run.url, run.storage_options)
    if removed:
        get_run_logger().info("removed %d buffer files no commit record names (left by a killed writer): %s", len(removed), ", ".join(removed))
    return removed
