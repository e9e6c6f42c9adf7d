"""A credential given to a mode's flow run, through its `set` parameter or its `cfg`, is in none of
what the run shows (issue 44, item 3): its state message, its flow run's name, its logs on the
server, and the process's own output (what a worker's terminal shows of a run it started:
stdout, stderr and every log record). In-process flow runs on the session's Prefect server; each
fails before any engine starts. The secret is searched for as a string, as
tests/flows/test_placement_deployments.py does for a run on S3. Not searched: the flow run's
parameters, which hold what the caller gave (a `set` list is the user's own input, shown as such
in the UI). The paths without a flow run: tests/rl_engine/config/test_secrets.py.

    .venv/bin/python -m pytest tests/flows/test_secrets_flow.py -q
"""

from __future__ import annotations

import logging
import os
import time

import pytest

from flows.rendezvous import synchronous
from harness.runs import small_config
from rl_engine.config import validate_config

pytestmark = pytest.mark.slow

SECRET = f"rft-secret-{os.urandom(6).hex()}"


def test_a_credential_through_set_or_cfg_shows_nowhere(
    prefect_server, tiny_model_dir, task_file, tmp_path, capfd, caplog
):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    caplog.set_level(logging.DEBUG)
    data = small_config(tiny_model_dir, task_file, str(tmp_path / "runs"), mode="synchronous", total_steps=2)
    cfg = validate_config(data)
    with_secret = {
        **data,
        "buffer": {**data["buffer"], "storage": {"url": str(tmp_path), "options": {"secret": SECRET}}},
    }
    states = {
        "set: storage option": synchronous(cfg=cfg, set=[f"buffer.storage.options.secret={SECRET}"], return_state=True),
        "set: job variables": synchronous(
            cfg=cfg,
            set=["placement.type=deployments", f"placement.job_variables={{trainer: {{env: {{HF_TOKEN: {SECRET}}}}}}}"],
            return_state=True,
        ),
        "set: with resume": synchronous(
            cfg=cfg,
            resume=str(tmp_path / "runs" / "r"),
            set=[f"buffer.storage.options.token={SECRET}"],
            return_state=True,
        ),
        "cfg": synchronous(cfg=with_secret, return_state=True),
    }
    assert all(s.is_failed() for s in states.values()), {k: s.type for k, s in states.items()}
    ids = [s.state_details.flow_run_id for s in states.values()]
    with get_client(sync_client=True) as client:
        runs = [client.read_flow_run(i) for i in ids]
        deadline, logs = time.monotonic() + 60, []
        while time.monotonic() < deadline:  # the log handler ships records in batches
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=ids)))
            if (
                len({log.flow_run_id for log in logs}) >= 3
            ):  # the `set` runs' (a refused `cfg` logs none: it never starts)
                break
            time.sleep(0.5)
    out, err = capfd.readouterr()
    shown = {
        **{f"state message ({k})": s.message or "" for k, s in states.items()},
        "flow run names and states": " ".join(f"{r.name} {r.state.message}" for r in runs),
        "flow run logs": "\n".join(log.message for log in logs),
        "stdout": out,
        "stderr": err,
        "log records": caplog.text,
    }
    assert logs, "the flow runs' logs reached the server"
    assert all("<redacted>" in shown[f"state message ({k})"] for k in states if k.startswith("set")), shown
    leaks = [where for where, text in shown.items() if SECRET in text]
    assert not leaks, {where: shown[where] for where in leaks}
