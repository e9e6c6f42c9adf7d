"""`rft make-tasks`: write a task set with a registered task maker (`--task`, default arithmetic)
or a user's by import path; its other parameters become options.

    rft make-tasks runs/data/arith-train.jsonl --n 2000 --seed 0
    rft make-tasks runs/data/countdown-train.jsonl --task countdown --n 2000 --seed 0
    rft make-tasks runs/data/words-train.jsonl --task word-arithmetic   # the real model's task (--split heldout)
    rft make-tasks runs/data/calc-train.jsonl --task calculator          # multi-turn: the calculator tool (--split heldout)
    rft make-tasks runs/data/guess-train.jsonl --task guess_number      # multi-turn: a guessing game
    rft make-tasks runs/data/mine.jsonl --task mytasks:make_rows --n 100 --level 3

A task maker (`rl_engine.api.TaskMaker`) is `(n, seed, **params) -> rows`; `--task NAME --help`
lists the chosen one's parameters, each `--a-param VALUE` (the value read as YAML: 3, 0.5, true, a
string). The makers are found through the registry, so this module imports none of them.
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from typing import Any

import yaml

from rl_engine.errors import UserError
from rl_engine.registry import TASKS, load_object
from rl_engine.rewards.tasks import write_taskset

DEFAULT_N = 2000  # a maker whose `n` has no default of its own


def task_maker(task: str) -> Callable[..., list[dict[str, Any]]]:
    """The registered task maker `task`, or a user's `package.module:function`."""
    if ":" in task:
        return load_object(task, "--task")
    if task not in TASKS:
        raise UserError(
            f"--task = {task!r}: no task of that name; registered: {', '.join(TASKS.names())}; "
            "name a task maker of your own as --task package.module:function"
        )
    return TASKS.get(task)


def checked_rows(rows: Any, who: str) -> list[dict[str, Any]]:
    """A task maker's return value when it is a non-empty list of dict rows; else the UserError naming `who`."""
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        raise UserError(
            f"{who}: a task maker returns a list of dict rows, got {type(rows).__name__} {str(rows)[:80]}; "
            "return a non-empty list of dict rows"
        )
    return rows


def make_taskset(taskset: Any, storage_options: dict[str, Any] | None = None) -> int | None:
    """`taskset.make`: write `taskset.path` with the configured task maker when the file does not
    exist yet; the row count written, or None when there was nothing to do (no maker, or the file
    is there: a made task set is never overwritten, so a resumed run trains on the same tasks)."""
    from rl_engine.storage import open_storage

    m = taskset.make
    if m is None:
        return None
    fs, path = open_storage(taskset.path, storage_options)
    if fs.exists(path):
        return None
    maker = load_object(m.function, "taskset.make.function") if m.type == "python" else TASKS.get(m.type)
    rows = checked_rows(maker(m.n, m.seed, **m.kwargs), f"taskset.make ({m.type!r})")
    write_taskset(taskset.path, rows, storage_options)
    return len(rows)


def maker_parser(task: str, maker: Callable[..., Any]) -> argparse.ArgumentParser:
    """OUT, --n, --seed and an option per other parameter of `maker` (its default shown)."""
    doc = (inspect.getdoc(maker) or "").split("\n\n")[0]
    ap = argparse.ArgumentParser(prog=f"rft make-tasks --task {task}", description=doc)
    ap.add_argument("out", help="output file (JSONL): a local path or fsspec URL (s3://...)")
    params = inspect.signature(maker).parameters
    n = params.get("n")
    n_default = DEFAULT_N if n is None or n.default is inspect.Parameter.empty else n.default
    ap.add_argument("--n", type=int, default=n_default, help=f"number of tasks (default {n_default})")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    for name, p in params.items():
        if name in ("n", "seed") or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        required = p.default is inspect.Parameter.empty
        ap.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            type=yaml.safe_load,
            required=required,
            default=None if required else p.default,
            help="required" if required else f"default {p.default!r}",
        )
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rft make-tasks", add_help=False)
    ap.add_argument("--task", default="arithmetic")
    a, rest = ap.parse_known_args(argv)
    maker = task_maker(a.task)
    args = vars(maker_parser(a.task, maker).parse_args(rest))
    out, n, seed = args.pop("out"), args.pop("n"), args.pop("seed")
    if n is not None and n < 1:
        raise UserError(f"make-tasks: --n must be >= 1, got {n}")
    rows = checked_rows(maker(n, seed, **args), f"--task {a.task}")
    write_taskset(out, rows)
    shown = ", ".join(f"{k} {v}" for k, v in args.items())
    print(f"wrote {len(rows)} {a.task} tasks (seed {seed}{', ' + shown if shown else ''}) to {out}")
    return 0


if __name__ == "__main__":
    from rl_engine.errors import run_main

    run_main(main)
