"""Held-out evaluation (rl_engine.evaluate): greedy and temperature-1 exact match, scored by the run's
reward on what the engine generated. A stand-in engine answers from a script (the real engine's path
runs in tests/flows/test_demo_real.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from rl_engine.config import FinalAnswerReward, PythonReward
from rl_engine.evaluate import evaluate_engine
from rl_engine.rewards import Task, build_reward
from rl_engine.rollout.engine import Rollout


class CharTokenizer:
    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = True):
        assert not add_special_tokens  # the explorer's tokenization: the template holds every special token
        return type("Enc", (), {"input_ids": [ord(c) for c in text]})()


@dataclass
class ScriptedEngine:
    """Greedy answers and temperature-1 answers by prompt text; records the calls."""

    greedy: dict[str, tuple[str, str]]
    sampled: dict[str, tuple[str, str]]
    tokenizer = CharTokenizer()

    def __post_init__(self):
        self.calls = []

    def generate(self, prompts, n, sampling, seed):
        self.calls.append((sampling.temperature, n, sampling.max_tokens))
        script = self.greedy if sampling.temperature == 0 else self.sampled
        out = []
        for p in prompts:
            text, reason = script["".join(map(chr, p))]
            out.append([Rollout(prompt_ids=list(p), response_ids=[ord(c) for c in text], logprobs=[0.0] * len(text), finish_reason=reason, version=0, text=text)] * n)
        return out


def test_exact_match_greedy_and_at_temperature_one():
    tasks = [Task("a", "1+1?", "2"), Task("b", "2+2?", "4"), Task("c", "3+3?", "6"), Task("d", "4+4?", "8")]
    engine = ScriptedEngine(
        greedy={"Q 1+1?": ("1 + 1 = 2", "stop"), "Q 2+2?": ("4", "stop"), "Q 3+3?": ("6 and on", "length"), "Q 4+4?": ("9", "stop")},
        sampled={"Q 1+1?": ("2", "stop"), "Q 2+2?": ("5", "stop"), "Q 3+3?": ("x", "stop"), "Q 4+4?": ("8", "repeat")},
    )
    reward = build_reward(FinalAnswerReward(type="final_answer"))
    out = evaluate_engine(engine, tasks, reward, "final_answer", "Q {prompt}", max_tokens=7, max_model_len=64, seed=3, t1_samples=2)
    assert engine.calls == [(0.0, 1, 7), (1.0, 2, 7)]
    assert out["tasks"] == 4
    assert out["greedy_exact"] == 0.5  # a (last number), b; c was cut by the budget, d is wrong
    assert out["t1_exact"] == 0.25  # a only: d's right number came with a repetition stop
    assert out["greedy_reward"] == pytest.approx((1.1 + 1.1 + 0.0 + 0.1) / 4)
    assert out["greedy_response_tokens"] == pytest.approx((9 + 1 + 8 + 1) / 4)


def reward_half(prompt, response, task):
    return 0.5 if response == task.answer else 1.0


def test_a_user_reward_counts_as_exact_at_a_total_of_one():
    tasks = [Task("a", "x", "y"), Task("b", "z", "w")]
    engine = ScriptedEngine(greedy={"x": ("y", "stop"), "z": ("q", "stop")}, sampled={"x": ("y", "stop"), "z": ("w", "stop")})
    reward = build_reward(PythonReward(type="python", function="tests.rl_engine.test_evaluate:reward_half"))
    out = evaluate_engine(engine, tasks, reward, "python", "{prompt}", max_tokens=4, max_model_len=64)
    assert (out["greedy_exact"], out["t1_exact"]) == (0.5, 0.0)
