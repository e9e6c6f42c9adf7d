"""The run's lifecycle as tasks of the mode's flow run, so the UI shows each step in the run's graph:
preflight, start-run, (the roles), sweep-buffer, publish-report, record-lineage.

They run the steps of the run's driver (rl_engine/run/driver.py), which holds the run's lease for
the whole attempt in the flow's process: unlike the roles, these steps never move to another
process, so they take the driver itself rather than handles. Nothing they return is persisted
(`persist_result=False`): the flow's own result, the run's summary, is.
"""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from rl_engine.run.context import RunContext
from rl_engine.run.driver import RunDriver


@task(cache_policy=NO_CACHE, persist_result=False, task_run_name="preflight")
def check_run(driver: RunDriver) -> None:
    """Preflight: a new run's inputs, or a resumed run's storage, completeness and lease."""
    driver.check()


@task(cache_policy=NO_CACHE, persist_result=False, task_run_name="start-run")
def start_attempt(driver: RunDriver) -> tuple[RunContext, str]:
    """Lineage, run directory, lease and the attempt's start marker; returns (run, attempt id)."""
    return driver.start()


@task(cache_policy=NO_CACHE, persist_result=False, task_run_name="sweep-buffer")
def sweep_buffer(driver: RunDriver) -> list[str]:
    """Delete the run's uncommitted buffer files (every role has stopped)."""
    removed = driver.sweep()
    if removed:
        get_run_logger().info(
            "removed %d buffer files no commit record names (left by a killed writer): %s",
            len(removed),
            ", ".join(removed),
        )
    return removed


@task(cache_policy=NO_CACHE, persist_result=False, task_run_name="record-lineage")
def record_run(driver: RunDriver, status: str) -> dict[str, Any] | None:
    """The run's entry in its lineage (completed, cancelled or failed); nothing without a lineage."""
    return driver.record(status)
