"""Task sets and reward functions (see tasks.py, scoring.py, and isolation.py for the worker
processes that run user code); the demo tasks and their rewards live in rl_engine/demos/."""

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
    "score_rollouts",
    "write_taskset",
]
