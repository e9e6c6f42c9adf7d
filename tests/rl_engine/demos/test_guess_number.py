"""The guessing game (rl_engine/demos/guess_number.py) played by a scripted model, its task set
and make-tasks. No engine.

    .venv/bin/python -m pytest tests/rl_engine/demos/test_guess_number.py -q
"""

from __future__ import annotations

import json

import pytest

from rl_engine.demos.guess_number import (
    feedback,
    guess_number_workflow,
    make_guess_number_tasks,
    question,
    task_range,
)
from tests.rl_engine.rollout.fake_episode import EOS_MARK, FakeEpisode, FakeTask


def task(secret: int = 11, high: int = 15, row: bool = True) -> FakeTask:
    return FakeTask("guess-0", question(high), str(secret), {"high": high} if row else {})


def play(script: list[str], secret: int = 11, max_turns: int = 4, high: int = 15) -> tuple[dict, FakeEpisode]:
    t = task(secret, high)
    ep = FakeEpisode(t.prompt, script)
    reward = guess_number_workflow(t, ep, max_turns=max_turns)
    return reward, ep


def test_binary_search_hits_with_feedback_in_the_right_direction():
    reward, ep = play(["8\n", "12\n", "10\n", "11\n"], secret=11)
    assert reward == {"hit": 1.0, "format": 0.1}
    assert ep.env_texts() == ["+\n", "-\n", "+\n"]  # 11 > 8: higher; 11 < 12: lower; 11 > 10: higher
    assert ep.text() == "guess 1..15\n8\n+\n12\n-\n10\n+\n11\n"
    assert ep.masked_text() == "+\n-\n+\n" and ep.trained_text() == "8\n12\n10\n11\n"


def test_each_turn_is_short_and_stops_at_newline():
    _, ep = play(["8\n", "11\n"], secret=11)
    assert [v for k, v in ep.events if k == "generate"] == [(3, ["\n"]), (3, ["\n"])]  # "15\n" is 3 tokens


def test_first_guess_hit_ends_the_episode():
    reward, ep = play(["11\n"], secret=11)
    assert reward["hit"] == 1.0 and ep.env_texts() == [] and ep.turns == 1


def test_miss_within_max_turns_scores_zero_and_no_feedback_after_the_last_turn():
    reward, ep = play(["1\n", "2\n", "3\n", "4\n"], secret=11)
    assert reward == {"hit": 0.0, "format": 0.1}
    assert ep.env_texts() == ["+\n"] * 3 and ep.turns == 4


def test_max_turns_is_respected():
    reward, ep = play(["1\n", "2\n"], secret=2, max_turns=1)
    assert reward["hit"] == 0.0 and ep.turns == 1 and ep.script == ["2\n"]


def test_invalid_guesses_get_a_question_mark_and_lose_the_format_bonus():
    reward, ep = play(["x\n", "99\n", "11\n"], secret=11)
    assert ep.env_texts() == ["?\n", "?\n"]
    assert reward == {"hit": 1.0, "format": 0.0}


def test_a_guess_ended_by_eos_or_the_budget_counts_but_is_not_well_formed():
    reward, _ = play(["11" + EOS_MARK], secret=11)
    assert reward == {"hit": 1.0, "format": 0.0}
    reward, ep = play(["111", "11\n"], secret=11)  # cut by the budget: not a number in range
    assert ep.env_texts() == ["?\n"] and reward == {"hit": 1.0, "format": 0.0}


def test_feedback_direction():
    assert feedback(5, 9, 15) == "+\n" and feedback(12, 9, 15) == "-\n"
    assert feedback(None, 9, 15) == "?\n" and feedback(0, 9, 15) == "?\n" and feedback(16, 9, 15) == "?\n"


def test_range_from_the_row_or_the_prompt():
    assert task_range(task(3, 31)) == 31
    assert task_range(task(3, 31, row=False)) == 31


def test_tasks_are_deterministic_and_in_range():
    a = make_guess_number_tasks(300, seed=2, high=15)
    assert a == make_guess_number_tasks(300, seed=2, high=15) and a != make_guess_number_tasks(300, seed=3, high=15)
    assert {int(r["answer"]) for r in a} == set(range(1, 16))
    assert all(r["question"] == "guess 1..15\n" and r["high"] == 15 for r in a)


def test_make_tasks_cli(tmp_path):
    from rl_engine.config import TasksetConfig
    from rl_engine.rewards.make_tasks import main
    from rl_engine.rewards.tasks import load_taskset

    out = tmp_path / "guess.jsonl"
    assert main([str(out), "--task", "guess_number", "--n", "5", "--seed", "1", "--high", "31"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == make_guess_number_tasks(5, seed=1, high=31)
    loaded = load_taskset(TasksetConfig(path=str(out)))  # the workflow reads `high` from the task's row
    assert [task_range(t) for t in loaded] == [31] * 5 and loaded[0].prompt == "guess 1..31\n"


def test_make_tasks_refuses_bad_arguments():
    from rl_engine.errors import UserError

    with pytest.raises(UserError, match="--n"):
        make_guess_number_tasks(0)
    with pytest.raises(UserError, match="--high"):
        make_guess_number_tasks(3, high=0)
