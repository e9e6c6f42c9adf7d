"""Placement `deployments`: each role as its own flow run of its deployment, watched by the mode's flow.

The mode's flow starts the trainer and every explorer with `run_deployment(timeout=0,
as_subflow=True)` (each on the pool that serves its deployment, with per-role job variables),
and the reward role when the run's reward is a model (its service, which the explorers share:
rl_engine.rewards.run_service), then watches them: a role whose flow run fails or crashes, or
that goes silent on the board (heartbeats), or that never starts, stops the others within seconds
and fails the run with a message naming it; cancelling the mode's flow run cancels the roles'
runs. The reward role ends after the explorers it serves; should it still run once every other
role has ended, the run's stop is requested, and after GRACE_S it is cancelled.
"""

from __future__ import annotations

import time
from typing import Any

from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.logging import get_run_logger
from prefect.states import Cancelling

from rl_engine.board import STOP_KEY, request_stop, role_name, silent_roles
from rl_engine.config import DeploymentsPlacement
from rl_engine.rewards.run_service import REWARD_ROLE, has_reward_role
from rl_engine.run.context import RunContext

POLL_S = 1.0
GRACE_S = 30.0  # after a stop request, how long roles get to end on their own before they are cancelled


class RoleFailed(RuntimeError):
    """A role of the run failed, crashed, went silent or never started; the message names it."""


def _job_variables(p: DeploymentsPlacement, role: str) -> dict[str, Any]:
    general = p.job_variables.get("explorer", {}) if role.startswith("explorer-") else {}
    return {**general, **p.job_variables.get(role, {})}


def _deployment(p: DeploymentsPlacement, role: str) -> str:
    return {"trainer": p.trainer_deployment, REWARD_ROLE: p.reward_deployment}.get(role, p.explorer_deployment)


def start_roles(run: RunContext, progress_id: str | None = None) -> dict[str, Any]:
    """{role: its flow run}, each started on its deployment (returns at once): the trainer, which
    moves the run's progress artifact `progress_id`, every explorer, and the reward role when the
    run has one."""
    p, handles = run.cfg.placement, {"run_url": run.url, "storage_options": run.storage_options}
    params: dict[str, dict[str, Any]] = {"trainer": {**handles, "progress_id": progress_id}}
    for i in range(run.cfg.explorer.count):
        params[role_name(i)] = {**handles, "explorer_id": i}
    if has_reward_role(run.cfg):
        params[REWARD_ROLE] = handles
    return {
        role: run_deployment(
            _deployment(p, role),
            parameters=kw,
            timeout=0,
            as_subflow=True,
            job_variables=_job_variables(p, role),
            flow_run_name=f"{run.cfg.name}-{role}",
        )
        for role, kw in params.items()
    }


def _problem(run: RunContext, attempt: str, states: dict[str, Any], started_at: float) -> str | None:
    """Why the run must stop now, if it must: a role failed, crashed, went silent, or never started."""
    p = run.cfg.placement
    for role, state in states.items():
        if state.is_failed() or state.is_crashed():
            return f"{role} {state.type.value.lower()}: {state.message}"
    silent = silent_roles(run.board, list(states), attempt, p.heartbeat_timeout_s)
    if silent:
        return f"{silent[0]} went silent: no heartbeat for over {p.heartbeat_timeout_s:.0f} s (placement.heartbeat_timeout_s)"
    waiting = [r for r, s in states.items() if s.is_scheduled() or s.is_pending()]
    if waiting and time.monotonic() - started_at > p.start_timeout_s:
        return f"{waiting[0]} did not start within {p.start_timeout_s:.0f} s (placement.start_timeout_s): is a worker polling the pool of its deployment?"
    return None


def run_deployments(run: RunContext, attempt: str, progress_id: str | None = None) -> None:
    """Start every role as its own flow run and watch them until all ended; raise RoleFailed naming the first to fail."""
    log, board = get_run_logger(), run.board
    children = start_roles(run, progress_id)
    log.info("roles started as flow runs: %s", {r: str(fr.id) for r, fr in children.items()})
    started_at, stop_seen, cancelled_children = time.monotonic(), None, False
    with get_client(sync_client=True) as client:
        try:
            while True:
                states = {role: client.read_flow_run(fr.id).state for role, fr in children.items()}
                if all(s.is_final() for s in states.values()):
                    break
                if (problem := _problem(run, attempt, states, started_at)) is not None:
                    request_stop(board, "failed", problem, by="flow")
                if _nothing_left_to_serve(states):
                    request_stop(board, "finished", "the trainer and every explorer have ended", by="flow")
                if stop_seen is None and board.get(STOP_KEY) is not None:
                    stop_seen = time.monotonic()
                if stop_seen is not None and not cancelled_children and time.monotonic() - stop_seen > GRACE_S:
                    _cancel(client, children, states)
                    cancelled_children = True
                time.sleep(POLL_S)
        except BaseException:
            # The mode's flow is going down (cancelled, SIGTERM): take the roles with it.
            request_stop(board, "cancelled", "the mode's flow run ended", by="flow")
            _cancel(client, children, {r: client.read_flow_run(fr.id).state for r, fr in children.items()})
            raise
    stop = board.get(STOP_KEY) or {}
    if stop.get("kind") == "failed":  # the first request: a cancel posted after a failure does not hide it
        # A role whose process died is the cause even when a peer's error (a broadcast cut short) was posted first.
        crashed = [
            f"{r} crashed: {s.message}"
            for r, s in states.items()
            if s.is_crashed() and not stop["reason"].startswith(r)
        ]
        raise RoleFailed(f"run {run.url} failed: {'; '.join(crashed + [stop['reason']])}")


def _nothing_left_to_serve(states: dict[str, Any]) -> bool:
    """The reward role still runs, every role it serves has ended."""
    served = [s for role, s in states.items() if role != REWARD_ROLE]
    return REWARD_ROLE in states and not states[REWARD_ROLE].is_final() and all(s.is_final() for s in served)


def _cancel(client: Any, children: dict[str, Any], states: dict[str, Any]) -> None:
    for role, fr in children.items():
        if not states[role].is_final():
            client.set_flow_run_state(fr.id, Cancelling(message="the run is stopping"), force=True)
