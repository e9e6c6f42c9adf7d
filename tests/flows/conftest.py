"""Fixtures for flow tests: one Prefect ephemeral server per session, warm engines (small runs: harness/runs.py)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from rl_engine.proc.starts import count_start


@pytest.fixture(scope="session")
def prefect_server():
    """Prefect's test harness (a real ephemeral server on a temp database), shared by the session."""
    os.environ.pop("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", None)
    os.environ["RFT_KEEP_ENGINES"] = "1"  # engines stay warm between flow runs (reset to version 0 on reuse)
    from prefect.testing.utilities import prefect_test_harness

    count_start("prefect_server")
    with prefect_test_harness(server_startup_timeout=120):
        yield
    from rl_engine.roles.explorer import ENGINES

    ENGINES.close_all()


def flatten(d: Any, path: str = "") -> dict[str, Any]:
    """{'trainer.total_steps': 2, ...} of a nested mapping."""
    if not isinstance(d, dict) or not d:
        return {path: d}
    return {k: v for key, sub in d.items() for k, v in flatten(sub, f"{path}.{key}" if path else key).items()}


def artifacts_of(flow_run_id: Any) -> dict[str, Any]:
    """{key: artifact} of the keyed artifacts one flow run (or its task runs) created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        rows = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    return {a.key: a for a in rows if a.key}


def run_in_own_process(
    flow: Any, parameters: dict[str, Any], entrypoint: str, timeout_s: float = 240
) -> tuple[Any, Any]:
    """A flow run of `flow` as a worker runs it: created on the test server, then `python -m
    prefect.engine` with its id and `entrypoint` (`<file>:<flow function>`) in a process of its
    own; (the finished process, output captured as text; the flow run's final state)."""
    import subprocess
    import sys

    from prefect.client.orchestration import get_client
    from prefect.settings import get_current_settings

    from harness.prefect_live import REPO

    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run(flow, parameters=parameters)
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PREFECT_API_URL": get_current_settings().api.url,
        "PREFECT__FLOW_RUN_ID": str(flow_run.id),
        "PREFECT__FLOW_ENTRYPOINT": entrypoint,
    }
    res = subprocess.run(
        [sys.executable, "-m", "prefect.engine", str(flow_run.id)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    with get_client(sync_client=True) as client:
        return res, client.read_flow_run(flow_run.id).state
