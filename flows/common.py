"""What every mode's flow does: start or resume the run, start its roles where the placement
says, honour cancellation, publish the report.

The schedule itself lives in the roles (rl_engine/roles.py); a mode's flow only orchestrates.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Any, Iterator

from prefect.context import get_run_context
from prefect.logging import get_run_logger
from prefect.states import Cancelled

from rl_engine.config import RFTConfig
from rl_engine.control import STOP_KEY, Board, request_stop
from rl_engine.errors import UserError
from rl_engine.learner import latest_state_step
from rl_engine.roles import post_start
from rl_engine.run import ResumePoint, RunContext, RunLease, open_run, resume_point, start_run
from tasks.report import publish_report
from tasks.roles import explorer_task, trainer_task


def open_or_start(cfg: RFTConfig, resume: str | None, mode: str) -> tuple[RunContext, str]:
    """A new run (loops start at trainer version 0, explorer step 1), or a resumed one: from its
    last trainer state, explorers one past their last committed step. Posts the attempt's start
    marker that every role reads; returns the run and the attempt id."""
    if cfg.synchronizer.mode != mode:
        raise UserError(f"synchronizer.mode = {cfg.synchronizer.mode!r}, but this is the {mode!r} flow; run the {cfg.synchronizer.mode!r} deployment or set the mode")
    if resume is None:
        run = start_run(cfg)
        at = ResumePoint(0, {i: 1 for i in range(run.cfg.explorer.count)})
    else:
        run = open_run(resume, cfg.buffer.storage.options)
        Board(run.url, run.storage_options).clear()  # the crashed attempt's markers must not be seen
        at = resume_point(run, latest_state_step(run) or 0)
        get_run_logger().info("resuming %s: trainer from version %d, explorers from steps %s", run.url, at.trainer_version, at.first_steps)
    return run, post_start(Board(run.url, run.storage_options), at)


class Cancel:
    cancelled = False


@contextlib.contextmanager
def watch_cancellation(run: RunContext, poll_s: float = 1.0) -> Iterator[Cancel]:
    """Ask every role to stop (on the run's board) when this flow run is cancelled from the UI or API.

    A flow run started in-process (not by a worker) gets no signal on cancellation, so the
    flow polls its own state; the roles see the stop request between steps and inside every wait.
    """
    from prefect.client.orchestration import get_client

    flow_run_id = get_run_context().flow_run.id
    board = Board(run.url, run.storage_options)
    done, cancel = threading.Event(), Cancel()

    def watch() -> None:
        with get_client(sync_client=True) as client:
            while not done.wait(poll_s):
                state = client.read_flow_run(flow_run_id).state
                if state is not None and state.type.value in ("CANCELLING", "CANCELLED"):
                    cancel.cancelled = True
                    request_stop(board, "cancelled", "the flow run was cancelled", by="flow")
                    return

    # In the flow's context: its settings (API URL) are context variables, which threads do not inherit.
    watcher = threading.Thread(target=contextvars.copy_context().run, args=(watch,), name="cancel-watch", daemon=True)
    watcher.start()
    try:
        yield cancel
    except BaseException as e:
        # The flow itself is going down (a failure, or SIGTERM from a worker): no role may outlive it.
        request_stop(board, "failed", f"the mode's flow ended: {type(e).__name__}: {e}", by="flow")
        raise
    finally:
        done.set()


def run_local(run: RunContext) -> None:
    """Placement `local`: every role as a concurrent task of this flow run; the first failure is raised."""
    opts = run.storage_options
    futures = [trainer_task.submit(run.url, opts)] + [explorer_task.submit(run.url, i, opts) for i in range(run.cfg.explorer.count)]
    errors = []
    for f in futures:
        try:
            f.result()
        except BaseException as e:  # noqa: BLE001 - raised below once every role has ended
            errors.append(e)
    if errors:
        stop = Board(run.url, run.storage_options).get(STOP_KEY) or {}
        get_run_logger().error("run stopped: %s", stop.get("reason", errors[0]))
        raise errors[0]


def run_mode(cfg: RFTConfig, resume: str | None, mode: str) -> Any:
    """The body of every mode's flow: the schedule is the roles' business, the placement says where they run."""
    from flows.placement import run_deployments

    # One driver per run: a second `--resume` of a run that is still going is refused before it touches anything.
    lease = RunLease(open_run(resume, cfg.buffer.storage.options).url, cfg.buffer.storage.options).acquire() if resume else None
    try:
        run, attempt = open_or_start(cfg, resume, mode)
        lease = lease or RunLease(run.url, run.storage_options).acquire()
        with watch_cancellation(run) as cancel:
            if run.cfg.placement.type == "local":
                run_local(run)
            else:
                run_deployments(run, attempt, cancel)
        return finish_run(run, cancelled=cancel.cancelled)
    finally:
        if lease is not None:
            lease.release()


def finish_run(run: RunContext, cancelled: bool = False) -> Any:
    """Publish the timeline, metrics and reward curve; the run's summary, or a Cancelled state."""
    summary = publish_report(run)
    if cancelled:
        return Cancelled(message=f"cancelled at trainer version {summary['final_version']}; resume with `rft run CONFIG --resume {run.url}`")
    return summary
