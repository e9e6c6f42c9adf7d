"""Reward functions as plain callables, the factory that builds one from config, and the scorer.

A reward is any callable `(prompt, response, task, finish_reason) -> float | dict[str, float]`;
a dict gives named components whose sum is the reward. `score_rollouts` calls it on every
sample: a reward that raises (or returns something that is not a finite number) marks only that
sample as failed, counted in the metrics (reward/errors) with its message, and the run goes on
without it.

A user (`type: python`) reward given a `UserCodePool` (isolation.py) runs in its worker processes,
all samples submitted at once: a call still running after `taskset.reward.timeout_s` has its
worker killed and replaced (reward/timeouts), a call whose worker died (segfault, os._exit, OOM
kill) is a crash (reward/crashes). Such a sample is scored `failed_reward`
(`taskset.user_code.failed_reward`), as the one component `{"failed": failed_reward}`, or, when
that is None, left out like a sample whose reward raised. Without a pool, a user reward runs in
the caller's thread (tests, `rft` tools): a timeout is counted the same way, but its thread is
abandoned, still running (Python cannot kill a thread), and a crash takes the process down.
Built-in rewards always run in the caller's thread: they are trusted and take microseconds, but
for `code_tests`, which runs each sample's code in a sandbox process of its own, `workers` at a
time (its `score_samples`, which adds its `reward/sandbox/...` counts to the metrics), and for
`model`, which sends them to its reward service process (reward_model.py: `reward/model/...`).

The step fails, as a `RewardError` (a UserError) naming the reward, only when nothing could be
scored: a reward that raised on every sample (it is broken, not unlucky, and a step with nothing
scored cannot train), or, with `failed_reward` None, one that timed out or crashed on every
sample it did not raise on. With a `failed_reward`, timed-out and crashed samples are scored, so
they never fail the step.

    reward_fn = build_reward(cfg.taskset.reward)
    pool = UserCodePool(cfg.taskset.user_code.workers, name="explorer-0")   # one per explorer
    result = score_rollouts(reward_fn, [RolloutSample(prompt, response, task, "stop"), ...], pool, failed_reward)
    result.rewards, result.components, result.ok, result.metrics
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from rl_engine.errors import UserError
from rl_engine.registry import REWARDS, load_object
from rl_engine.rewards.isolation import UserCodeCrashed, UserCodePool, UserCodeTimeout
from rl_engine.rewards.tasks import Task

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
    `(prompt, response, task)` are called without it. Called directly (in the caller's thread)
    with `timeout_s`, each call runs in a daemon thread and one still running after `timeout_s`
    raises UserCodeTimeout, which `score_rollouts` counts as a timed-out sample; the stuck thread
    is abandoned, still running (Python cannot kill it), and a call stuck in C code that holds the
    GIL cannot be timed out this way at all. Give `score_rollouts` a UserCodePool to run it in
    worker processes instead, where a stuck call is killed (`call_in_worker`).
    """

    def __init__(
        self,
        spec: str,
        fn: Callable[..., Any],
        kwargs: dict[str, Any],
        timeout_s: float | None = None,
        batch: bool = False,
    ):
        self.spec, self.fn, self.kwargs, self.timeout_s, self.batch = spec, fn, dict(kwargs), timeout_s, batch
        self.pass_finish_reason = (
            _check_batch_signature(spec, fn, self.kwargs) if batch else _check_signature(spec, fn, self.kwargs)
        )

    def __call__(self, prompt: str, response: str, task: Task, finish_reason: str) -> float | dict[str, float]:
        kwargs = _call_kwargs(self.kwargs, self.pass_finish_reason, finish_reason)
        return self._bounded(lambda: self.fn(prompt, response, task, **kwargs))

    def score_batch(self, samples: list[RolloutSample]) -> list[tuple[float, dict[str, float]] | str]:
        """A batch reward's (reward, components), or the error message, of each sample, in order."""
        return self._bounded(lambda: _batch_outcomes(self.spec, self.fn(samples, **self.kwargs), len(samples)))

    def _bounded(self, fn: Callable[[], Any]) -> Any:
        if self.timeout_s is None:
            return fn()
        box: dict[str, Any] = {}
        done = threading.Event()

        def call() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread below
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=call, name=f"reward-{self.spec}", daemon=True).start()
        if not done.wait(self.timeout_s):
            raise UserCodeTimeout(
                f"{self.spec} ran past its timeout of {self.timeout_s:g} s (in-thread: the call is abandoned, still running)"
            )
        if "error" in box:
            raise box["error"]
        return box["value"]

    def __repr__(self) -> str:
        return f"PythonRewardFn({self.spec!r}, kwargs={self.kwargs!r})"


def _call_kwargs(kwargs: dict[str, Any], pass_finish_reason: bool, finish_reason: str) -> dict[str, Any]:
    return {"finish_reason": finish_reason, **kwargs} if pass_finish_reason else kwargs


_WORKER_FUNCTIONS: dict[str, Callable[..., Any]] = {}  # per worker process: spec -> imported function


def call_in_worker(
    spec: str,
    kwargs: dict[str, Any],
    pass_finish_reason: bool,
    prompt: str,
    response: str,
    task: Task,
    finish_reason: str,
) -> tuple[float, dict[str, float]]:
    """Runs in a UserCodePool worker: import `spec` (once per worker), call it as PythonRewardFn
    does, and return (reward, components), so only plain floats cross back."""
    fn = _WORKER_FUNCTIONS.get(spec)
    if fn is None:
        fn = _WORKER_FUNCTIONS[spec] = _import_function(spec)
    return _as_reward(fn(prompt, response, task, **_call_kwargs(kwargs, pass_finish_reason, finish_reason)))


def call_batch_in_worker(
    spec: str, kwargs: dict[str, Any], samples: list[RolloutSample]
) -> list[tuple[float, dict[str, float]] | str]:
    """Runs in a UserCodePool worker: a batch reward's outcome per sample (see `_batch_outcomes`)."""
    fn = _WORKER_FUNCTIONS.get(spec)
    if fn is None:
        fn = _WORKER_FUNCTIONS[spec] = _import_function(spec)
    return _batch_outcomes(spec, fn(samples, **kwargs), len(samples))


def _batch_outcomes(spec: str, values: Any, n: int) -> list[tuple[float, dict[str, float]] | str]:
    """(reward, components) per sample of a batch reward's return value, or the message of why a
    sample has none (None for it, or a value that is not a reward); all fail when the list is not
    one value per sample."""
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
        raise ValueError(
            f"the batch reward {spec!r} returned {got} for {n} samples; return one value (or None) per sample, in order"
        )
    out: list[tuple[float, dict[str, float]] | str] = []
    for v in values:
        if v is None:
            out.append("ValueError: the batch reward returned None for this sample (left out)")
            continue
        try:
            out.append(_as_reward(v))
        except ValueError as e:
            out.append(f"ValueError: {e}")
    return out


def _check_batch_signature(spec: str, fn: Callable[..., Any], kwargs: dict[str, Any]) -> bool:
    """False (a batch reward gets no finish_reason: each sample carries its own); UserError if
    `fn` cannot be called as fn(samples, **kwargs)."""
    try:
        inspect.signature(fn).bind([], **kwargs)
    except TypeError as e:
        raise UserError(
            f"taskset.reward.function = {spec!r} (batch: true): signature {inspect.signature(fn)} cannot be called as "
            f"(samples, **kwargs) with kwargs {sorted(kwargs)} ({e}); a batch reward takes the step's list of samples"
        ) from None
    except ValueError:
        pass  # no signature to read: called as it is
    return False


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
    fn = load_object(spec, "taskset.reward.function")
    if not callable(fn):
        raise UserError(f"taskset.reward.function = {spec!r}: it is a {type(fn).__name__}, not a function")
    return fn


def build_reward(cfg: Any) -> RewardFn:
    """The reward callable of a RewardConfig: a built-in's (a registered class, built with its
    variant's fields; trusted, run in the caller's thread) or a user's (`type: python` or a
    plugin's registered name: a PythonRewardFn, run in the user-code pool when there is one)."""
    if REWARDS.builtin(cfg.type):
        return REWARDS.get(cfg.type)(**cfg.model_dump(exclude={"type"}))
    spec = cfg.function if cfg.type == "python" else REWARDS.path(cfg.type)
    return PythonRewardFn(spec, _import_function(spec), cfg.kwargs, cfg.timeout_s, cfg.batch)


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


DEFAULT_TIMEOUT_S = 60.0  # a pooled PythonRewardFn built without one (the config's default)
_FAILURE_KINDS = {
    UserCodeTimeout: "timeouts",
    UserCodeCrashed: "crashes",
}  # exception -> metric; anything else: "errors"
_FAILURE_WORDS = {"errors": "raised", "timeouts": "timed out", "crashes": "crashed its worker"}


def score_rollouts(
    reward_fn: RewardFn,
    items: Iterable[Any],
    pool: UserCodePool | None = None,
    failed_reward: float | None = None,
    given: Sequence[Any] | None = None,
) -> ScoreResult:
    """Score each (prompt, response, task, finish_reason) sample, in input order; failures are
    isolated per sample, timed-out and crashed calls scored `failed_reward` or left out (see the
    module docstring). A PythonRewardFn runs in `pool` when one is given. `given[i]`, when not
    None, is sample i's reward already (a workflow's return value), checked like a reward's."""
    samples = [tuple(item) for item in items]
    given = list(given) if given is not None else [None] * len(samples)
    ask = [i for i, g in enumerate(given) if g is None]
    outcomes: list[Any] = [None if g is None else _outcome(lambda g=g: _as_reward(g)) for g in given]
    extra: dict[str, Any] = {}
    if hasattr(reward_fn, "score_samples") and ask:  # a built-in that scores them together (code_tests: in parallel)
        asked, extra = reward_fn.score_samples([RolloutSample(*samples[i]) for i in ask])
    elif getattr(reward_fn, "batch", False) and ask:
        asked = _batch_in(reward_fn, [RolloutSample(*samples[i]) for i in ask], pool)
    elif pool is not None and isinstance(reward_fn, PythonRewardFn):
        asked = _outcomes_in_pool(reward_fn, [samples[i] for i in ask], pool)
    else:
        asked = [_outcome(lambda s=samples[i]: _as_reward(reward_fn(*s))) for i in ask]
    for i, outcome in zip(ask, asked):
        outcomes[i] = outcome
    tally = _Tally()
    for (_, _, task, _), outcome in zip(samples, outcomes):
        tally.add(reward_fn, task, outcome, failed_reward)
    tally.check(reward_fn)
    return ScoreResult(tally.rewards, tally.components, tally.errors, {**_metrics(tally), **extra})


def _outcome(call: Callable[[], tuple[float, dict[str, float]]]) -> tuple[float, dict[str, float]] | Exception:
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - a reward failing on some samples must not kill the run
        return e


def _outcomes_in_pool(reward_fn: PythonRewardFn, samples: list[tuple], pool: UserCodePool) -> list[Any]:
    """Every sample submitted at once (they run `pool.workers` at a time), each waited for in turn."""
    timeout_s = reward_fn.timeout_s or DEFAULT_TIMEOUT_S
    args = (reward_fn.spec, reward_fn.kwargs, reward_fn.pass_finish_reason)
    label = f"taskset.reward.function = {reward_fn.spec!r}"
    calls = [pool.submit(call_in_worker, *args, *s, timeout_s=timeout_s, label=label) for s in samples]
    return [_outcome(lambda c=c: pool.wait(c)) for c in calls]


def _batch_in(reward_fn: PythonRewardFn, samples: list[RolloutSample], pool: UserCodePool | None) -> list[Any]:
    """A batch reward's outcome per sample: one call (in `pool` when given); a call that fails
    (raises, times out, crashes) fails every sample of it the same way."""
    if pool is not None:
        timeout_s = reward_fn.timeout_s or DEFAULT_TIMEOUT_S
        label = f"taskset.reward.function = {reward_fn.spec!r}"
        call = pool.submit(
            call_batch_in_worker, reward_fn.spec, reward_fn.kwargs, samples, timeout_s=timeout_s, label=label
        )
        result = _outcome(lambda: pool.wait(call))
    else:
        result = _outcome(lambda: reward_fn.score_batch(samples))
    if isinstance(result, Exception):
        return [result] * len(samples)
    return [ValueError(r.removeprefix("ValueError: ")) if isinstance(r, str) else r for r in result]


@dataclass
class _Tally:
    """Per-sample results and failure counts, built one sample at a time."""

    rewards: list[float | None] = field(default_factory=list)
    components: list[dict[str, float]] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)  # every failure's, for reward/error_messages
    counts: dict[str, int] = field(default_factory=lambda: {"errors": 0, "timeouts": 0, "crashes": 0})
    first: tuple[Any, str] | None = None  # (task, message) of the first failure

    def add(self, reward_fn: Any, task: Any, outcome: Any, failed_reward: float | None) -> None:
        if not isinstance(outcome, Exception):
            self._append(*outcome, None)
            return
        kind = next((k for cls, k in _FAILURE_KINDS.items() if isinstance(outcome, cls)), "errors")
        msg = f"{type(outcome).__name__}: {outcome}"
        self.counts[kind] += 1
        self.messages.append(msg)
        self.first = self.first or (task, msg)
        scored = kind != "errors" and failed_reward is not None
        log.warning(
            "reward %s %s on task %s: %s%s",
            _describe(reward_fn),
            _FAILURE_WORDS[kind],
            getattr(task, "task_id", "?"),
            msg,
            f" (scored {failed_reward:g})" if scored else " (sample left out)",
        )
        if scored:
            self._append(float(failed_reward), {"failed": float(failed_reward)}, None)
        else:
            self._append(None, {}, msg)

    def _append(self, reward: float | None, comps: dict[str, float], error: str | None) -> None:
        self.rewards.append(reward)
        self.components.append(comps)
        self.errors.append(error)

    def check(self, reward_fn: Any) -> None:
        """RewardError when nothing was scored (see the module docstring)."""
        if not self.errors or any(e is None for e in self.errors):
            return
        task, msg = self.first
        tid, n = getattr(task, "task_id", "?"), len(self.errors)
        if self.counts["errors"] == n:
            raise RewardError(
                f"the reward {_describe(reward_fn)} failed on all {n} samples of this step, e.g. on task {tid!r}: {msg}; fix the reward: "
                "it must return a finite float or a dict of str -> float for every response (a sample it fails on now and then is left out and counted as reward/errors)"
            )
        timeout_s = getattr(reward_fn, "timeout_s", None) or DEFAULT_TIMEOUT_S
        raise RewardError(
            f"{_describe(reward_fn)} did not return within taskset.reward.timeout_s = {timeout_s:g} s (task {tid!r}), or its worker died: "
            f"none of the {n} samples of this step was scored ({self.counts['timeouts']} timed out, {self.counts['crashes']} crashed their worker, "
            f"{self.counts['errors']} raised; first: {msg}); make it return faster (no network waits or unbounded loops) or raise taskset.reward.timeout_s, "
            "or set taskset.user_code.failed_reward to score such samples instead of leaving them out"
        )


def _describe(reward_fn: Any) -> str:
    # A built-in that names itself (the model reward, the judge: its service and field).
    if described := getattr(reward_fn, "describe", None):
        return str(described)
    spec = getattr(reward_fn, "spec", None)
    return f"taskset.reward.function = {spec!r}" if spec else type(reward_fn).__name__


def _metrics(tally: _Tally) -> dict[str, Any]:
    scored = [r for r in tally.rewards if r is not None]
    out: dict[str, Any] = {
        "reward/count": len(scored),
        **{f"reward/{kind}": n for kind, n in tally.counts.items()},
        "reward/mean": math.fsum(scored) / len(scored) if scored else float("nan"),
    }
    names = sorted({k for c in tally.components for k in c})
    for name in names:
        vals = [c.get(name, 0.0) for c, r in zip(tally.components, tally.rewards) if r is not None]
        out[f"reward/{name}/mean"] = math.fsum(vals) / len(vals)
    # Distinct messages only: one broken reward usually fails every sample the same way.
    out["reward/error_messages"] = list(dict.fromkeys(tally.messages))[:MAX_ERROR_MESSAGES]
    return out
