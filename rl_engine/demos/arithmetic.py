"""The demo's verifiable task: small additions like "12+7=" -> "19", and its reward.

The task is sized for the ~0.3M-parameter byte-level tiny model: operands 0..20 by default
(441 distinct problems, answers of one or two digits), so a few minutes of SFT teach it
partly and RL has room to improve the rest. A task row is JSON:

    {"id": "add-s0-000000", "question": "12+7=", "answer": "19"}

(`question` / `answer` are TasksetConfig's default prompt_key / answer_key). One unordered pair in
HELDOUT_EVERY is held out (`is_heldout`, a hash: 12+7 and 7+12 alike): `split="train"` draws only
the others, `split="heldout"` writes each held-out problem once, so a demo scores problems it never
trained on (`rft demo`'s last line; its SFT warm start draws the train split too). The reward is
`correct_weight` for an exactly correct answer plus `format_weight` when the response is only
digits and ended by a stop (finish_reason == "stop"), returned as named components.

    rft make-tasks runs/data/arithmetic.jsonl --n 2000 --seed 0
    rft make-tasks runs/data/arith-heldout.jsonl --split heldout     # the held-out problems, each once
    python -m rl_engine.demos.arithmetic OUT.jsonl --n 2000 --seed 0 [--max-operand 20]
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import TYPE_CHECKING, Any

from rl_engine.errors import UserError

if TYPE_CHECKING:
    from rl_engine.rewards.tasks import Task

DEFAULT_MAX_OPERAND = 20
HELDOUT_EVERY = 7  # about one unordered pair in 7 held out: 57 of the 441 problems of operands 0..20
SPLITS = ("all", "train", "heldout")
_DIGITS = re.compile(r"[0-9]+")


def is_heldout(a: int, b: int) -> bool:
    """The fixed train / held-out split: a hash of the unordered pair, one pair in HELDOUT_EVERY."""
    lo, hi = sorted((a, b))
    digest = hashlib.blake2b(f"{lo}+{hi}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % HELDOUT_EVERY == 0


def arithmetic_pairs(split: str = "all", max_operand: int = DEFAULT_MAX_OPERAND) -> list[tuple[int, int]]:
    """Every (a, b) of `split` ("all", "train" or "heldout"), in a fixed order."""
    if split not in SPLITS:
        raise UserError(f"make-tasks: --split {split!r}: use all, train or heldout")
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    return pairs if split == "all" else [p for p in pairs if is_heldout(*p) == (split == "heldout")]


def make_arithmetic_tasks(
    n: int | None, seed: int = 0, max_operand: int = DEFAULT_MAX_OPERAND, split: str = "all"
) -> list[dict[str, str]]:
    """`n` addition tasks `a+b=`, a and b in [0, max_operand]: uniform (`all`), or drawn from the
    train problems (`train`); with `split="heldout"` the held-out problems, each once, in a seeded
    order (`n` caps how many). Same arguments, same rows."""
    if n is not None and n < 1:
        raise UserError(f"make-tasks: --n must be >= 1, got {n}")
    if max_operand < 0:
        raise UserError(f"make-tasks: --max-operand must be >= 0, got {max_operand}")
    rng = random.Random(seed)
    if split == "all":  # two draws per task: the rows every earlier task set of a seed had
        picked = [(rng.randint(0, max_operand), rng.randint(0, max_operand)) for _ in range(n or 2000)]
        return [
            {"id": f"add-s{seed}-{i:06d}", "question": f"{a}+{b}=", "answer": str(a + b)}
            for i, (a, b) in enumerate(picked)
        ]
    pool = arithmetic_pairs(split, max_operand)
    if not pool:
        raise UserError(f"make-tasks: no {split} problems with operands 0..{max_operand}; use a larger --max-operand")
    if split == "heldout":
        rng.shuffle(pool)
        picked = pool[:n] if n is not None else pool
    else:
        picked = [rng.choice(pool) for _ in range(n or 2000)]
    return [
        {"id": f"add-{split}-s{seed}-{i:06d}", "question": f"{a}+{b}=", "answer": str(a + b)}
        for i, (a, b) in enumerate(picked)
    ]


def write_arithmetic_taskset(
    path_or_url: str,
    n: int | None,
    seed: int = 0,
    max_operand: int = DEFAULT_MAX_OPERAND,
    storage_options: dict[str, Any] | None = None,
    split: str = "all",
) -> str:
    """Write `make_arithmetic_tasks(n, seed, max_operand, split)` as JSONL to a local path or fsspec URL; returns the path."""
    from rl_engine.rewards.tasks import write_taskset

    return write_taskset(path_or_url, make_arithmetic_tasks(n, seed, max_operand, split), storage_options)


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
