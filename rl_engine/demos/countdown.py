"""The long-tail demo task: count down from n to 1, "13..1=" -> "13 12 11 10 9 8 7 6 5 4 3 2 1".

Answer lengths are long-tailed because n is: P(n) is proportional to n^-alpha on 1..max_n (a
truncated discrete Pareto / Zipf law, drawn exactly by `random.choices` with those weights).
With the defaults (alpha 1, max_n 40) 68% of tasks have n <= 10 (answers of at most 20
characters) and 12% answers longer than 64; the longest, n = 40, is 110 characters, so 111
tokens with EOS for the byte-level tiny model (one token per character). That is the workload
partial rollouts are for: without them an explorer step lasts as long as its longest sample.

Why a countdown rather than "repeat this character n times": a correct "xxxx..." answer is
itself a loop by the repetition detector's rule (the last 1..repeat_ngram tokens repeated
repeat_threshold times), so every long correct answer would be stopped as `repeat`. No pattern
repeats three times in a row in a countdown ("11" repeats one token twice), so any
repeat_threshold >= 3 leaves correct answers alone and still stops a degenerate loop.

A task row is JSON (`question` / `answer` are TasksetConfig's default keys):

    {"id": "cd-s0-000000", "question": "13..1=", "answer": "13 12 11 10 9 8 7 6 5 4 3 2 1"}

The reward has two named components: `correct` (correct_weight when the response is exactly the
answer and the model stopped: finish_reason "stop") and `close` (close_weight x the fraction of
the answer's numbers written correctly from the start, over the longer of the answer and the
response: it credits progress, penalizes overshoot, and gives GRPO signal when no sample of a
group is exact). Both depend only on (response, answer, finish_reason): deterministic.

    rft make-tasks runs/data/countdown-train.jsonl --task countdown --n 2000 --seed 0
    python -m rl_engine.demos.countdown OUT.jsonl --n 2000 --seed 0 [--max-n 40] [--alpha 1.0]
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from rl_engine.errors import UserError

if TYPE_CHECKING:
    from rl_engine.rewards.tasks import Task

DEFAULT_MAX_N = 40
DEFAULT_ALPHA = 1.0


def countdown_answer(n: int) -> str:
    """ "n n-1 ... 1", single spaces."""
    return " ".join(str(k) for k in range(n, 0, -1))


def countdown_problem(n: int) -> dict[str, str]:
    return {"question": f"{n}..1=", "answer": countdown_answer(n)}


def countdown_weights(max_n: int = DEFAULT_MAX_N, alpha: float = DEFAULT_ALPHA) -> list[float]:
    """P(n) for n = 1..max_n: proportional to n^-alpha, summing to 1."""
    if max_n < 1:
        raise UserError(f"countdown: --max-n must be >= 1, got {max_n}")
    if alpha < 0:
        raise UserError(f"countdown: --alpha must be >= 0 (0 is uniform), got {alpha}")
    w = [k**-alpha for k in range(1, max_n + 1)]
    total = sum(w)
    return [x / total for x in w]


def make_countdown_tasks(
    n: int, seed: int = 0, max_n: int = DEFAULT_MAX_N, alpha: float = DEFAULT_ALPHA
) -> list[dict[str, str]]:
    """`n` countdown tasks with start values drawn from `countdown_weights`; same args -> same rows."""
    if n < 1:
        raise UserError(f"make-tasks: --n must be >= 1, got {n}")
    weights = countdown_weights(max_n, alpha)
    starts = random.Random(seed).choices(range(1, max_n + 1), weights=weights, k=n)
    return [{"id": f"cd-s{seed}-{i:06d}", **countdown_problem(k)} for i, k in enumerate(starts)]


def write_countdown_taskset(
    path_or_url: str,
    n: int,
    seed: int = 0,
    max_n: int = DEFAULT_MAX_N,
    alpha: float = DEFAULT_ALPHA,
    storage_options: dict[str, Any] | None = None,
) -> str:
    """Write `make_countdown_tasks(...)` as JSONL to a local path or fsspec URL; returns the path."""
    from rl_engine.rewards.tasks import write_taskset

    return write_taskset(path_or_url, make_countdown_tasks(n, seed, max_n, alpha), storage_options)


class CountdownRewardFn:
    """Reward of the countdown task: {"correct": correct_weight or 0, "close": close_weight x progress}."""

    def __init__(self, correct_weight: float = 1.0, close_weight: float = 0.5):
        self.correct_weight = correct_weight
        self.close_weight = close_weight

    def __call__(self, prompt: str, response: str, task: Task, finish_reason: str) -> dict[str, float]:
        if task.answer is None:
            raise ValueError(f"task {task.task_id!r} has no answer; the countdown reward needs one")
        want, got = task.answer.split(" "), response.split(" ")
        right = 0
        for w, g in zip(want, got):
            if w != g:
                break
            right += 1
        return {
            "correct": self.correct_weight if finish_reason == "stop" and response == task.answer else 0.0,
            "close": self.close_weight * right / max(len(want), len(got)),
        }
