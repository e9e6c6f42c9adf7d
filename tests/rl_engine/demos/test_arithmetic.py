"""The demo arithmetic task: deterministic generator, CLI, and the exact-answer + format reward."""

from __future__ import annotations

import json

import pytest

from rl_engine.config import ArithmeticReward, TasksetConfig
from rl_engine.demos.arithmetic import ArithmeticRewardFn, make_arithmetic_tasks, write_arithmetic_taskset
from rl_engine.errors import UserError
from rl_engine.rewards import Task, build_reward, load_taskset
from rl_engine.rewards.make_tasks import main


def test_generator_is_deterministic_and_correct():
    a = make_arithmetic_tasks(200, seed=3)
    assert a == make_arithmetic_tasks(200, seed=3)
    assert a != make_arithmetic_tasks(200, seed=4)
    assert len({r["id"] for r in a}) == 200
    for r in a:
        x, y = r["question"].removesuffix("=").split("+")
        assert r["question"].endswith("=")
        assert 0 <= int(x) <= 20 and 0 <= int(y) <= 20
        assert r["answer"] == str(int(x) + int(y))


def test_generator_operand_range_and_bad_args():
    rows = make_arithmetic_tasks(500, seed=0, max_operand=9)
    operands = {int(v) for r in rows for v in r["question"][:-1].split("+")}
    assert operands == set(range(10))  # the whole range is used, nothing outside it
    with pytest.raises(UserError, match="--n"):
        make_arithmetic_tasks(0, seed=0)


def test_write_and_load_roundtrip(tmp_path):
    out = tmp_path / "sub" / "arith.jsonl"
    write_arithmetic_taskset(str(out), n=50, seed=1)
    lines = out.read_text().splitlines()
    assert [json.loads(x) for x in lines] == make_arithmetic_tasks(50, seed=1)
    tasks = load_taskset(TasksetConfig(path=str(out)))
    assert [t.prompt for t in tasks] == [r["question"] for r in make_arithmetic_tasks(50, seed=1)]
    assert tasks[0].task_id == "add-s1-000000"


def test_cli_main_writes_the_file(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    assert main([str(out), "--n", "7", "--seed", "5"]) == 0
    assert len(out.read_text().splitlines()) == 7
    assert "wrote 7" in capsys.readouterr().out


def _task(answer="19"):
    return Task(task_id="t", prompt="12+7=", answer=answer, row={})


@pytest.mark.parametrize(
    "response, finish, expected",
    [
        ("19", "stop", {"correct": 1.0, "format": 0.1}),  # right and well formed
        ("18", "stop", {"correct": 0.0, "format": 0.1}),  # wrong number, good format
        ("19", "length", {"correct": 1.0, "format": 0.0}),  # cut by the budget: not a stop
        ("19", "repeat", {"correct": 1.0, "format": 0.0}),
        (" 19\n", "stop", {"correct": 1.0, "format": 0.0}),  # whitespace: correct, not well formed
        ("19 apples", "stop", {"correct": 0.0, "format": 0.0}),
        ("", "stop", {"correct": 0.0, "format": 0.0}),
        ("-19", "stop", {"correct": 0.0, "format": 0.0}),
        ("191", "stop", {"correct": 0.0, "format": 0.1}),
    ],
)
def test_arithmetic_reward_cases(response, finish, expected):
    fn = ArithmeticRewardFn(correct_weight=1.0, format_weight=0.1)
    assert fn("12+7=", response, _task(), finish) == expected


def test_build_reward_uses_config_weights():
    fn = build_reward(ArithmeticReward(type="arithmetic", correct_weight=2.0, format_weight=0.5))
    assert fn("12+7=", "19", _task(), "stop") == {"correct": 2.0, "format": 0.5}
    # The default taskset reward is the arithmetic one.
    assert isinstance(build_reward(TasksetConfig(path="x.jsonl").reward), ArithmeticRewardFn)


def test_arithmetic_reward_needs_an_answer():
    with pytest.raises(ValueError, match="no answer"):
        ArithmeticRewardFn()("1+1=", "2", _task(answer=None), "stop")


def test_the_held_out_split_is_disjoint_from_train_and_whole(tmp_path):
    from rl_engine.demos.arithmetic import arithmetic_pairs, is_heldout

    held, train = set(arithmetic_pairs("heldout")), set(arithmetic_pairs("train"))
    assert not held & train and held | train == set(arithmetic_pairs("all")) and len(held) == 57
    assert all(is_heldout(b, a) for a, b in held)  # 12+7 held out with 7+12: no commuted twin to learn from
    rows = make_arithmetic_tasks(500, seed=2, split="train")
    assert {r["question"] for r in rows} <= {f"{a}+{b}=" for a, b in train}
    out = tmp_path / "heldout.jsonl"
    assert main([str(out), "--split", "heldout"]) == 0  # the docs' `rft make-tasks ... --split heldout`
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["question"] for r in written) == sorted(f"{a}+{b}=" for a, b in held)  # each once
    assert all(r["answer"] == str(sum(map(int, r["question"][:-1].split("+")))) for r in written)
    with pytest.raises(UserError, match="--split 'test': use all, train or heldout"):
        make_arithmetic_tasks(10, split="test")
