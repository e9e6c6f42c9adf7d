"""A flow run that ends itself as Cancelled on purpose (a role the run stopped, a mode flow run
cancelled), in the process a worker starts for it (`python -m prefect.engine`, as the process
worker and `serve` run every flow run), ends Cancelled with exit status 0 and no traceback
(`flows.common.end_cancelled`); returning the Cancelled state there, as before, logs two
CancelledRun tracebacks and exits 1 (the contrast, so the test sees what it guards against)."""

from __future__ import annotations

import subprocess

import pytest
from prefect import flow

from flows.common import end_cancelled
from harness.prefect_live import REPO
from tests.flows.conftest import run_in_own_process

MESSAGE = "trainer stopped after 2 steps: the run was cancelled"


@flow(name="rft-test-stopped-on-purpose")
def stopped_on_purpose(clean: bool = True):
    from prefect.states import Cancelled

    return end_cancelled(MESSAGE) if clean else Cancelled(message=MESSAGE)


def run_in_its_own_process(clean: bool) -> tuple[subprocess.CompletedProcess, object]:
    """The flow run as a worker runs it: `python -m prefect.engine` with the run's id and entrypoint."""
    return run_in_own_process(
        stopped_on_purpose, {"clean": clean}, f"{REPO}/tests/flows/test_cancelled_exit.py:stopped_on_purpose", 120
    )


@pytest.mark.timeout(300)
def test_a_flow_run_stopped_on_purpose_ends_cancelled_with_exit_status_0(prefect_server):
    res, state = run_in_its_own_process(clean=True)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "Traceback" not in out and "CancelledRun" not in out, out[-4000:]
    assert state.is_cancelled() and state.message == MESSAGE, state
    assert "Finished in state Cancelled" in out, out[-4000:]

    before, state = run_in_its_own_process(clean=False)  # what a returned Cancelled state did
    assert (
        before.returncode == 1 and (before.stdout + before.stderr).count("CancelledRun") >= 2 and state.is_cancelled()
    )


def test_in_process_the_caller_gets_the_cancelled_state(prefect_server):
    state = stopped_on_purpose(return_state=True)
    assert state.is_cancelled() and state.message == MESSAGE
