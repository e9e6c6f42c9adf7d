"""The demos: rft's built-in example tasks, with their rewards and multi-turn workflows.

Each is what a user's plugin would be: a task maker (`rft make-tasks --task NAME`), a reward
and, for the multi-turn ones, a workflow, registered through the API (rl_engine/api.py) like any
user's code, not known to the engine core by name. Nothing in rl_engine outside this package
imports it (tests/test_layering.py checks it; its allow-list names the dispatchers that still do
until the registries replace them: rewards/scoring.py, rollout/workflow.py, rewards/make_tasks.py).

    arithmetic.py       "12+7=" -> "19": the `make demo` task and its exact-answer + format reward
    countdown.py        "13..1=" -> "13 12 ... 1": the long-tail task of partial rollouts
    word_arithmetic.py  word problems with a final number: the real model's task (`rft demo --model smollm2`)
    calculator.py       multi-turn: the model may call a calculator tool ("<calc>37*58</calc>")
    guess_number.py     multi-turn: a guessing game, the environment answers "higher" / "lower"
"""
