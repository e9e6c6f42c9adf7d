"""What every mode's flow does around its loops: start or resume a run, honour cancellation,
wait for the loops, publish the report.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

from prefect.context import get_run_context
from prefect.logging import get_run_logger
from prefect.states import Cancelled

from rl_engine.config import RFTConfig
from rl_engine.control import Board, Stopped
from rl_engine.run import ResumePoint, RunContext, open_run, resume_point, start_run
from rl_engine.learner import latest_state_step
from tasks.report import publish_report
from tasks.workers import save_model, save_trainer_state


def open_or_start(cfg: RFTConfig, resume: str | None) -> tuple[RunContext, ResumePoint]:
    """A new run (loops start at trainer version 0, explorer step 1), or a resumed one: from its
    last trainer state, explorers one past their last committed step."""
    if resume is None:
        run = start_run(cfg)
        return run, ResumePoint(0, {i: 1 for i in range(run.cfg.explorer.count)})
    run = open_run(resume, cfg.buffer.storage.options)
    Board(run.url, run.storage_options).clear()
    point = resume_point(run, latest_state_step(run) or 0)
    get_run_logger().info("resuming %s: trainer from version %d, explorers from steps %s", run.url, point.trainer_version, point.first_steps)
    return run, point


class _Cancel:
    cancelled = False


@contextlib.contextmanager
def watch_cancellation(stop: threading.Event, poll_s: float = 1.0) -> Iterator[_Cancel]:
    """Set `stop` when this flow run is cancelled from the UI or API (state CANCELLING/CANCELLED).

    A flow run started in-process (not by a worker) gets no signal on cancellation, so the
    flow polls its own state; the loops check `stop` between steps and inside every wait.
    Leaving the block sets `stop` too, so no loop outlives the flow.
    """
    from prefect.client.orchestration import get_client

    flow_run_id = get_run_context().flow_run.id
    done, cancel = threading.Event(), _Cancel()

    def watch() -> None:
        with get_client(sync_client=True) as client:
            while not done.wait(poll_s):
                state = client.read_flow_run(flow_run_id).state
                if state is not None and state.type.value in ("CANCELLING", "CANCELLED"):
                    cancel.cancelled = True
                    stop.set()
                    return

    watcher = threading.Thread(target=watch, name="cancel-watch", daemon=True)
    watcher.start()
    try:
        yield cancel
    finally:
        done.set()
        stop.set()


@contextlib.contextmanager
def stop_on_error(stop: threading.Event) -> Iterator[None]:
    """A loop that fails stops the others (they would wait forever for it). Once the run is
    stopping, errors from peers going away mid-exchange (a broadcast whose receivers left) are
    expected: the loop ends quietly, like on Stopped."""
    try:
        yield
    except Stopped:
        pass
    except BaseException as e:
        if stop.is_set():
            get_run_logger().warning("loop ended during stop: %s: %s", type(e).__name__, e)
            return
        stop.set()
        raise


def wait_all(futures: list[Any], stop: threading.Event) -> list[Any]:
    """Results of the loop futures, after every loop has ended; the first failure is raised."""
    results, errors = [], []
    for f in futures:
        try:
            results.append(f.result())
        except BaseException as e:  # noqa: BLE001 - raised below once every loop has ended
            stop.set()
            errors.append(e)
            results.append([])
    if errors:
        raise errors[0]
    return results


def save_due(learner: Any, cfg: RFTConfig) -> None:
    """After a trainer step: resumable state every checkpoint_interval steps and at the end,
    and the trained model (`<run>/model/`) once the last step is done."""
    t = learner.version
    if t % cfg.trainer.checkpoint_interval == 0 or t == cfg.trainer.total_steps:
        save_trainer_state(learner, t)
    if t == cfg.trainer.total_steps:
        save_model(learner, t)


def finish_run(run: RunContext, trainer_metrics: list[dict], explorer_metrics: list[dict], cancelled: bool = False) -> Any:
    """Publish the timeline, metrics and reward curve; the run's summary, or a Cancelled state."""
    summary = publish_report(run, trainer_metrics, explorer_metrics)
    if cancelled:
        return Cancelled(message=f"cancelled at trainer version {summary['final_version']}; resume with `rft run CONFIG --resume {run.url}`")
    return summary
