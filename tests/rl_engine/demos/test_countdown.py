"""The long-tail countdown task: its length distribution, generator, CLI, reward, the repetition
detector's view of correct answers, and the warm start's countdown data (fast: no engine, no SFT).

    .venv/bin/python -m pytest tests/rl_engine/demos/test_countdown.py -q
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import yaml

from cli.main import main as rft
from rl_engine.config import CountdownReward, TasksetConfig, load_config
from rl_engine.demos.countdown import (
    CountdownRewardFn,
    countdown_answer,
    countdown_weights,
    make_countdown_tasks,
    write_countdown_taskset,
)
from rl_engine.errors import UserError
from rl_engine.rewards import Task, build_reward, load_taskset

REPO = Path(__file__).parents[3]


def test_answers_and_questions():
    assert countdown_answer(1) == "1"
    assert countdown_answer(12) == "12 11 10 9 8 7 6 5 4 3 2 1"
    rows = make_countdown_tasks(300, seed=3)
    assert rows == make_countdown_tasks(300, seed=3) and rows != make_countdown_tasks(300, seed=4)
    assert len({r["id"] for r in rows}) == 300 and rows[0]["id"] == "cd-s3-000000"
    for r in rows:
        n = int(r["question"].removesuffix("..1="))
        assert r["question"] == f"{n}..1=" and 1 <= n <= 40
        assert r["answer"].split(" ") == [str(k) for k in range(n, 0, -1)]


def test_start_values_follow_the_truncated_power_law():
    w = countdown_weights(40, 1.0)
    assert sum(w) == pytest.approx(1.0) and w[0] / w[1] == pytest.approx(2.0) and w[0] / w[39] == pytest.approx(40.0)
    assert countdown_weights(5, 0.0) == pytest.approx([0.2] * 5)  # alpha 0: uniform
    counts = Counter(int(r["question"].split(".")[0]) for r in make_countdown_tasks(20_000, seed=0))
    assert set(counts) == set(range(1, 41))  # the whole range, nothing outside it
    for n in (1, 2, 5, 10):
        assert counts[n] / 20_000 == pytest.approx(w[n - 1], abs=0.01)


def test_answer_lengths_are_long_tailed():
    # What partial rollouts are for: most answers short, a few several times longer.
    lengths = sorted(
        len(r["answer"]) + 1 for r in make_countdown_tasks(20_000, seed=0)
    )  # + EOS, one token per character
    median, p95, longest = lengths[len(lengths) // 2], lengths[int(0.95 * len(lengths))], lengths[-1]
    assert median <= 10 and p95 >= 80 and longest == 111
    assert sum(x > 64 for x in lengths) / len(lengths) == pytest.approx(0.117, abs=0.01)


def test_bad_generator_arguments():
    with pytest.raises(UserError, match="--n"):
        make_countdown_tasks(0)
    with pytest.raises(UserError, match="--max-n"):
        make_countdown_tasks(5, max_n=0)
    with pytest.raises(UserError, match="--alpha"):
        make_countdown_tasks(5, alpha=-1.0)


def test_write_and_load_roundtrip(tmp_path):
    out = tmp_path / "sub" / "cd.jsonl"
    write_countdown_taskset(str(out), n=50, seed=1, max_n=12, alpha=0.5)
    rows = make_countdown_tasks(50, seed=1, max_n=12, alpha=0.5)
    assert [json.loads(x) for x in out.read_text().splitlines()] == rows
    tasks = load_taskset(TasksetConfig(path=str(out)))
    assert [(t.task_id, t.prompt, t.answer) for t in tasks] == [(r["id"], r["question"], r["answer"]) for r in rows]


def test_cli_make_tasks_picks_the_task(tmp_path, capsys):
    from rl_engine.errors import UserError
    from rl_engine.rewards.make_tasks import main as make_tasks_main

    # Options before the output path reach the task's own parser (`rft make-tasks --task countdown OUT`).
    out = tmp_path / "cd.jsonl"
    assert rft(["make-tasks", "--task", "countdown", str(out), "--n", "7", "--seed", "5", "--max-n", "9"]) == 0
    assert [json.loads(x) for x in out.read_text().splitlines()] == make_countdown_tasks(7, seed=5, max_n=9)
    assert "wrote 7 countdown tasks" in capsys.readouterr().out
    arith = tmp_path / "arith.jsonl"
    assert rft(["make-tasks", str(arith), "--n", "3"]) == 0  # the default task is still arithmetic
    assert json.loads(arith.read_text().splitlines()[0])["id"].startswith("add-")
    with pytest.raises(
        UserError, match=r"--task = 'nope': no task of that name; registered: arithmetic, calculator, countdown"
    ):
        make_tasks_main([str(out), "--task", "nope"])


def _task(n=3):
    return Task(task_id="t", prompt=f"{n}..1=", answer=countdown_answer(n), row={})


@pytest.mark.parametrize(
    "response, finish, expected",
    [
        ("3 2 1", "stop", {"correct": 1.0, "close": 0.5}),  # exact, then EOS
        ("3 2 1", "truncated", {"correct": 0.0, "close": 0.5}),  # right text, but not stopped by the model
        ("3 2 1", "repeat", {"correct": 0.0, "close": 0.5}),
        ("3 2", "stop", {"correct": 0.0, "close": 0.5 * 2 / 3}),  # stopped early: progress 2 of 3
        ("3 2 1 0", "stop", {"correct": 0.0, "close": 0.5 * 3 / 4}),  # overshoot is over the longer side
        ("3 2 1 ", "stop", {"correct": 0.0, "close": 0.5 * 3 / 4}),  # a trailing space is one more (empty) item
        ("3 1 2", "stop", {"correct": 0.0, "close": 0.5 * 1 / 3}),  # progress counts from the start only
        ("2 1", "stop", {"correct": 0.0, "close": 0.0}),
        ("", "stop", {"correct": 0.0, "close": 0.0}),
        (" 3 2 1", "stop", {"correct": 0.0, "close": 0.0}),
    ],
)
def test_countdown_reward_cases(response, finish, expected):
    got = CountdownRewardFn(correct_weight=1.0, close_weight=0.5)("3..1=", response, _task(3), finish)
    assert got.keys() == expected.keys() and all(got[k] == pytest.approx(v) for k, v in expected.items())


def test_countdown_reward_needs_an_answer():
    with pytest.raises(ValueError, match="no answer"):
        CountdownRewardFn()("3..1=", "3 2 1", Task("t", "3..1=", None), "stop")


def test_reward_from_config_and_yaml(tmp_path, tiny_model_dir):
    fn = build_reward(CountdownReward(type="countdown", correct_weight=2.0, close_weight=0.25))
    assert fn("3..1=", "3 2 1", _task(3), "stop") == {"correct": 2.0, "close": 0.25}
    p = tmp_path / "c.yaml"
    p.write_text(
        yaml.safe_dump(
            {
                "model": {"path": tiny_model_dir},
                "taskset": {"path": "t.jsonl", "reward": {"type": "countdown", "close_weight": -1}},
            }
        )
    )
    with pytest.raises(UserError, match=r"taskset\.reward\.close_weight = -1"):
        load_config(p)


def test_correct_answers_never_trip_the_repetition_detector():
    # The detector is vLLM's rule on token ids; the byte-level tiny tokenizer gives one token per character.
    from rl_engine.roles.partial import repeat_cut
    from rl_engine.tiny_model import build_tokenizer

    tok = build_tokenizer()
    for n in range(1, 41):
        ids = tok(countdown_answer(n))["input_ids"]
        assert all(repeat_cut(ids, 0, ngram, 3) is None for ngram in (1, 2, 3, 4, 8)), n
    # "11" repeats one token twice: threshold 2 is the one setting that would stop correct answers.
    assert repeat_cut(tok(countdown_answer(11))["input_ids"], 0, 1, 2) is not None
    # A degenerate loop is stopped under the shipped config's settings.
    cfg = yaml.safe_load((REPO / "configs" / "partial.yaml").read_text())["explorer"]["partial"]
    loop = tok("12 11 10 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9")["input_ids"]
    assert repeat_cut(loop, 0, cfg["repeat_ngram"], cfg["repeat_threshold"]) is not None


def test_warmstart_countdown_data_fits_the_shipped_config():
    from rl_engine.demos.warmstart import encode_examples, task_problems, task_rows
    from rl_engine.tiny_model import build_tokenizer

    problems, weights = task_problems("countdown")
    assert [p["question"] for p in problems] == [f"{n}..1=" for n in range(1, 41)] and weights == pytest.approx(
        countdown_weights()
    )
    assert task_rows("countdown", 64, seed=7) == make_countdown_tasks(64, seed=7)
    assert task_problems("arithmetic")[1] is None and len(task_rows("arithmetic", 5, seed=0)) == 5
    # The longest problem (prompt + answer + EOS) fits the config's context, and its answer the response budget.
    cfg = yaml.safe_load((REPO / "configs" / "partial.yaml").read_text())
    batch = encode_examples(build_tokenizer(), problems[-1:])
    answer_tokens = int(batch["loss_mask"].sum())
    assert batch["input_ids"].shape[1] <= cfg["model"]["max_model_len"]
    assert (
        answer_tokens
        == 111
        <= cfg["explorer"]["partial"]["max_response_tokens"]
        <= cfg["explorer"]["sampling"]["max_tokens"]
    )


def test_warmstart_bad_task():
    from rl_engine.demos.warmstart import main

    with pytest.raises(SystemExit):
        main(["/tmp/unused", "--task", "nope"])


@pytest.mark.slow  # a DeepSpeed trainer: ~10 s on idle cores
def test_cli_warmstart_countdown(tmp_path):
    """`rft warmstart DIR --task countdown` (README): the saved model is the one its figures describe."""
    from rl_engine.demos.warmstart import evaluate_dir

    out = tmp_path / "m"
    assert (
        rft(["warmstart", str(out), "--task", "countdown", "--steps", "2", "--batch-size", "8", "--threads", "1"]) == 0
    )
    summary = json.loads((out / "warmstart.json").read_text())
    assert (summary["task"], summary["steps"], summary["batch_size"], summary["max_n"], summary["alpha"]) == (
        "countdown",
        2,
        8,
        40,
        1.0,
    )
    again = evaluate_dir(str(out), task="countdown")
    assert again["expected_exact_t1"] == pytest.approx(summary["expected_exact_t1"], rel=1e-4, abs=1e-7)
    assert again["greedy_exact"] == summary["greedy_exact"]
