"""The `code` demo's task maker (rl_engine/demos/python_functions.py): seeded function-writing
tasks, a held-out split no train task asks, tests whose expected values are the reference's, and
every reference solution passing its own tests in the sandbox (code_tests reward: 1.0)."""

from __future__ import annotations

import json

import pytest

from rl_engine.demos.python_functions import FAMILIES, TESTS_PER_TASK, make_python_functions_tasks, problems
from rl_engine.errors import UserError
from rl_engine.rewards import RolloutSample, Task, score_rollouts
from rl_engine.rewards.sandbox import namespaces_available


def test_rows_are_seeded_and_hold_a_prompt_a_reference_and_tests():
    rows = make_python_functions_tasks(30, seed=4)
    assert rows == make_python_functions_tasks(30, seed=4) != make_python_functions_tasks(30, seed=5)
    for r in rows:
        assert set(r) == {"id", "question", "answer", "tests", "entry_point"}
        assert f"`{r['entry_point']}(" in r["question"] and "```python" in r["question"]
        assert r["answer"].startswith(f"def {r['entry_point']}(")
        assert len(r["tests"]) == TESTS_PER_TASK and all(
            t.startswith(f"assert {r['entry_point']}(") for t in r["tests"]
        )
    add_7 = next(p for p in problems("train") + problems("heldout") if p.name == "add_7").row("x")
    assert add_7["answer"] == "def add_7(x):\n    return x + 7\n"
    for test in add_7["tests"]:  # `assert add_7(a) == a + 7`
        call, expected = test.removeprefix("assert add_7(").split(") == ")
        assert int(expected) == int(call) + 7


def test_the_heldout_split_is_apart_from_train():
    train, heldout = problems("train"), problems("heldout")
    assert len(heldout) == len({p.key for p in heldout}) and len(train) + len(heldout) == sum(
        len(f.constants) for f in FAMILIES
    )
    assert not {p.name for p in train} & {p.name for p in heldout}
    rows = make_python_functions_tasks(None, seed=0, split="heldout")
    assert sorted(r["entry_point"] for r in rows) == sorted(p.name for p in heldout)
    assert len(make_python_functions_tasks(5, seed=0, split="heldout")) == 5
    drawn = {r["entry_point"] for r in make_python_functions_tasks(2000, seed=1)}
    assert drawn <= {p.name for p in train}


def test_make_tasks_cli(tmp_path, capsys):
    from rl_engine.rewards.make_tasks import main

    out = tmp_path / "code.jsonl"
    assert main([str(out), "--task", "python-functions", "--n", "7", "--seed", "1"]) == 0
    assert [json.loads(line) for line in out.read_text().splitlines()] == make_python_functions_tasks(7, seed=1)
    held = tmp_path / "held.jsonl"
    assert main(["--task", "python-functions", str(held), "--split", "heldout"]) == 0
    assert len(held.read_text().splitlines()) == len(problems("heldout"))
    assert "python-functions tasks" in capsys.readouterr().out
    with pytest.raises(UserError, match="--split"):
        make_python_functions_tasks(3, split="test")
    with pytest.raises(UserError, match="--n"):
        make_python_functions_tasks(0)


@pytest.mark.skipif(not namespaces_available()[0], reason="the code_tests reward refuses to start without namespaces")
def test_every_reference_solution_passes_its_tests_in_the_sandbox():
    from rl_engine.rewards.code_tests import CodeTestsRewardFn

    reward = CodeTestsRewardFn(workers=2, sandbox={"timeout_s": 10})
    rows = [p.row(p.name) for p in problems("train") + problems("heldout")]
    samples = [
        RolloutSample(r["question"], f"```python\n{r['answer']}```", Task(r["id"], r["question"], None, r), "stop")
        for r in rows
    ]
    wrong = [
        RolloutSample(
            r["question"], f"def {r['entry_point']}(*args):\n    return None\n", Task(r["id"], "", None, r), "stop"
        )
        for r in rows[:4]
    ]
    result = score_rollouts(reward, samples + wrong)
    assert result.rewards[: len(rows)] == [1.0] * len(rows)
    assert result.rewards[len(rows) :] == [0.0] * 4
    assert result.metrics["reward/sandbox/runs"] == len(rows) + 4 and result.metrics["reward/sandbox/errors"] == 0
