"""What the rewards that score a step's samples together share (the model reward's service,
reward_model.py; the judge's endpoint, judge.py; the sandboxed code tests, code_tests.py):
`score_one`, a single sample scored through the reward's `score_samples`; `ServiceCalls`, the
requests to a service and the error that fails a step under `on_failure: fail`; and
`TimedReward`, which records each step's scoring as a `reward` span of the explorer's timeline
(a slow service shows there, not hidden in the rollout)."""

from __future__ import annotations

from typing import Any

from rl_engine.rewards.isolation import UserCodeCrashed, UserCodeTimeout
from rl_engine.rewards.scoring import RewardError


def score_one(reward: Any, prompt: str, response: str, task: Any, finish_reason: str = "stop") -> float:
    """One sample's reward through `reward.score_samples` (a RewardFn call on a batch reward);
    its failure is raised."""
    (outcome,), _ = reward.score_samples([(prompt, response, task, finish_reason)])
    if isinstance(outcome, Exception):
        raise outcome
    return outcome[0]


class ServiceCalls:
    """Requests to one reward service: `describe` is how messages name it (its service and config
    field), `on_failure` and `timeout_s` its config's."""

    def __init__(self, describe: str, on_failure: str, timeout_s: float):
        self.describe, self.on_failure, self.timeout_s = describe, on_failure, float(timeout_s)

    def check_failure(self, failure: Exception | None) -> None:
        """RewardError naming the service when it failed (timed out, gone, erring) and
        `on_failure` is `fail`; nothing otherwise (the failed samples go to failed_reward)."""
        if failure is not None and self.on_failure == "fail":
            raise RewardError(
                f"{self.describe} failed ({failure}); taskset.reward.on_failure = fail stops the run here. "
                "Set on_failure: failed_reward to score such samples as taskset.user_code.failed_reward says instead, "
                "or raise taskset.reward.timeout_s if it is only slow"
            )

    def post(self, client: Any, url: str, body: dict[str, Any]) -> Any:
        """`client.post(url, json=body)` (an httpx.Client): the response, whatever its status;
        UserCodeTimeout past the client's timeout, UserCodeCrashed when nothing answers, which
        scoring counts as reward/timeouts and reward/crashes."""
        import httpx

        try:
            return client.post(url, json=body)
        except httpx.TimeoutException:
            raise UserCodeTimeout(
                f"{self.describe} did not answer within taskset.reward.timeout_s = {self.timeout_s:g} s"
            ) from None
        except httpx.TransportError as e:
            raise UserCodeCrashed(f"{self.describe} cannot be reached ({type(e).__name__}: {e})") from None


class TimedReward:
    """`reward` (one with `score_samples`) with each `score_samples` call recorded as a span of kind
    `reward` on `timeline` (an rl_engine.run.timeline.TimelineRecorder), marked with `step` and
    `version` (the caller sets them before each step); everything else is the reward's own."""

    def __init__(self, reward: Any, timeline: Any):
        self.reward, self.timeline = reward, timeline
        self.step: int | None = None
        self.version: int | None = None

    def score_samples(self, samples: Any) -> tuple[list[Any], dict[str, Any]]:
        with self.timeline.span("reward", step=self.step, version=self.version):
            return self.reward.score_samples(samples)

    def __call__(self, *args: Any, **kwargs: Any) -> float:
        return self.reward(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.reward, name)
