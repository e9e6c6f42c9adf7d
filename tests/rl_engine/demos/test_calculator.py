"""The calculator workflow (rl_engine/demos/calculator.py): the tool, the episode a scripted
model plays through it, the task sets, make-tasks and the warm start. No engine.

    .venv/bin/python -m pytest tests/rl_engine/demos/test_calculator.py -q
"""

from __future__ import annotations

import json

import pytest

from rl_engine.demos.arithmetic import ArithmeticRewardFn
from rl_engine.demos.calculator import (
    ERROR,
    MAX_OPERAND,
    MIN_OPERAND,
    calc,
    calculator_problems,
    calculator_transcript,
    calculator_workflow,
    is_heldout,
    make_calculator_tasks,
)
from rl_engine.rewards import Task
from tests.rl_engine.rollout.fake_episode import EOS_MARK, FakeEpisode, FakeTask

# ---------------------------------------------------------------- the tool


@pytest.mark.parametrize(
    "expr, want",
    [
        ("37*58", "2146"),
        (" 12 + 7 ", "19"),
        ("3-10", "-7"),
        ("-(2+3)*4", "-20"),
        ("2*3*4-1", "23"),
        ("0", "0"),
        ("99*99", "9801"),
    ],
)
def test_calc_evaluates_integer_arithmetic(expr, want):
    assert calc(expr) == want


@pytest.mark.parametrize(
    "expr",
    [
        "__import__('os').system('echo pwned')",
        "open('/etc/passwd').read()",
        "().__class__.__bases__[0].__subclasses__()",
        "x*2",
        "lambda: 1",
        "[1, 2]",
        "9**9**9",  # powers are refused, huge or not
        "2**3",
        "7/2",
        "7//2",
        "7%2",
        "1.5*2",
        "True+1",
        "'a'*3",
        "1e9",
        "",
        "   ",
        "37*",
        "<calc>1</calc>",
        "(" * 40 + "1" + ")" * 40,  # too long
        "9" * 13,  # beyond 10^12
        "999999*999999*999999",  # an intermediate value beyond 10^12
        "1\n+2; import os",
        "\x00",
    ],
)
def test_calc_refuses_everything_else_without_raising(expr):
    assert calc(expr) == ERROR


def test_calc_never_executes_code(tmp_path):
    marker = tmp_path / "ran"
    assert calc(f"__import__('pathlib').Path({str(marker)!r}).touch()") == ERROR
    assert not marker.exists()


def test_calc_takes_non_strings():
    assert calc(None) == ERROR  # type: ignore[arg-type]
    assert calc(b"1+1") == ERROR  # type: ignore[arg-type]


# ---------------------------------------------------------------- the workflow


def task(a: int = 37, b: int = 58) -> FakeTask:
    return FakeTask("calc-0", f"{a}*{b}=", str(a * b), {})


def play(script: list[str], max_calls: int = 2, t: FakeTask | None = None) -> FakeEpisode:
    t = t or task()
    ep = FakeEpisode(t.prompt, script)
    assert calculator_workflow(t, ep, max_calls=max_calls) is None  # taskset.reward scores last_text
    assert not ep.script, "the workflow stopped before the scripted turns ran out"
    return ep


def score(ep: FakeEpisode, t: FakeTask | None = None, finish: str = "stop") -> dict:
    t = t or task()
    return ArithmeticRewardFn()(t.prompt, ep.last_text, Task(t.task_id, t.prompt, t.answer), finish)


def test_tool_call_then_answer():
    ep = play(["<calc>37*58</calc>", "2146" + EOS_MARK])
    assert ep.events[1] == ("call", ("calc", ("37*58",)))
    assert ep.env_texts() == ["=2146\n"]
    assert ep.text() == "37*58=<calc>37*58</calc>=2146\n2146<|endoftext|>"
    assert ep.last_text == "2146"  # the answer turn only
    assert score(ep) == {"correct": 1.0, "format": 0.1}


def test_environment_tokens_are_masked_and_the_models_trained():
    ep = play(["<calc>37*58</calc>", "2146" + EOS_MARK])
    assert ep.masked_text() == "=2146\n"
    assert ep.trained_text() == "<calc>37*58</calc>2146<|endoftext|>"


def test_direct_answer_is_one_turn():
    ep = play(["2000" + EOS_MARK])
    assert ep.env_texts() == [] and ep.last_text == "2000"
    assert score(ep) == {"correct": 0.0, "format": 0.1}


def test_turns_stop_at_the_closing_tag_while_calls_are_left():
    ep = play(["<calc>37*58</calc>", "<calc>2146+0</calc>", "2146" + EOS_MARK], max_calls=2)
    assert ep.stops() == [["</calc>"], ["</calc>"], None]  # the last turn must answer
    assert ep.env_texts() == ["=2146\n", "=2146\n"]
    assert ep.last_text == "2146"


def test_max_calls_is_respected():
    # With one call left the second turn is generated without the stop: it is the answer, even
    # if the model writes another call (cut by the budget here).
    ep = play(["<calc>37*58</calc>", "<calc>37*58</calc>2146"], max_calls=1)
    assert [k for k, _ in ep.events].count("call") == 1 and ep.env_texts() == ["=2146\n"]
    assert ep.stops() == [["</calc>"], None]
    assert ep.last_text == "<calc>37*58</calc>2146"
    assert score(ep, finish="length")["correct"] == 0.0


def test_bad_expression_gets_the_error_reply():
    ep = play(["<calc>__import__('os')</calc>", "1" + EOS_MARK])
    assert ep.env_texts() == ["=error\n"] and ep.last_text == "1"


def test_closing_tag_without_an_opening_one_is_a_failed_call_not_an_answer():
    # "2146</calc>" must not score as the answer "2146": it is a call without an expression.
    ep = play(["2146</calc>", "7" + EOS_MARK])
    assert ep.env_texts() == ["=error\n"]
    assert [k for k, _ in ep.events].count("call") == 0  # nothing to evaluate: the tool is not called
    assert ep.last_text == "7"


def test_answer_cut_by_the_budget_is_the_answer():
    ep = play(["21462146"])
    assert ep.env_texts() == [] and ep.last_text == "21462146"


def test_text_before_the_call_is_not_part_of_the_expression():
    ep = play(["hm <calc>37*58</calc>", "2146" + EOS_MARK])
    assert ep.events[1] == ("call", ("calc", ("37*58",)))


def test_transcript_is_the_workflows_episode():
    """The warm start's examples are the token sequence the workflow builds, mask included."""
    segments = calculator_transcript(37, 58, True)
    ep = play([segments[0][0], segments[2][0] + EOS_MARK])
    assert "".join(text for text, _ in segments) == ep.text().removeprefix("37*58=").removesuffix("<|endoftext|>")
    assert ep.masked_text() == "".join(text for text, trained in segments if not trained)
    assert calculator_transcript(37, 58, False) == [("2146", True)]


# ---------------------------------------------------------------- tasks


def test_tasks_are_deterministic_and_well_formed():
    a, b = make_calculator_tasks(50, seed=3), make_calculator_tasks(50, seed=3)
    assert a == b and a != make_calculator_tasks(50, seed=4)
    for row in a:
        x, y = (int(v) for v in row["question"].removesuffix("=").split("*"))
        assert MIN_OPERAND <= x <= MAX_OPERAND and MIN_OPERAND <= y <= MAX_OPERAND
        assert row["answer"] == str(x * y) and set(row) == {"id", "question", "answer"}
    assert len({r["id"] for r in a}) == 50


def test_heldout_is_disjoint_from_train_whatever_the_seed():
    train, held = set(calculator_problems("train")), set(calculator_problems("heldout"))
    assert not train & held and len(train) + len(held) == 90 * 90
    assert 0.07 < len(held) / 8100 < 0.13
    assert all(is_heldout(a, b) == is_heldout(b, a) for a, b in held)  # "a*b" and "b*a" on one side
    asked = {r["question"] for s in range(5) for r in make_calculator_tasks(2000, seed=s)}
    held_questions = {r["question"] for r in make_calculator_tasks(None, split="heldout")}
    assert len(held_questions) == len(held) and not asked & held_questions


def test_make_tasks_cli(tmp_path, capsys):
    from rl_engine.rewards.make_tasks import main

    out = tmp_path / "calc.jsonl"
    assert main([str(out), "--task", "calculator", "--n", "7", "--seed", "1"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == make_calculator_tasks(7, seed=1)
    held = tmp_path / "held.jsonl"
    assert main(["--task", "calculator", str(held), "--split", "heldout"]) == 0
    assert len(held.read_text().splitlines()) == len(calculator_problems("heldout"))
    assert main([str(tmp_path / "arith.jsonl"), "--n", "3"]) == 0  # the default task still works
    assert "arithmetic" in capsys.readouterr().out


def test_make_tasks_refuses_bad_arguments():
    from rl_engine.errors import UserError

    with pytest.raises(UserError, match="--n"):
        make_calculator_tasks(0)
    with pytest.raises(UserError, match="--split"):
        make_calculator_tasks(3, split="test")


# ---------------------------------------------------------------- warm start


def test_warm_start_examples_mask_the_environments_tokens():
    from rl_engine.demos.warmstart import calculator_examples, encode_segments
    from rl_engine.tiny_model import build_tokenizer

    tok = build_tokenizer()
    examples = calculator_examples(200, seed=0)
    tool = [e for e in examples if len(e[1]) == 3]
    assert 0.3 < len(tool) / len(examples) < 0.5  # TOOL_RATE 0.4
    batch = encode_segments(tok, [tool[0]])
    ids, mask = batch["input_ids"][0].tolist(), batch["loss_mask"][0].tolist()
    prompt, segs = tool[0]
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == segs[0][0] + segs[2][0] + "<|endoftext|>"
    n = len(prompt)
    assert tok.decode([i for i, m in zip(ids[n:], mask[n:]) if not m]) == segs[1][0]


@pytest.mark.slow  # a DeepSpeed trainer on CPU: ~10 s on idle cores
def test_warm_start_writes_a_model(tmp_path):
    from transformers import AutoModelForCausalLM

    from rl_engine.demos.warmstart import main

    out = tmp_path / "calc-sft"
    assert (
        main(
            [
                str(out),
                "--task",
                "calculator",
                "--steps",
                "3",
                "--batch-size",
                "8",
                "--warmup-steps",
                "1",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    summary = json.loads((out / "warmstart.json").read_text())
    assert summary["task"] == "calculator" and summary["steps"] == 3
    for k in ("tool_rate", "success_with_tool", "success_without_tool", "expected_exact_t1", "greedy_exact"):
        assert 0.0 <= summary[k] <= 1.0, k
    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "qwen2"
