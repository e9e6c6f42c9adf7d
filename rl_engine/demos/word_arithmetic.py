"""The real model's task: additions asked in words, through the chat template, scored on the final answer.

For an instruct model (SmolLM2-135M-Instruct, `rft fetch-model`): "What is 27 + 14? Reply with
only the number." The model answers in its own way ("27 + 14 = 41", or the bare number, or a
paragraph that runs out of tokens), so the reward parses the *final answer*: the last number of
a response the model ended itself. Exact, no partial credit for the number:

    final_answer  correct_weight  when the response ended with a stop (EOS, not cut by the token
                                  budget or a repetition) and its last number equals the answer
    format        format_weight   when it ended with a stop and holds a number at all

Held out: the problems (a, b) with operands in 1..max_operand are split by a fixed hash into a
train part and a held-out fifth; `make_word_arithmetic_tasks(split="heldout")` writes the held-out
problems (all of them, in a seeded order) and no train task ever asks one of them.

    rft make-tasks runs/data/words-train.jsonl --task word-arithmetic --n 4000 --seed 0
    rft make-tasks runs/data/words-heldout.jsonl --task word-arithmetic --split heldout
"""

from __future__ import annotations

import random
import re
from typing import TYPE_CHECKING

from rl_engine.errors import UserError

if TYPE_CHECKING:
    from rl_engine.rewards.tasks import Task

DEFAULT_MAX_OPERAND = 40
QUESTION = "What is {a} + {b}? Reply with only the number."
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def is_heldout(a: int, b: int) -> bool:
    """The fixed train / held-out split of the problem space (a fifth held out)."""
    return (a * 7919 + b * 104_729) % 5 == 0


def _problems(max_operand: int, split: str) -> list[tuple[int, int]]:
    want = split == "heldout"
    return [(a, b) for a in range(1, max_operand + 1) for b in range(1, max_operand + 1) if is_heldout(a, b) == want]


def make_word_arithmetic_tasks(
    n: int | None = None, seed: int = 0, max_operand: int = DEFAULT_MAX_OPERAND, split: str = "train"
) -> list[dict[str, str]]:
    """Rows {id, question, answer}: `n` train problems drawn with replacement (seeded), or with
    `split="heldout"` the held-out problems, each once, in a seeded order (`n` caps how many)."""
    if split not in ("train", "heldout"):
        raise UserError(f"make-tasks: --split {split!r}: use train or heldout")
    if max_operand < 2:
        raise UserError(f"make-tasks: --max-operand must be >= 2, got {max_operand}")
    if n is not None and n < 1:
        raise UserError(f"make-tasks: --n must be >= 1, got {n}")
    pool, rng = _problems(max_operand, split), random.Random(seed)
    if split == "heldout":
        rng.shuffle(pool)
        picked = pool[:n] if n is not None else pool
    else:
        picked = [rng.choice(pool) for _ in range(n or len(pool))]
    return [
        {"id": f"words-{split}-s{seed}-{i:06d}", "question": QUESTION.format(a=a, b=b), "answer": str(a + b)}
        for i, (a, b) in enumerate(picked)
    ]


def final_number(response: str) -> str | None:
    """The last number in `response` (the model's final answer), or None."""
    found = _NUMBER.findall(response)
    return found[-1] if found else None


class FinalAnswerRewardFn:
    """{"final_answer": correct_weight or 0, "format": format_weight or 0}; see the module docstring."""

    def __init__(self, correct_weight: float = 1.0, format_weight: float = 0.1):
        self.correct_weight = correct_weight
        self.format_weight = format_weight

    def __call__(self, prompt: str, response: str, task: Task, finish_reason: str) -> dict[str, float]:
        if task.answer is None:
            raise ValueError(f"task {task.task_id!r} has no answer; the final-answer reward needs one")
        final = final_number(response) if finish_reason == "stop" else None
        return {
            "final_answer": self.correct_weight if final is not None and final == task.answer.strip() else 0.0,
            "format": self.format_weight if final is not None else 0.0,
        }
