"""Scoring: per-sample failure isolation, component sums, user rewards imported from `module:function`."""

from __future__ import annotations

import textwrap

import pytest

from rl_engine.config import PythonReward
from rl_engine.demos.arithmetic import ArithmeticRewardFn
from rl_engine.errors import UserError
from rl_engine.rewards import PythonRewardFn, RewardError, RolloutSample, Task, build_reward, score_rollouts


def _sample(response, answer="19", finish="stop", tid="t"):
    return RolloutSample("12+7=", response, Task(task_id=tid, prompt="12+7=", answer=answer), finish)


def test_dict_components_sum_to_the_reward():
    result = score_rollouts(
        ArithmeticRewardFn(1.0, 0.25), [_sample("19"), _sample("18"), _sample("19", finish="length")]
    )
    assert result.rewards == [1.25, 0.25, 1.0]
    assert result.components == [
        {"correct": 1.0, "format": 0.25},
        {"correct": 0.0, "format": 0.25},
        {"correct": 1.0, "format": 0.0},
    ]
    assert result.ok == [True, True, True]
    assert result.metrics["reward/mean"] == pytest.approx(2.5 / 3)
    assert result.metrics["reward/correct/mean"] == pytest.approx(2 / 3)
    assert result.metrics["reward/format/mean"] == pytest.approx(0.5 / 3)
    assert result.metrics["reward/errors"] == 0 and result.metrics["reward/error_messages"] == []


def test_raising_reward_marks_only_that_sample():
    def flaky(prompt, response, task, finish_reason):
        if response == "boom":
            raise RuntimeError(f"cannot parse {response!r}")
        return float(len(response))

    samples = [_sample("ab"), _sample("boom", tid="bad"), _sample("abc"), _sample("boom", tid="bad2")]
    result = score_rollouts(flaky, samples)
    assert result.ok == [True, False, True, False]
    assert result.rewards == [2.0, None, 3.0, None]
    assert result.components[1] == {}
    assert result.errors[1] == "RuntimeError: cannot parse 'boom'"
    assert result.metrics["reward/errors"] == 2
    assert result.metrics["reward/count"] == 2
    assert result.metrics["reward/mean"] == 2.5  # failed samples excluded, not counted as 0
    assert result.metrics["reward/error_messages"] == ["RuntimeError: cannot parse 'boom'"]  # deduplicated


@pytest.mark.parametrize("bad", [float("nan"), "1.0", None, {"a": "x"}, {"a": float("inf")}, True])
def test_unusable_return_values_are_sample_errors(bad):
    result = score_rollouts(lambda p, r, t, f: bad if r == "19" else 0.5, [_sample("19"), _sample("18"), _sample("19")])
    assert result.ok == [False, True, False]
    assert result.metrics["reward/errors"] == 2
    assert result.metrics["reward/mean"] == 0.5
    # Unusable on every sample: the reward is broken, and the step fails naming it.
    with pytest.raises(RewardError, match=r"failed on all 2 samples of this step.*fix the reward"):
        score_rollouts(lambda p, r, t, f: bad, [_sample("19"), _sample("19")])


def test_float_int_and_numpy_rewards():
    import numpy as np

    result = score_rollouts(
        lambda p, r, t, f: 1 if f == "stop" else np.float32(0.5), [_sample("x"), _sample("x", finish="length")]
    )
    assert result.rewards == [1.0, 0.5] and result.components == [{}, {}]
    assert all(type(r) is float for r in result.rewards)  # plain floats, ready for Arrow/JSON


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            def three_args(prompt, response, task, bonus=0.0):
                return {"len": float(len(response)), "bonus": bonus}

            def four_args(prompt, response, task, finish_reason, scale=1.0):
                return scale * (finish_reason == "stop")

            def wrong(prompt):
                return 0.0

            NOT_CALLABLE = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards"


def test_python_reward_three_and_four_arguments(user_module):
    fn = build_reward(PythonReward(type="python", function=f"{user_module}:three_args", kwargs={"bonus": 0.5}))
    assert isinstance(fn, PythonRewardFn)
    assert fn("p", "abcd", _sample("").task, "length") == {"len": 4.0, "bonus": 0.5}
    assert score_rollouts(fn, [_sample("abcd")]).rewards == [4.5]
    fn4 = build_reward(PythonReward(type="python", function=f"{user_module}:four_args", kwargs={"scale": 2.0}))
    assert score_rollouts(fn4, [_sample("x"), _sample("x", finish="length")]).rewards == [2.0, 0.0]


@pytest.mark.parametrize(
    "function, kwargs, message",
    [
        ("no_such_module_xyz:f", {}, r"cannot import module 'no_such_module_xyz'"),
        ("my_rewards:missing", {}, r"has no attribute 'missing'"),
        ("my_rewards:NOT_CALLABLE", {}, r"not a function"),
        ("my_rewards:wrong", {}, r"cannot be called as \(prompt, response, task"),
        ("my_rewards:three_args", {"nope": 1}, r"kwargs \['nope'\]"),
    ],
)
def test_python_reward_errors_are_user_errors(user_module, function, kwargs, message):
    with pytest.raises(UserError, match=message) as e:
        build_reward(PythonReward(type="python", function=function, kwargs=kwargs))
    assert function in str(e.value)


def test_python_reward_module_failing_at_import(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards.py").write_text("raise RuntimeError('needs a GPU')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match="RuntimeError: needs a GPU"):
        build_reward(PythonReward(type="python", function="broken_rewards:f"))
