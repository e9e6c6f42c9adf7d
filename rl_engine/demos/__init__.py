"""The demos: rft's built-in example tasks, with their rewards and multi-turn workflows.

Each is what a user's plugin would be: a task maker (`rft make-tasks --task NAME`), a reward
and, for the multi-turn ones, a workflow, selected by name through the registries like any
user's registered code (rl_engine/registry.py lists them by import path, imported on first use).
Nothing in rl_engine outside this package imports it (tests/test_layering.py checks it). The
warm start of the tiny model on these tasks (warmstart.py, `rft warmstart`) and the plain
single-process GRPO loop on the arithmetic task (loop.py) live here too: they know the tasks.

    arithmetic.py       "12+7=" -> "19": the `make demo` task and its exact-answer + format reward
    countdown.py        "13..1=" -> "13 12 ... 1": the long-tail task of partial rollouts
    word_arithmetic.py  word problems with a final number: the real model's task (`rft demo --model smollm2`)
    calculator.py       multi-turn: the model may call a calculator tool ("<calc>37*58</calc>")
    guess_number.py     multi-turn: a guessing game, the environment answers "higher" / "lower"
    warmstart.py        SFT of the tiny model on a demo task until it is partly right (`rft warmstart`)
    loop.py             the synchronous GRPO loop in one process, evaluated on the arithmetic task
"""
