"""The real model's task: seeded word-arithmetic tasks, a held-out split no train task asks, and the final-answer reward."""

from __future__ import annotations

import json

import pytest

from rl_engine.config import FinalAnswerReward
from rl_engine.demos.word_arithmetic import final_number, make_word_arithmetic_tasks
from rl_engine.errors import UserError
from rl_engine.rewards import Task, build_reward
from rl_engine.rewards.make_tasks import main as make_tasks


def test_tasks_are_seeded_and_the_held_out_split_is_disjoint_from_train():
    train = make_word_arithmetic_tasks(4000, seed=0)
    assert train == make_word_arithmetic_tasks(4000, seed=0) and train != make_word_arithmetic_tasks(4000, seed=1)
    heldout = make_word_arithmetic_tasks(None, seed=0, split="heldout")
    assert len(heldout) == 320  # a fifth of the 40 x 40 problems
    assert len({r["question"] for r in heldout}) == 320
    assert not {r["question"] for r in train} & {r["question"] for r in heldout}
    row = heldout[0]
    a, b = (int(x) for x in row["question"].removeprefix("What is ").split("?")[0].split(" + "))
    assert row["answer"] == str(a + b) and row["question"].endswith("Reply with only the number.")
    assert (
        make_word_arithmetic_tasks(50, seed=3, split="heldout")
        == make_word_arithmetic_tasks(None, seed=3, split="heldout")[:50]
    )


def test_make_tasks_writes_them(tmp_path, capsys):
    out = tmp_path / "h.jsonl"
    assert make_tasks([str(out), "--task", "word-arithmetic", "--split", "heldout", "--n", "5"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"words-heldout-s0-{i:06d}" for i in range(5)]
    with pytest.raises(UserError, match="--max-operand must be >= 2"):
        make_word_arithmetic_tasks(5, max_operand=1)


@pytest.mark.parametrize(
    "response, finish, final_answer, fmt",
    [
        ("41", "stop", 1.0, 0.1),
        ("27 + 14 = 41", "stop", 1.0, 0.1),  # the final answer is the last number
        ("27 + 14 = 41.", "stop", 1.0, 0.1),
        ("The answer is 41, since 27 + 14 = 41", "stop", 1.0, 0.1),
        ("41 apples, or 40", "stop", 0.0, 0.1),  # a later number is the final one
        ("27 + 14 = 41\n\nThis is a classic example", "length", 0.0, 0.0),  # cut by the budget: no final answer
        ("27 + 14 = 41", "repeat", 0.0, 0.0),
        ("forty-one", "stop", 0.0, 0.0),
        ("410", "stop", 0.0, 0.1),
        ("41.5", "stop", 0.0, 0.1),
    ],
)
def test_the_final_answer_reward_parses_the_last_number_of_a_finished_response(response, finish, final_answer, fmt):
    reward = build_reward(FinalAnswerReward(type="final_answer", correct_weight=1.0, format_weight=0.1))
    task = Task("t", "What is 27 + 14? Reply with only the number.", "41")
    assert reward("p", response, task, finish) == {"final_answer": final_answer, "format": fmt}


def test_final_number():
    assert final_number("a 1 b -2 c 3.5") == "3.5"
    assert final_number("none") is None
