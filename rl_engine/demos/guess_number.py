"""The guessing game (issue 23): the model guesses a secret number, the environment says higher or lower.

A task row (`question` / `answer`, TasksetConfig's default keys; `high` is the range's top):

    {"id": "guess-s0-000000", "question": "guess 1..15\\n", "answer": "11", "high": 15}

with the secret uniform in 1..high (15 by default: binary search finds any secret within 4
guesses, the default `max_turns`). There is no held-out split: the problem space is the 15
secrets, and success is measured over all of them.

One episode (`guess_number_workflow`), one character per token for the tiny model:

    guess 1..15\\n8\\n+\\n12\\n-\\n10\\n+\\n11\\n
                  |m||e-||m-||e-||m-||e-||m-|      m: the model's guess (trained), e: the environment (masked)

Each turn is generated with stop=["\\n"] and max_tokens = digits of `high` + 1. The guess is the
turn's text as an integer. On a hit the episode ends; on a miss the environment appends "+\\n"
(the secret is higher), "-\\n" (lower), or "?\\n" (not a number in 1..high), except after the
last allowed turn. The workflow returns the reward itself, two named components:

    hit     1.0 when a guess equals the secret within `max_turns` guesses, else 0.0
    format  `format_weight` (0.1) when every guess was a number in 1..high ended by "\\n"

    rft make-tasks runs/data/guess-train.jsonl --task guess_number --n 2000 --seed 0
"""

from __future__ import annotations

import random
import re
from typing import Any

from rl_engine.demos.calculator import ended_at
from rl_engine.errors import UserError

DEFAULT_HIGH = 15
HIGHER, LOWER, INVALID = "+\n", "-\n", "?\n"
_NUMBER = re.compile(r"[0-9]+")
_RANGE = re.compile(r"1\.\.([0-9]+)")


def question(high: int) -> str:
    return f"guess 1..{high}\n"


def feedback(guess: int | None, secret: int, high: int) -> str:
    """What the environment says after a missed guess (None: not a number)."""
    if guess is None or not 1 <= guess <= high:
        return INVALID
    return HIGHER if secret > guess else LOWER


def parse_guess(text: str) -> int | None:
    text = text.strip()
    return int(text) if _NUMBER.fullmatch(text) and len(text) <= 6 else None


def task_range(task: Any) -> int:
    """The task's `high`: its row's field, else read from its prompt ("1..15"), else DEFAULT_HIGH."""
    row = getattr(task, "row", None) or {}
    if isinstance(row.get("high"), int) and row["high"] >= 1:
        return row["high"]
    m = _RANGE.search(getattr(task, "prompt", "") or "")
    return int(m.group(1)) if m else DEFAULT_HIGH


def guess_number_workflow(task: Any, episode: Any, max_turns: int = 4, format_weight: float = 0.1) -> dict[str, float]:
    """One game (module doc): up to `max_turns` guesses; returns {"hit", "format"}."""
    secret, high = int(task.answer), task_range(task)
    well_formed = True
    for turn_no in range(max_turns):
        turn = episode.generate(max_tokens=len(str(high)) + 1, stop=["\n"])
        guess = parse_guess(turn.text)
        well_formed = well_formed and guess is not None and 1 <= guess <= high and ended_at(episode, turn, "\n")
        if guess == secret:
            return {"hit": 1.0, "format": format_weight if well_formed else 0.0}
        if turn_no + 1 < max_turns:
            episode.append_text(feedback(guess, secret, high))
    return {"hit": 0.0, "format": format_weight if well_formed else 0.0}


def make_guess_number_tasks(n: int, seed: int = 0, high: int = DEFAULT_HIGH) -> list[dict[str, Any]]:
    """`n` games with the secret uniform in 1..high; same (n, seed, high) -> same rows."""
    if n < 1:
        raise UserError(f"make-tasks: --n must be >= 1, got {n}")
    if high < 1:
        raise UserError(f"make-tasks: --high must be >= 1, got {high}")
    rng = random.Random(seed)
    return [
        {"id": f"guess-s{seed}-{i:06d}", "question": question(high), "answer": str(rng.randint(1, high)), "high": high}
        for i in range(n)
    ]


def write_guess_number_taskset(
    path_or_url: str, n: int, seed: int = 0, high: int = DEFAULT_HIGH, storage_options: dict[str, Any] | None = None
) -> str:
    """Write `make_guess_number_tasks(...)` as JSONL to a local path or fsspec URL; returns the path."""
    from rl_engine.rewards.tasks import write_taskset

    return write_taskset(path_or_url, make_guess_number_tasks(n, seed, high), storage_options)
