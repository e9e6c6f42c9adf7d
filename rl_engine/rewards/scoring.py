"""Reward functions as plain callables, the factory that builds one from config, and the scorer.

A reward is any callable `(prompt, response, task, finish_reason) -> float | dict[str, float]`;
a dict gives named components whose sum is the reward. `score_rollouts` calls it on every
sample: a reward that raises (or returns something that is not a finite number) marks only that
sample as failed, counted in the metrics with its message, and the run goes on without it. Two
failures stop the step at once instead, as a `RewardError` (a UserError) naming the reward: a
reward that failed on every sample of the call (it is broken, not unlucky, and a step with
nothing scored cannot train), and a user reward still running after its
`taskset.reward.timeout_s`.

    reward_fn = build_reward(cfg.taskset.reward)
    result = score_rollouts(reward_fn, [RolloutSample(prompt, response, task, "stop"), ...])
    result.rewards, result.components, result.ok, result.metrics
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import numbers
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NamedTuple, Protocol

from rl_engine.errors import UserError
from rl_engine.rewards.arithmetic import ArithmeticRewardFn
from rl_engine.rewards.countdown import CountdownRewardFn
from rl_engine.rewards.tasks import Task
from rl_engine.rewards.word_arithmetic import FinalAnswerRewardFn

log = logging.getLogger(__name__)
MAX_ERROR_MESSAGES = 5


class RewardError(UserError):
    """The reward itself is broken (fails on every sample, or never returns): the step fails with this."""


class RewardFn(Protocol):
    def __call__(self, prompt: str, response: str, task: Task, finish_reason: str) -> float | dict[str, float]: ...


class RolloutSample(NamedTuple):
    """What a reward sees of one rollout (a plain 4-tuple works too)."""

    prompt: str
    response: str
    task: Task
    finish_reason: str


# --------------------------------------------------------------------------- factory


class PythonRewardFn:
    """A user function `module:function` with its configured kwargs bound.

    Functions that take `finish_reason` (or **kwargs) get it; three-argument functions
    `(prompt, response, task)` are called without it. With `timeout_s`, each call runs in a
    daemon thread and one still running after `timeout_s` raises RewardError; the stuck thread is
    abandoned (Python cannot kill it), which is harmless because the step, and so the run, fails.
    A call stuck in C code that holds the GIL (a catastrophic regex) cannot be timed out this way.
    """

    def __init__(self, spec: str, fn: Callable[..., Any], kwargs: dict[str, Any], timeout_s: float | None = None):
        self.spec, self.fn, self.kwargs, self.timeout_s = spec, fn, dict(kwargs), timeout_s
        self.pass_finish_reason = _check_signature(spec, fn, self.kwargs)

    def __call__(self, prompt: str, response: str, task: Task, finish_reason: str) -> float | dict[str, float]:
        kwargs = {"finish_reason": finish_reason, **self.kwargs} if self.pass_finish_reason else self.kwargs
        if self.timeout_s is None:
            return self.fn(prompt, response, task, **kwargs)
        box: dict[str, Any] = {}
        done = threading.Event()

        def call() -> None:
            try:
                box["value"] = self.fn(prompt, response, task, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread below
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=call, name=f"reward-{self.spec}", daemon=True).start()
        if not done.wait(self.timeout_s):
            raise RewardError(
                f"taskset.reward.function = {self.spec!r} did not return within taskset.reward.timeout_s = {self.timeout_s:g} s "
                f"(task {getattr(task, 'task_id', '?')!r}); make it return faster (no network waits or unbounded loops) or raise taskset.reward.timeout_s"
            )
        if "error" in box:
            raise box["error"]
        return box["value"]

    def __repr__(self) -> str:
        return f"PythonRewardFn({self.spec!r}, kwargs={self.kwargs!r})"


def _check_signature(spec: str, fn: Callable[..., Any], kwargs: dict[str, Any]) -> bool:
    """True if `fn` takes finish_reason; UserError if it takes neither call form.

    Checked once here so a wrong signature is one clear error, not a TypeError on every sample.
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return True  # builtins / C callables without a signature: assume the full protocol
    try:
        sig.bind("p", "r", None, finish_reason="stop", **kwargs)
        return True
    except TypeError:
        pass
    try:
        sig.bind("p", "r", None, **kwargs)
        return False
    except TypeError as e:
        raise UserError(
            f"taskset.reward.function = {spec!r}: signature {sig} cannot be called as "
            f"(prompt, response, task[, finish_reason]) with kwargs {sorted(kwargs)} ({e})"
        ) from None


def _import_function(spec: str) -> Callable[..., Any]:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - ImportError, or the module itself failing at import
        raise UserError(
            f"taskset.reward.function = {spec!r}: cannot import module {module_name!r} ({type(e).__name__}: {e}); "
            "is it installed or on PYTHONPATH?"
        ) from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise UserError(f"taskset.reward.function = {spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise UserError(f"taskset.reward.function = {spec!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


def build_reward(cfg: Any) -> RewardFn:
    """The reward callable of a RewardConfig (ArithmeticReward | CountdownReward | FinalAnswerReward | PythonReward)."""
    if cfg.type == "arithmetic":
        return ArithmeticRewardFn(correct_weight=cfg.correct_weight, format_weight=cfg.format_weight)
    if cfg.type == "countdown":
        return CountdownRewardFn(correct_weight=cfg.correct_weight, close_weight=cfg.close_weight)
    if cfg.type == "final_answer":
        return FinalAnswerRewardFn(correct_weight=cfg.correct_weight, format_weight=cfg.format_weight)
    if cfg.type == "python":
        return PythonRewardFn(cfg.function, _import_function(cfg.function), cfg.kwargs, cfg.timeout_s)
    raise ValueError(f"unknown reward type {cfg.type!r}")


# --------------------------------------------------------------------------- scoring


@dataclass
class ScoreResult:
    """Per-sample rewards; a failed sample has reward None, no components and its error message."""

    rewards: list[float | None]
    components: list[dict[str, float]]
    errors: list[str | None]
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> list[bool]:
        """Which samples were scored (the others are excluded from training)."""
        return [e is None for e in self.errors]


def _is_number(v: Any) -> bool:
    # numbers.Real covers numpy scalars (np.float32 is not a float); a bool is a bug, not a reward.
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _as_reward(value: Any) -> tuple[float, dict[str, float]]:
    """(reward, components) of a reward function's return value; ValueError if it is not usable."""
    if isinstance(value, dict):
        comps = {}
        for k, v in value.items():
            if not isinstance(k, str) or not _is_number(v):
                raise ValueError(f"reward component {k!r} = {v!r}: components must be str -> number")
            comps[k] = float(v)
        total = math.fsum(comps.values())
    elif _is_number(value):
        comps, total = {}, float(value)
    else:
        raise ValueError(f"reward returned {type(value).__name__} {value!r}; expected a float or a dict of floats")
    if not math.isfinite(total):
        raise ValueError(f"reward is not finite ({total}); components {comps}")
    return total, comps


def score_rollouts(reward_fn: RewardFn, items: Iterable[Any]) -> ScoreResult:
    """Score each (prompt, response, task, finish_reason) sample; failures are isolated per sample,
    except a reward that fails on every sample or times out: RewardError (see the module docstring)."""
    rewards: list[float | None] = []
    components: list[dict[str, float]] = []
    errors: list[str | None] = []
    first_task = None
    for item in items:
        prompt, response, task, finish_reason = item
        try:
            total, comps = _as_reward(reward_fn(prompt, response, task, finish_reason))
        except RewardError:
            raise
        except Exception as e:  # noqa: BLE001 - a reward failing on some samples must not kill the run
            msg = f"{type(e).__name__}: {e}"
            log.warning("reward failed on task %s: %s", getattr(task, "task_id", "?"), msg)
            total, comps = None, {}
            if first_task is None:
                first_task = task
        else:
            msg = None
        rewards.append(total)
        components.append(comps)
        errors.append(msg)
    if errors and all(e is not None for e in errors):
        raise RewardError(
            f"the reward {_describe(reward_fn)} failed on all {len(errors)} samples of this step, e.g. on task "
            f"{getattr(first_task, 'task_id', '?')!r}: {errors[0]}; fix the reward: it must return a finite float or a dict of "
            "str -> float for every response (a sample it fails on now and then is left out and counted as reward/errors)"
        )
    return ScoreResult(rewards, components, errors, _metrics(rewards, components, errors))


def _describe(reward_fn: Any) -> str:
    spec = getattr(reward_fn, "spec", None)
    return f"taskset.reward.function = {spec!r}" if spec else type(reward_fn).__name__


def _metrics(rewards: list[float | None], components: list[dict[str, float]], errors: list[str | None]) -> dict[str, Any]:
    scored = [r for r in rewards if r is not None]
    out: dict[str, Any] = {
        "reward/count": len(scored),
        "reward/errors": len(rewards) - len(scored),
        "reward/mean": math.fsum(scored) / len(scored) if scored else float("nan"),
    }
    names = sorted({k for c in components for k in c})
    for name in names:
        vals = [c.get(name, 0.0) for c, r in zip(components, rewards) if r is not None]
        out[f"reward/{name}/mean"] = math.fsum(vals) / len(vals)
    # Distinct messages only: one broken reward usually fails every sample the same way.
    unique = list(dict.fromkeys(e for e in errors if e is not None))
    out["reward/error_messages"] = unique[:MAX_ERROR_MESSAGES]
    return out
