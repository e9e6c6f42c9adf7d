"""Task sets and reward functions (see tasks.py, scoring.py, and arithmetic.py for the demo task)."""

from rl_engine.rewards.arithmetic import ArithmeticRewardFn, make_arithmetic_tasks, write_arithmetic_taskset
from rl_engine.rewards.scoring import PythonRewardFn, RewardFn, RolloutSample, ScoreResult, build_reward, score_rollouts
from rl_engine.rewards.tasks import Task, TaskIterator, format_prompt, load_taskset

__all__ = [
    "ArithmeticRewardFn",
    "PythonRewardFn",
    "RewardFn",
    "RolloutSample",
    "ScoreResult",
    "Task",
    "TaskIterator",
    "build_reward",
    "format_prompt",
    "load_taskset",
    "make_arithmetic_tasks",
    "score_rollouts",
    "write_arithmetic_taskset",
]
