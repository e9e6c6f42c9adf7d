"""`rft make-tasks`: write a demo task set, picking the task with `--task` (default arithmetic).

The rest of the arguments are the chosen task's own (`--task countdown --help` lists them):

    rft make-tasks runs/data/arith-train.jsonl --n 2000 --seed 0
    rft make-tasks runs/data/countdown-train.jsonl --task countdown --n 2000 --seed 0
    rft make-tasks runs/data/words-train.jsonl --task word-arithmetic   # the real model's task (--split heldout)
    rft make-tasks runs/data/calc-train.jsonl --task calculator          # multi-turn: the calculator tool (--split heldout)
    rft make-tasks runs/data/guess-train.jsonl --task guess_number      # multi-turn: a guessing game

The multi-turn tasks live beside their workflows (rl_engine/rollout/, a floor above this one):
they are named here as module paths and imported only when chosen.
"""

from __future__ import annotations

import argparse
import importlib

TASKS = {
    "arithmetic": "rl_engine.rewards.arithmetic",
    "countdown": "rl_engine.rewards.countdown",
    "word-arithmetic": "rl_engine.rewards.word_arithmetic",
    "calculator": "rl_engine.rollout.calculator",
    "guess_number": "rl_engine.rollout.guess_number",
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rft make-tasks", add_help=False)
    ap.add_argument("--task", choices=sorted(TASKS), default="arithmetic")
    a, rest = ap.parse_known_args(argv)
    return int(importlib.import_module(TASKS[a.task]).main(rest) or 0)


if __name__ == "__main__":
    from rl_engine.errors import run_main

    run_main(main)
