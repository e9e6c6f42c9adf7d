"""The demo's verifiable task: small additions like "12+7=" -> "19", and its reward.

The task is sized for the ~0.3M-parameter byte-level tiny model: operands 0..20 by default
(441 distinct problems, answers of one or two digits), so a few minutes of SFT teach it
partly and RL has room to improve the rest. A task row is JSON:

    {"id": "add-s0-000000", "question": "12+7=", "answer": "19"}

(`question` / `answer` are TasksetConfig's default prompt_key / answer_key.) The reward is
`correct_weight` for an exactly correct answer plus `format_weight` when the response is only
digits and ended by a stop (finish_reason == "stop"), returned as named components.

    rft make-tasks runs/data/arithmetic.jsonl --n 2000 --seed 0
    python -m rl_engine.demos.arithmetic OUT.jsonl --n 2000 --seed 0 [--max-operand 20]
"""

from __future__ import annotations

import random
import re
from typing import TYPE_CHECKING, Any

from rl_engine.errors import UserError

if TYPE_CHECKING:
    from rl_engine.rewards.tasks import Task

DEFAULT_MAX_OPERAND = 20
_DIGITS = re.compile(r"[0-9]+")


def make_arithmetic_tasks(n: int, seed: int = 0, max_operand: int = DEFAULT_MAX_OPERAND) -> list[dict[str, str]]:
    """`n` addition tasks `a+b=` with a, b uniform in [0, max_operand]; same (n, seed) -> same rows."""
    if n < 1:
        raise UserError(f"make-tasks: --n must be >= 1, got {n}")
    if max_operand < 0:
        raise UserError(f"make-tasks: --max-operand must be >= 0, got {max_operand}")
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append({"id": f"add-s{seed}-{i:06d}", "question": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def write_arithmetic_taskset(
    path_or_url: str,
    n: int,
    seed: int = 0,
    max_operand: int = DEFAULT_MAX_OPERAND,
    storage_options: dict[str, Any] | None = None,
) -> str:
    """Write `make_arithmetic_tasks(n, seed)` as JSONL to a local path or fsspec URL; returns the path."""
    from rl_engine.rewards.tasks import write_taskset

    return write_taskset(path_or_url, make_arithmetic_tasks(n, seed, max_operand), storage_options)


class ArithmeticRewardFn:
    """Reward of the demo task: {"correct": correct_weight or 0, "format": format_weight or 0}."""

    def __init__(self, correct_weight: float = 1.0, format_weight: float = 0.1):
        self.correct_weight = correct_weight
        self.format_weight = format_weight

    def __call__(self, prompt: str, response: str, task: Task, finish_reason: str) -> dict[str, float]:
        if task.answer is None:
            raise ValueError(f"task {task.task_id!r} has no answer; the arithmetic reward needs one")
        correct = response.strip() == task.answer.strip()
        # Well-formed = nothing but the number, and the model chose to stop (not cut by length
        # or a repetition detector); whitespace counts against it so the model learns to stop.
        well_formed = finish_reason == "stop" and _DIGITS.fullmatch(response) is not None
        return {
            "correct": self.correct_weight if correct else 0.0,
            "format": self.format_weight if well_formed else 0.0,
        }
