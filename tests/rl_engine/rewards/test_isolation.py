"""User code in worker processes (rl_engine/rewards/isolation.py): a reward that hangs, crashes or
raises is scored as configured within its timeout, the run goes on and the worker is replaced.

Test rewards live in user_rewards.py, importable by the spawned workers. Every wait is bounded:
timeouts here are about a second, and the pool's own waits end at each call's deadline.
"""

from __future__ import annotations

import itertools
import os
import time

import pytest
import user_rewards

from rl_engine.errors import UserError
from rl_engine.rewards import (
    PythonRewardFn,
    RewardError,
    RolloutSample,
    Task,
    UserCodeCrashed,
    UserCodePool,
    UserCodeTimeout,
    score_rollouts,
)
from rl_engine.rewards.isolation import CLOSE_WAIT_S

SPEC = f"{user_rewards.__name__}:by_response"
KILL_S = 3.5  # pebble SIGTERMs a timed-out worker (SIGKILL after 3 s; a sleeping one exits at once)


@pytest.fixture
def pool():
    p = UserCodePool(workers=1, name="test")
    yield p
    p.close()


def _reward(timeout_s: float = 1.0) -> PythonRewardFn:
    return PythonRewardFn(SPEC, user_rewards.by_response, {}, timeout_s)


def _samples(*responses: str) -> list[RolloutSample]:
    return [RolloutSample("p", r, Task(f"t{i}", "p", None), "stop") for i, r in enumerate(responses)]


def _pid(pool: UserCodePool) -> float:
    return score_rollouts(_reward(), _samples("pid"), pool).components[0]["pid"]


def test_a_reward_that_sleeps_forever_scores_failed_reward_and_its_worker_is_replaced(pool):
    before = _pid(pool)
    start = time.monotonic()
    result = score_rollouts(_reward(timeout_s=0.5), _samples("ab", "sleep", "abc"), pool, failed_reward=0.0)
    assert time.monotonic() - start < 0.5 + KILL_S
    assert result.rewards == [2.0, 0.0, 3.0] and result.ok == [True, True, True]
    assert result.components[1] == {"failed": 0.0}
    m = result.metrics
    assert (m["reward/timeouts"], m["reward/crashes"], m["reward/errors"], m["reward/count"]) == (1, 0, 0, 3)
    assert "ran past its timeout of 0.5 s" in m["reward/error_messages"][0] and SPEC in m["reward/error_messages"][0]
    assert _pid(pool) != before  # the killed worker was replaced; the pool goes on


@pytest.mark.parametrize("response, reason", [("segv", "killed by SIGSEGV"), ("exit", "exit code 3")])
def test_a_reward_that_kills_its_worker_is_a_crash(pool, response, reason):
    before = _pid(pool)
    result = score_rollouts(_reward(), _samples("ab", response, "abc"), pool)
    assert result.ok == [True, False, True] and result.rewards == [2.0, None, 3.0]
    assert reason in result.errors[1] and "UserCodeCrashed" in result.errors[1]
    m = result.metrics
    assert (m["reward/crashes"], m["reward/timeouts"], m["reward/errors"], m["reward/count"]) == (1, 0, 0, 2)
    assert _pid(pool) != before


def test_a_raising_reward_in_the_pool_is_a_sample_error(pool):
    result = score_rollouts(
        _reward(), _samples("ab", "raise"), pool, failed_reward=0.0
    )  # failed_reward is for timeouts and crashes only
    assert result.ok == [True, False]
    assert result.errors[1] == "ValueError: cannot parse 'raise'"
    assert (result.metrics["reward/errors"], result.metrics["reward/timeouts"], result.metrics["reward/crashes"]) == (
        1,
        0,
        0,
    )
    with pytest.raises(RewardError, match=r"failed on all 2 samples of this step.*ValueError: cannot parse"):
        score_rollouts(_reward(), _samples("raise", "raise"), pool)


def test_every_sample_timing_out_fails_the_step_unless_failed_reward_scores_them():
    with UserCodePool(workers=2, name="test") as pool:
        with pytest.raises(
            RewardError,
            match=r"did not return within taskset\.reward\.timeout_s = 0\.5 s \(task 't0'\).*2 timed out.*taskset\.user_code\.failed_reward",
        ):
            score_rollouts(_reward(timeout_s=0.5), _samples("sleep", "sleep"), pool)
        result = score_rollouts(_reward(timeout_s=0.5), _samples("sleep", "sleep"), pool, failed_reward=-1.0)
        assert result.rewards == [-1.0, -1.0] and result.metrics["reward/timeouts"] == 2
        with pytest.raises(RewardError, match=r"1 timed out, 1 crashed their worker, 0 raised"):
            score_rollouts(_reward(timeout_s=0.5), _samples("sleep", "exit"), pool)


def test_results_are_in_input_order_when_calls_finish_out_of_order():
    with UserCodePool(workers=3, name="test") as pool:
        start = time.monotonic()
        result = score_rollouts(_reward(), _samples("slow:0.6", "slow:0.3", "slow:0"), pool)
        assert result.rewards == [0.6, 0.3, 0.0]
        assert (
            time.monotonic() - start < 1.2 + 1.0
        )  # in parallel (plus spawning three workers), not 0.9 s in a row after spawning


def test_close_is_quick_with_a_call_stuck_in_a_worker():
    pool = UserCodePool(workers=1, name="test")
    call = pool.submit(user_rewards.sleep_forever, timeout_s=60)
    _until(call.inner.running)
    start = time.monotonic()
    pool.close()
    assert time.monotonic() - start < CLOSE_WAIT_S + 0.5
    assert call.cancelled()
    pool.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(os.getpid, timeout_s=1)


def test_pool_call_maps_errors_and_keeps_the_functions_own(pool):
    assert pool.call(os.getpid, timeout_s=5) != os.getpid()
    with pytest.raises(KeyError, match="mine") as e:
        pool.call(user_rewards.fail, "mine", timeout_s=5)
    assert "user_rewards.py" in str(e.value.__cause__)  # the worker's traceback
    with pytest.raises(
        UserCodeTimeout, match=r"sleep_forever ran past its timeout of 0\.3 s; its worker was killed and replaced"
    ):
        pool.call(user_rewards.sleep_forever, timeout_s=0.3)
    with pytest.raises(UserCodeCrashed, match=r"by_response: its worker process \d+ died \(exit code 3\)"):
        pool.call(user_rewards.by_response, "p", "exit", None, "stop", timeout_s=5)


def test_queued_calls_get_later_deadlines():
    """A call waits for a free worker before its timeout starts; its deadline allows for the calls ahead."""
    pool = UserCodePool(workers=1, name="test", grace_s=1.0)
    try:
        calls = [pool.submit(user_rewards.by_response, "p", "slow:0", None, "stop", timeout_s=2.0) for _ in range(3)]
        gaps = [b.deadline - a.deadline for a, b in itertools.pairwise(calls)]
        assert gaps == pytest.approx([3.0, 3.0], abs=0.2)
        assert [pool.wait(c) for c in calls] == [0.0, 0.0, 0.0]
    finally:
        pool.close()


def test_in_thread_timeout_is_counted_the_same_way():
    """No pool (unit tests, rft tools): the call is abandoned in its thread, the sample scored as configured."""
    start = time.monotonic()
    result = score_rollouts(_reward(timeout_s=0.2), _samples("ab", "sleep"), failed_reward=0.5)
    assert time.monotonic() - start < 1.0
    assert result.rewards == [2.0, 0.5] and result.metrics["reward/timeouts"] == 1


def test_a_reward_module_the_workers_cannot_import_is_a_sample_error(pool):
    fn = _reward()
    fn.spec = "no_such_rewards_xyz:f"  # imported in the parent, gone in the worker
    with pytest.raises(
        RewardError, match=r"failed on all 1 samples.*UserError: .*cannot import module 'no_such_rewards_xyz'"
    ):
        score_rollouts(fn, _samples("ab"), pool)
    assert issubclass(RewardError, UserError)


def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{predicate} still false after {timeout_s} s"
        time.sleep(0.02)
