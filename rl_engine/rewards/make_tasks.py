"""`rft make-tasks`: write a demo task set, picking the task with `--task` (default arithmetic).

The rest of the arguments are the chosen task's own (`--task countdown --help` lists them):

    rft make-tasks runs/data/arith-train.jsonl --n 2000 --seed 0
    rft make-tasks runs/data/countdown-train.jsonl --task countdown --n 2000 --seed 0
    rft make-tasks runs/data/words-train.jsonl --task word-arithmetic   # the real model's task (--split heldout)
    rft make-tasks runs/data/calc-train.jsonl --task calculator          # multi-turn: the calculator tool (--split heldout)
    rft make-tasks runs/data/guess-train.jsonl --task guess_number      # multi-turn: a guessing game

The multi-turn tasks live beside their workflows (rl_engine/rollout/), so this module sits on a
floor above them (rl_engine/__init__.py), and imports the chosen task's module only.
"""

from __future__ import annotations

import argparse
from types import ModuleType

TASKS = ("arithmetic", "countdown", "word-arithmetic", "calculator", "guess_number")


def task_module(task: str) -> ModuleType:
    """The module whose `main` writes `task`'s task set (imported only when chosen)."""
    if task == "arithmetic":
        from rl_engine.demos import arithmetic as m
    elif task == "countdown":
        from rl_engine.demos import countdown as m
    elif task == "word-arithmetic":
        from rl_engine.demos import word_arithmetic as m
    elif task == "calculator":
        from rl_engine.demos import calculator as m
    else:
        from rl_engine.demos import guess_number as m
    return m


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rft make-tasks", add_help=False)
    ap.add_argument("--task", choices=sorted(TASKS), default="arithmetic")
    a, rest = ap.parse_known_args(argv)
    return int(task_module(a.task).main(rest) or 0)


if __name__ == "__main__":
    from rl_engine.errors import run_main

    run_main(main)
