"""What every mode's flow does: apply the run's `set` overrides, then the run's lifecycle as tasks
(preflight, start-run, the roles where the placement says, sweep-buffer, publish-report,
record-lineage), honouring cancellation and publishing the report also when cancelled.

The schedule itself lives in the roles (rl_engine/roles/entry.py); a mode's flow only orchestrates.
Every mode's flow takes the same parameters (`set`, `cfg`, `resume`), is named after its run
(`flow_run_label`), and returns the run's summary as its result, stored as JSON.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import threading
from collections.abc import Callable, Iterator
from typing import Annotated, Any

from prefect import flow
from prefect.context import get_run_context
from prefect.exceptions import ParameterTypeError
from prefect.logging import get_run_logger
from prefect.states import Cancelled
from pydantic import Field

from rl_engine.board import STOP_KEY, request_stop
from rl_engine.config import RFTConfig, apply_overrides, validate_config
from rl_engine.config.base import hiding_secrets, redact_overrides
from rl_engine.errors import UserError, hide_parameter_values, hide_user_error_tracebacks
from rl_engine.proc.logfile import terminal_to
from rl_engine.roles.entry import roles_share_process
from rl_engine.run.context import RunContext
from rl_engine.run.driver import RunDriver
from rl_engine.run.logs import run_log
from tasks.evaluation import start_evaluation
from tasks.report import follow_trackers, publish_report, publish_resume, report_key_prefix, start_progress
from tasks.roles import explorer_task, trainer_task
from tasks.run import check_run, record_run, start_attempt, sweep_buffer

# Prefect logs a refused parameter's values (a deployment's `cfg`: a credential in it) on the flow
# process's terminal before the flow runs: every process that runs a mode's flow imports this module.
hide_parameter_values("prefect.flows")
# A refused config (a UserError: a bad `set`, a missing file; Prefect's refusal of a `cfg` the form
# got wrong) is one line on a worker's terminal, not the traceback Prefect's run logger and its
# engine (`python -m prefect.engine`) each log with it.
hide_user_error_tracebacks("prefect.flow_runs", "prefect.task_runs", "prefect.engine", also=(ParameterTypeError,))


def with_overrides(cfg: RFTConfig, overrides: list[str] | None) -> RFTConfig:
    """`cfg` with the flow run's dotted overrides (its `set` parameter, e.g. `["trainer.total_steps=50"]`)
    applied and validated again, as `rft run --set` does on a file: the deployment's `cfg` stays
    whole, only the named fields change; a bad key or value is a ConfigError naming it, and none
    of the credentials the overrides give (the list is quoted as `redact_overrides` shows it)."""
    if not overrides:
        return cfg
    with hiding_secrets(overrides=overrides):
        return validate_config(
            apply_overrides(cfg.model_dump(mode="json"), list(overrides)),
            f"flow parameter set={redact_overrides(overrides)}",
        )


def run_label(mode: str, parameters: dict[str, Any], given: str | None = None) -> str:
    """The name of a mode's flow run with these `parameters`: the run's name, which starts with the
    mode (`synchronous-20250101-030000-1a2b3c`; a named run `nightly` gives `synchronous-nightly`,
    a resumed one `synchronous-nightly-resume`). A new unnamed run's name is drawn, unless the flow
    run was created with a name of this mode's (`given`, e.g. `prefect deployment run ...
    --flow-run-name synchronous-nightly`, or the `name` of a REST `create_flow_run`): its creator
    named it after the run, and the run takes that name (`flow_config`), so it is never renamed."""
    try:
        if parameters.get("resume"):
            name, tail = str(parameters["resume"]).rstrip("/").rsplit("/", 1)[-1], "-resume"
        else:
            cfg = with_overrides(RFTConfig.model_validate(parameters["cfg"]), parameters.get("set"))
            if cfg.name is None and given and given.startswith(f"{mode}-") and given != f"{mode}-{INVALID}":
                return given
            name, tail = cfg.resolved().name, ""
    except Exception:  # noqa: BLE001 - the flow itself reports a bad config, naming the field
        return f"{mode}-{INVALID}"
    return (name if name.startswith(mode) else f"{mode}-{name}") + tail


INVALID = "invalid-config"  # a flow run's name when its parameters make no config: `<mode>-invalid-config`


def flow_run_label(mode: str) -> Callable[[], str]:
    """`flow_run_name` of a mode's flow (`run_label` of the flow run's parameters and the name it
    was created with); the flow adopts a new unnamed run's name (`flow_config`), so the flow run
    and the run directory carry the same name."""

    def label() -> str:
        from prefect.runtime import flow_run

        return run_label(mode, flow_run.parameters, flow_run.name)

    return label


# The example of the `set` parameter in the run form (the schema's `examples`, and its description).
SET_EXAMPLE = ["trainer.total_steps=50", "algorithm.preset=dapo"]

# The `set` parameter's type: a mode flow takes it first, `fn(set=None, *, cfg, resume=None)`, so the
# run form (Prefect orders parameters by their `position` in the signature) shows it above the
# ten screens of `cfg`; `cfg` and `resume` are keyword-only (every caller names them).
Overrides = Annotated[list[str] | None, Field(examples=[SET_EXAMPLE])]

# The parameters' descriptions in the deployment's schema (the UI's run form); Prefect reads them
# from the flow function's docstring (Google style), where `mode_flow` appends them.
PARAMETERS_DOC = f"""

    Args:
        set: Dotted overrides applied on top of `cfg`, like `rft run --set`, e.g. {json.dumps(SET_EXAMPLE)}: only those fields of the deployment's config change. The usual way to change a run.
        cfg: The whole run config (RFTConfig); a deployment's run gets the deployment's values unless the run replaces all of it.
        resume: URL of a run to continue from its last trainer checkpoint, with the config stored in that run.
"""


def mode_flow(name: str, mode: str) -> Callable[[Callable[..., Any]], Any]:
    """The Prefect flow of a mode, `fn(set=None, *, cfg, resume=None)`: named after its run
    (`flow_run_label`), its result (the run's summary) stored as JSON, its parameters described in
    the run form, `set` first."""

    def decorate(fn: Callable[..., Any]) -> Any:
        fn.__doc__ = (fn.__doc__ or "").rstrip() + PARAMETERS_DOC
        return flow(
            name=name,
            log_prints=True,
            flow_run_name=flow_run_label(mode),
            persist_result=True,
            result_serializer="json",
        )(fn)

    return decorate


def stopped_as(run: RunContext) -> str | None:
    """The kind of the run's stop request (`finished`, `cancelled`, `failed`; None if none was
    posted): the run's verdict. It is on the board, durable, and the first request wins
    (`request_stop`), so it names what stopped the roles however the flow's threads interleave:
    a cancel seen by the roles before the flow's own watcher, or a role's error after the cancel."""
    return (run.board.get(STOP_KEY) or {}).get("kind")


def _cancel_requested(client: Any, flow_run_id: Any) -> bool:
    """Whether the flow run was cancelled (CANCELLING or CANCELLED) through the UI or API."""
    state = client.read_flow_run(flow_run_id).state
    return state is not None and state.type.value in ("CANCELLING", "CANCELLED")


@contextlib.contextmanager
def watch_cancellation(run: RunContext, poll_s: float = 1.0) -> Iterator[None]:
    """Ask every role to stop (on the run's board) when this flow run is cancelled from the UI or API.

    A flow run started in-process (not by a worker) gets no signal on cancellation, so the
    flow polls its own state; the roles see the stop request between steps and inside every wait.
    The run's verdict is its board's stop request (`stopped_as`), not anything this watcher holds.
    """
    from prefect.client.orchestration import get_client

    flow_run_id = get_run_context().flow_run.id
    board = run.board
    done = threading.Event()

    def watch() -> None:
        with get_client(sync_client=True) as client:
            while not done.wait(poll_s):
                if _cancel_requested(client, flow_run_id):
                    request_stop(board, "cancelled", "the flow run was cancelled", by="flow")
                    return

    # In the flow's context: its settings (API URL) are context variables, which threads do not inherit.
    watcher = threading.Thread(target=contextvars.copy_context().run, args=(watch,), name="cancel-watch", daemon=True)
    watcher.start()
    try:
        yield
    except BaseException as e:
        # The flow itself is going down (a failure, or SIGTERM from a worker that cancels it): no
        # role may outlive it. A cancel the watcher has not polled yet is still a cancel.
        try:
            with get_client(sync_client=True) as client:
                cancelled = _cancel_requested(client, flow_run_id)
        except Exception:  # noqa: BLE001 - the API unreachable: the flow's own error is what we know
            cancelled = False
        if cancelled:
            request_stop(board, "cancelled", "the flow run was cancelled", by="flow")
        request_stop(board, "failed", f"the mode's flow ended: {type(e).__name__}: {e}", by="flow")
        raise
    finally:
        done.set()
        watcher.join(poll_s + 10)  # no late request after the verdict is read (a poll in flight ends first)


def run_local(run: RunContext, progress_id: str | None = None) -> None:
    """Placement `local`: every role as a concurrent task of this flow run; the first failure is raised
    (logged as an error, unless the run was cancelled)."""
    opts = run.storage_options
    errors = []
    with roles_share_process():
        futures = [trainer_task.submit(run.url, opts, progress_id)] + [
            explorer_task.submit(run.url, i, opts) for i in range(run.cfg.explorer.count)
        ]
        for f in futures:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - raised below once every role has ended
                errors.append(e)
    if errors:
        stop = run.board.get(STOP_KEY) or {}
        # A cancel (the UI's, the API's, a worker's SIGTERM) is what the user asked for: not an error line.
        log = get_run_logger().info if stop.get("kind") == "cancelled" else get_run_logger().error
        log("run stopped: %s", stop.get("reason", errors[0]))
        raise errors[0]


def in_own_process() -> bool:
    """This flow run has its process to itself: a worker or `serve` started it (`python -m
    prefect.engine`, PREFECT__FLOW_RUN_ID), as opposed to a call in `rft run`'s or a test's process."""
    return os.environ.get("PREFECT__FLOW_RUN_ID") == str(get_run_context().flow_run.id)


@contextlib.contextmanager
def output_to_run_log(
    run_url: str, storage_options: dict[str, Any] | None, name: str = "engines.log"
) -> Iterator[None]:
    """In a flow run's own process (a worker's): its stdout and stderr, and every child's (vLLM's
    engine processes, DeepSpeed's op builds), go to `<run>/logs/<name>` until the block ends, as
    `rft run` does with its own (rl_engine/proc/logfile.py); the worker's terminal gets one line
    saying where. Elsewhere `rft run` or the caller owns the terminal: nothing changes."""
    if not in_own_process():
        yield
        return
    with run_log(run_url, storage_options, name) as path, terminal_to(path) as term:
        term.write(f"flow run {get_run_context().flow_run.name!r}: engine and library output in {path}\n")
        yield


def run_mode(cfg: RFTConfig, resume: str | None, mode: str, overrides: list[str] | None = None) -> Any:
    """The body of every mode's flow: the run's lifecycle as tasks (rl_engine/run/driver.py), the
    roles where the placement says; the schedule is the roles' business."""
    cfg = flow_config(cfg, resume, overrides)
    source = f"the cfg parameter of flow run {get_run_context().flow_run.name!r}"
    with RunDriver(cfg, resume, mode, source, log=get_run_logger().info) as driver:
        check_run(driver)
        run, attempt = start_attempt(driver)
        with output_to_run_log(run.url, run.storage_options):
            return run_started(driver, run, attempt)


def run_started(driver: RunDriver, run: RunContext, attempt: str) -> Any:
    """The run from its roles' start to its report: a summary, or a Cancelled state."""
    keys = report_key_prefix(get_run_context().flow.name)
    progress_id = start_progress(run, keys) if run.cfg.monitor.artifacts else None
    with follow_trackers(run):  # monitor.trackers, fed until the run ends, however it ends
        try:
            with watch_cancellation(run):
                run_roles(run, attempt, progress_id)
        except BaseException as e:
            cancelled = stopped_as(run) == "cancelled"
            end_anyway(driver, run, keys, "cancelled" if cancelled else "failed")
            if cancelled and isinstance(e, Exception):
                # A role's error after the cancel (its work cut short) does not make the cancelled run a failure.
                get_run_logger().warning("after the cancel: %s: %s", type(e).__name__, e)
                return end_cancelled(f"cancelled; resume with `rft run CONFIG --resume {run.url}`")
            raise
        return finish_run(driver, run, keys, cancelled=stopped_as(run) == "cancelled")


def flow_config(cfg: RFTConfig, resume: str | None, overrides: list[str] | None) -> RFTConfig:
    """The run's config as this flow run gives it: its `set` overrides applied, and a new unnamed
    run named after the flow run (`flow_run_label` drew the name)."""
    if resume is not None and overrides:
        raise UserError(
            f"set={redact_overrides(overrides)} with resume={resume!r}: a resumed run keeps the config it was started with ({resume}/config.yaml); start a new run to change settings"
        )
    cfg = with_overrides(cfg, overrides)
    flow_run = get_run_context().flow_run
    if resume is None and cfg.name is None:
        cfg = validate_config(
            {**cfg.model_dump(mode="json"), "name": flow_run.name}, f"flow run name {flow_run.name!r}"
        )
    return cfg


def run_roles(run: RunContext, attempt: str, progress_id: str | None) -> None:
    """The trainer and the explorers: tasks of this flow run (placement `local`) or flow runs of
    their deployments, watched from here."""
    from flows.placement import run_deployments

    if run.cfg.placement.type == "local":
        run_local(run, progress_id)
    else:
        run_deployments(run, attempt, progress_id)


def end_anyway(driver: RunDriver, run: RunContext, keys: str, status: str) -> None:
    """A run that failed or was cancelled (by its worker's SIGTERM too) still publishes what it did
    and enters its lineage's runs.jsonl (consuming no tasks, latest.json unmoved); a failure to do
    either never hides why the run ended."""
    report_anyway(run, keys)
    try:
        publish_resume(run, keys, status)
    except Exception as e:  # noqa: BLE001 - the run's own error is what propagates
        get_run_logger().warning("could not publish how to resume %s: %s: %s", run.url, type(e).__name__, e)
    try:
        record_run(driver, status)
    except Exception as e:  # noqa: BLE001 - the run's own error is what propagates
        get_run_logger().warning("could not record %s in its lineage: %s: %s", run.url, type(e).__name__, e)


def report_anyway(run: RunContext, keys: str) -> None:
    """The report of a run cancelled by its worker (SIGTERM) or failed: what was done still goes out,
    and a failure to publish it never hides why the run ended."""
    try:
        publish_report(run, keys)
    except Exception as e:  # noqa: BLE001 - the run's own error is what propagates
        get_run_logger().warning("could not publish the report of %s: %s: %s", run.url, type(e).__name__, e)


def end_cancelled(message: str) -> Any:
    """What a flow returns to end as Cancelled: the Cancelled state, or, in the process a worker or
    `serve` started for this flow run (`python -m prefect.engine`, PREFECT__FLOW_RUN_ID), the flow
    run set Cancelled through the API and the process ended with Prefect's `Abort` signal. There
    Prefect's engine would turn a returned Cancelled state into a CancelledRun exception at exit,
    logging two tracebacks and exiting 1, for a run stopped on purpose; with `Abort` it logs one
    info line and exits 0 (prefect/engine.py, handle_engine_signals)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import Abort

    state, flow_run = Cancelled(message=message), get_run_context().flow_run
    if not in_own_process():
        return state  # in-process (`rft run`, a test): the caller gets the state
    with get_client(sync_client=True) as client:
        final = client.set_flow_run_state(flow_run.id, state, force=True).state
    get_run_logger().info("%s: the flow run is Cancelled", message)
    signal = Abort(message)
    signal.state = final  # the engine's "Finished in state Cancelled(...)"
    raise signal


def finish_run(driver: RunDriver, run: RunContext, keys: str, cancelled: bool = False) -> Any:
    """Every role has stopped: sweep the buffer, publish the timeline, metrics, reward curve and
    model link, record the run in its lineage; the run's summary, or a Cancelled state."""
    sweep_buffer(driver)
    summary = publish_report(run, keys)
    record_run(
        driver, "cancelled" if cancelled else "completed"
    )  # only a completed run moves the lineage's latest.json
    if not cancelled and run.cfg.eval.after_run:
        start_evaluation(run.cfg.eval.after_run, run.url, run.storage_options)
    if cancelled:
        publish_resume(run, keys, "cancelled")
        return end_cancelled(
            f"cancelled at trainer version {summary['final_version']}; resume with `rft run CONFIG --resume {run.url}`"
        )
    return summary
