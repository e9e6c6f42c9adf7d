"""The run's reward service under `placement: deployments` with `taskset.reward: {type: model}`:
the reward role serves it (`serve`), the explorers find it on the run's board (`run_reward`), and
the board key between them is defined here and nowhere else.

    serve(board, cfg.taskset.reward, done)               # the reward role (rl_engine.roles.entry.reward_role)
    reward_fn = run_reward(cfg.taskset.reward, cfg, board, stop)    # an explorer's reward

The reward role is a flow run of its own (`placement.reward_deployment`, on whatever pool serves
it: a GPU reward model can live on another machine). It starts one classifier service
(reward_model_server.py) listening on `taskset.reward.host`, posts its URL under SERVICE_KEY,
starts it again and posts the new URL should it die, and stops it once `done()` (the run has
stopped and no explorer still runs). Every explorer's ModelRewardFn is built with `locate`: it
waits for that post (at most `placement.start_timeout_s`, then its samples fail as the service's
would, naming the reward role) and sends its requests there; a request that fails makes the next
step look it up again. Under `placement: local` there is no reward role: `run_reward` is
`build_reward`, and the explorers of the process share a service of their own (reward_model.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from rl_engine.board import Board, StopSignal, WaitTimeout
from rl_engine.rewards.reward_model import SERVICE_FIELDS, ModelRewardFn, service_settings, start_model_service
from rl_engine.rewards.scoring import RewardError, build_reward
from rl_engine.rewards.services import Service

log = logging.getLogger(__name__)

REWARD_ROLE = "reward"  # the reward role's name: its flow run `<run>-reward`, its heartbeat marker, its log file
SERVICE_KEY = "reward-service"  # where the reward role's service answers: url, pid, starts (1 + restarts), path
_CHECK_S = 1.0  # how often the reward role looks at its service and at whether it is done


def has_reward_role(cfg: Any) -> bool:
    """Whether the run (an RFTConfig) has a reward role: placement deployments and a model reward."""
    return cfg.placement.type == "deployments" and cfg.taskset.reward.type == "model"


def uses_run_service(cfg: Any, reward: Any) -> bool:
    """Whether `reward` (the run's taskset.reward, or an eval set's) is scored by the reward role's
    service: the run has one and `reward` is a model reward of the same service settings
    (SERVICE_FIELDS; normalize, timeout_s and on_failure are each client's own)."""
    fields = set(SERVICE_FIELDS)
    return (
        has_reward_role(cfg)
        and reward.type == "model"
        and reward.model_dump(include=fields) == cfg.taskset.reward.model_dump(include=fields)
    )


def run_reward(reward: Any, cfg: Any, board: Board | None, stop: StopSignal | None = None) -> Any:
    """build_reward(reward) for a role of the run `cfg` whose board is `board`: a reward the reward
    role's service scores (`uses_run_service`) locates that service (waiting on `stop` too); any
    other, and any without a board, is build_reward's (a model reward then starts its own service
    in this process when first used)."""
    if board is None or not uses_run_service(cfg, reward):
        return build_reward(reward)
    return ModelRewardFn(**reward.model_dump(exclude={"type"}), locate=service_locator(board, cfg.placement, stop))


def service_locator(board: Board, placement: Any, stop: StopSignal | None = None) -> Callable[[], str]:
    """`locate` of a ModelRewardFn: the URL the reward role posted, waited for at most
    `placement.start_timeout_s`; RewardError naming the reward role past it, Stopped on `stop`."""

    def locate() -> str:
        try:
            return board.wait(
                SERVICE_KEY,
                lambda m: "url" in m,
                what="the reward role's service",
                timeout_s=placement.start_timeout_s,
                stop=stop,
            )["url"]
        except WaitTimeout:
            raise RewardError(
                f"the reward role did not post its service within placement.start_timeout_s = {placement.start_timeout_s:g} s: "
                f"is a worker polling the pool of {placement.reward_deployment} (placement.reward_deployment)? "
                f"Its flow run (<run name>-{REWARD_ROLE}) and <run>/logs/engines-{REWARD_ROLE}.log say why it did not"
            ) from None

    return locate


def serve(board: Board, reward: Any, done: Callable[[], bool], before_post: Callable[[], None] | None = None) -> None:
    """The reward role's work: the service of `reward`'s settings (a ModelReward) started and posted
    on `board`, started again (and posted again) whenever it died, until `done()`; then stopped.
    `before_post` is called before each post (the role's fence: a role of an attempt a newer driver
    replaced must not point that attempt's explorers at its service). A service that cannot start
    raises RewardError naming it."""
    settings = service_settings(**reward.model_dump(include=set(SERVICE_FIELDS)))
    service: Service | None = None
    starts = 0
    try:
        while True:
            if service is None or not service.alive:
                if service is not None:
                    log.warning(
                        "the reward service (pid %d) exited with code %s: starting it again",
                        service.proc.pid,
                        service.proc.returncode,
                    )
                service = start_model_service(settings)
                starts += 1
                if before_post is not None:
                    before_post()
                board.post(
                    SERVICE_KEY,
                    {"url": service.url, "pid": service.proc.pid, "starts": starts, "path": settings["path"]},
                )
                log.info("reward service of %s answers at %s", settings["path"], service.url)
            if done():
                return
            time.sleep(_CHECK_S)
    finally:
        if service is not None:
            service.stop()
