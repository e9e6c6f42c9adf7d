"""Task sets and reward functions (see tasks.py, scoring.py, arithmetic.py for the demo task,
countdown.py for the long-tail task of partial rollouts, and isolation.py for the worker
processes that run user code)."""

from rl_engine.rewards.arithmetic import ArithmeticRewardFn, make_arithmetic_tasks, write_arithmetic_taskset
from rl_engine.rewards.countdown import CountdownRewardFn, make_countdown_tasks, write_countdown_taskset
from rl_engine.rewards.isolation import UserCodeCrashed, UserCodePool, UserCodeTimeout
from rl_engine.rewards.scoring import (
    PythonRewardFn,
    RewardError,
    RewardFn,
    RolloutSample,
    ScoreResult,
    build_reward,
    score_rollouts,
)
from rl_engine.rewards.tasks import Task, TaskIterator, encode_task, format_prompt, load_taskset, write_taskset

__all__ = [
    "ArithmeticRewardFn",
    "CountdownRewardFn",
    "PythonRewardFn",
    "RewardError",
    "RewardFn",
    "RolloutSample",
    "ScoreResult",
    "Task",
    "TaskIterator",
    "UserCodeCrashed",
    "UserCodePool",
    "UserCodeTimeout",
    "build_reward",
    "encode_task",
    "format_prompt",
    "load_taskset",
    "make_arithmetic_tasks",
    "make_countdown_tasks",
    "score_rollouts",
    "write_arithmetic_taskset",
    "write_countdown_taskset",
    "write_taskset",
]
