"""Cancel a real run's flow run mid-run, as a user does from the UI or the API, for the flow tests.

    result, cancelled = run_and_cancel(cfg, at_version=3)

runs `cfg`'s mode flow (`cli.run.run_config`) in the calling thread while another thread waits for
the run's trainer to reach `at_version` (its marker on the run's board, on any storage) and then
sets the run's flow run CANCELLING through the Prefect API, as the UI's Cancel button does; the
flow's cancel watcher (flows/common.py) sees it within a second and posts the run's stop request.
With `post_stop=True` the thread first posts that stop request on the board itself, so a run of a
few quick steps is stopped at `at_version` (its roles, in this process, see the post at once)
rather than after the API's round trip and the watcher's poll. It returns the flow's result, or the exception it raised (a cancelled flow run raises),
and the ids of the flow runs it cancelled.

The run's flow run is found among the server's RUNNING flow runs by its `cfg` (or `resume`)
parameter naming the run's directory: a test session's server holds hundreds of flow runs, and an
unfiltered first page of them (sorted by random id) need not hold the one running now.
Every wait has a deadline (`timeout_s`).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from cli.run import run_config
from rl_engine.board import TRAINER_KEY, Board, request_stop
from rl_engine.config import RFTConfig


def runs_of(parameters: dict[str, Any]) -> str | None:
    """The run directory a mode flow run's parameters name: its `resume`, or its cfg's `<storage>/<name>`."""
    if parameters.get("resume"):
        return str(parameters["resume"]).rstrip("/")
    cfg = parameters.get("cfg") or {}
    url, name = ((cfg.get("buffer") or {}).get("storage") or {}).get("url"), cfg.get("name")
    return f"{str(url).rstrip('/')}/{name}" if url and name else None


def running_flow_runs(client: Any, run_url: str) -> list[Any]:
    """The RUNNING flow runs of the run at `run_url` (normally one)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType

    running = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING])))
    return [fr for fr in client.read_flow_runs(flow_run_filter=running) if runs_of(fr.parameters) == run_url]


def trainer_version(board: Board) -> int:
    try:
        return int((board.get(TRAINER_KEY) or {}).get("version", 0))
    except Exception:  # noqa: BLE001 - the run directory (or its bucket prefix) may not exist yet
        return 0


def cancel_at(
    run_url: str,
    options: dict[str, Any] | None,
    at_version: int,
    done: threading.Event,
    cancelled: list,
    post_stop: bool = False,
    timeout_s: float = 300,
) -> None:
    """Once the run's trainer reached `at_version`, cancel its flow run through the API (then post
    the run's stop request, if `post_stop`); the ids cancelled go to `cancelled`. Gives up when
    `done` is set (the run ended first) or after `timeout_s`."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    board, deadline, found = Board.at(run_url, options), time.monotonic() + timeout_s, []
    with get_client(sync_client=True) as client:
        # The flow run is found while the trainer gets there: at `at_version` the cancel is one request.
        while not (found and trainer_version(board) >= at_version):
            if done.is_set() or time.monotonic() > deadline:
                return
            found = found or running_flow_runs(client, run_url)
            time.sleep(0.05)
        if post_stop:  # first: the API's round trip under load took the trainer of a tiny run to its last step
            request_stop(board, "cancelled", "test: cancelled mid-run", by="test")
        for fr in found:  # a run stopped as cancelled takes seconds to end: the cancel still finds it running
            client.set_flow_run_state(fr.id, Cancelling(), force=True)
            cancelled.append(fr.id)


def run_and_cancel(
    cfg: RFTConfig, at_version: int, *, post_stop: bool = False, timeout_s: float = 300
) -> tuple[object, list]:
    """Run `cfg`'s flow while `cancel_at` cancels it at trainer version `at_version`; (its result or
    the exception it raised, the ids of the flow runs cancelled)."""
    done, cancelled = threading.Event(), []
    url, options = cfg.run_url, cfg.buffer.storage.fs_options()
    canceller = threading.Thread(
        target=cancel_at,
        args=(url, options, at_version, done, cancelled, post_stop, timeout_s),
        name="test-canceller",
        daemon=True,
    )
    canceller.start()
    try:
        result: object = run_config(cfg)
    except BaseException as e:  # noqa: BLE001 - a cancelled flow run raises; the caller checks what came back
        result = e
    done.set()
    canceller.join(60)
    assert not canceller.is_alive(), "the canceller thread did not end"
    return result, cancelled
