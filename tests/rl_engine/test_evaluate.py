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
            out.append(
                [
                    Rollout(
                        prompt_ids=list(p),
                        response_ids=[ord(c) for c in text],
                        logprobs=[0.0] * len(text),
                        finish_reason=reason,
                        version=0,
                        text=text,
                    )
                ]
                * n
            )
        return out


def test_exact_match_greedy_and_at_temperature_one():
    tasks = [Task("a", "1+1?", "2"), Task("b", "2+2?", "4"), Task("c", "3+3?", "6"), Task("d", "4+4?", "8")]
    engine = ScriptedEngine(
        greedy={
            "Q 1+1?": ("1 + 1 = 2", "stop"),
            "Q 2+2?": ("4", "stop"),
            "Q 3+3?": ("6 and on", "length"),
            "Q 4+4?": ("9", "stop"),
        },
        sampled={"Q 1+1?": ("2", "stop"), "Q 2+2?": ("5", "stop"), "Q 3+3?": ("x", "stop"), "Q 4+4?": ("8", "repeat")},
    )
    reward = build_reward(FinalAnswerReward(type="final_answer"))
    out = evaluate_engine(
        engine, tasks, reward, "final_answer", "Q {prompt}", max_tokens=7, max_model_len=64, seed=3, t1_samples=2
    )
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
    engine = ScriptedEngine(
        greedy={"x": ("y", "stop"), "z": ("q", "stop")}, sampled={"x": ("y", "stop"), "z": ("w", "stop")}
    )
    reward = build_reward(PythonReward(type="python", function="tests.rl_engine.test_evaluate:reward_half"))
    out = evaluate_engine(engine, tasks, reward, "python", "{prompt}", max_tokens=4, max_model_len=64)
    assert (out["greedy_exact"], out["t1_exact"]) == (0.5, 0.0)


# --------------------------------------------------------------------------- evaluation during training: the metrics


def test_pass_at_k_hand_values():
    from rl_engine.evaluate import pass_at_k

    # n = 4 samples, c correct: pass@k = 1 - C(4-c, k) / C(4, k)
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # 1 - 3/4
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)  # 1 - C(2,2)/C(4,2) = 1 - 1/6
    assert pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 3, 2) == 1.0  # fewer wrong than k: always a hit
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_set_metrics_hand_values():
    from rl_engine.evaluate import set_metrics

    # Two tasks, n = 4: task a right 3 times of 4, task b once; task c (listed) had every reward fail.
    samples = (
        [("a", True, 1.1, 2, "stop")] * 3
        + [("a", False, 0.1, 5, "length")]
        + [("b", True, 1.0, 3, "stop")]
        + [("b", False, 0.0, 3, "stop")] * 3
    )
    m = set_metrics(samples, 4, ["a", "b", "c"])
    assert m["tasks"] == 3
    assert m["avg@4"] == pytest.approx((3 + 1 + 0) / 12)
    assert m["pass@1"] == pytest.approx((0.75 + 0.25 + 0) / 3)  # avg@n's twin
    assert m["pass@2"] == pytest.approx((1.0 + 0.5 + 0) / 3)  # a: 1 - C(1,2)/C(4,2) = 1; b: 1 - C(3,2)/C(4,2) = 0.5
    assert m["pass@4"] == pytest.approx(2 / 3)
    assert m["reward_mean"] == pytest.approx((3 * 1.1 + 0.1 + 1.0) / 8)
    assert m["response_len_mean"] == pytest.approx((3 * 2 + 5 + 3 * 4) / 8)
    assert m["finish/stop"] == pytest.approx(7 / 8) and m["truncated_frac"] == pytest.approx(1 / 8)
    assert sorted(k for k in m if k.startswith("pass@")) == ["pass@1", "pass@2", "pass@4"]


def test_a_workflows_own_reward_counts_correct_at_one():
    from rl_engine.evaluate import _exact

    assert _exact("arithmetic", 1.1, {"correct": 1.0, "format": 0.1}) and not _exact(
        "arithmetic", 0.1, {"correct": 0.0, "format": 0.1}
    )
    assert _exact(
        "arithmetic", 1.1, {"hit": 1.0, "format": 0.1}
    )  # guess_number's reward through an arithmetic-scored run
    assert not _exact("arithmetic", 0.1, {"hit": 0.0, "format": 0.1})


def test_due_versions():
    from rl_engine.config import EvalConfig
    from rl_engine.roles.evaluation import due_versions

    cfg = EvalConfig(tasksets=[{"name": "h", "path": "h.jsonl"}], every_versions=4)
    assert due_versions(cfg, 10) == [0, 4, 8, 10]
    assert due_versions(cfg, 10, start=5) == [5, 8, 10]  # a resumed run starts at version 5
    assert due_versions(cfg.model_copy(update={"at_start": False, "at_end": False}), 12) == [4, 8, 12]
    assert due_versions(cfg.model_copy(update={"every_versions": None}), 7) == [0, 7]


def test_eval_config_is_checked(tiny_model_dir):
    from rl_engine.config import ConfigError, validate_config

    base = {"model": {"path": tiny_model_dir}, "taskset": {"path": "t.jsonl"}}
    sets = [{"name": "heldout", "path": "h.jsonl", "n": 4}]
    with pytest.raises(ConfigError, match=r"eval.every_versions = 3: .*synchronizer.sync_interval = 2"):
        validate_config(
            {
                **base,
                "synchronizer": {"mode": "synchronous", "sync_interval": 2},
                "eval": {"tasksets": sets, "every_versions": 3},
            }
        )
    with pytest.raises(ConfigError, match=r"no eval set named 'other'"):
        validate_config({**base, "eval": {"tasksets": sets, "keep_best": {"metric": "other/pass@1"}}})
    with pytest.raises(ConfigError, match=r"k must be <= n"):
        validate_config({**base, "eval": {"tasksets": sets, "keep_best": {"metric": "heldout/pass@8"}}})
    with pytest.raises(ConfigError, match=r"write `<set name>/<metric>`"):
        validate_config({**base, "eval": {"tasksets": sets, "keep_best": {"metric": "heldout/accuracy"}}})
    with pytest.raises(ConfigError, match=r"greedy samples are identical"):
        validate_config({**base, "eval": {"tasksets": [{"name": "g", "path": "h.jsonl", "n": 2, "temperature": 0}]}})
    with pytest.raises(ConfigError, match=r"lineage.promote = best needs eval.keep_best"):
        validate_config({**base, "lineage": {"name": "x", "promote": "best"}})
    ok = validate_config(
        {
            **base,
            "eval": {"tasksets": sets, "every_versions": 5, "keep_best": {"metric": "heldout/pass@4", "mode": "max"}},
        }
    )
    assert ok.eval.enabled and ok.eval.keep_best.metric == "heldout/pass@4"


@pytest.mark.slow
def test_rft_eval_a_model_directory(tiny_model_dir, tmp_path, capsys):
    """The README's `rft eval MODEL --config CONFIG --taskset FILE --n N`: one version (0), every metric."""
    import json
    from pathlib import Path

    from cli.main import main as rft
    from rl_engine.demos.arithmetic import write_arithmetic_taskset

    tasks = write_arithmetic_taskset(str(tmp_path / "heldout.jsonl"), n=6, seed=5)
    config = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
    assert (
        rft(["eval", tiny_model_dir, "--config", str(config), "--taskset", tasks, "--n", "2", "--max-tasks", "4"]) == 0
    )
    (record,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["versions"]
    assert record["version"] == 0 and record["weights"] == tiny_model_dir and record["heldout/tasks"] == 4
    assert {
        "heldout/avg@2",
        "heldout/pass@1",
        "heldout/pass@2",
        "heldout/reward_mean",
        "heldout/response_len_mean",
    } <= set(record)


def test_rft_eval_refuses_what_it_cannot_score(tiny_model_dir, tmp_path):
    from rl_engine.errors import UserError
    from rl_engine.roles.evaluate_run import main

    with pytest.raises(UserError, match="a model directory needs --config"):
        main([tiny_model_dir, "--taskset", "h.jsonl"])
    with pytest.raises(UserError, match="neither a model directory .* nor a run"):
        main([str(tmp_path), "--taskset", "h.jsonl"])


def test_the_readme_eval_config_validates(tiny_model_dir):
    import re
    from pathlib import Path

    import yaml

    from rl_engine.config import validate_config

    section = (
        (Path(__file__).resolve().parents[2] / "docs" / "guides" / "evaluation.md")
        .read_text()
        .split("## Evaluation during training", 1)[1]
    )
    shown = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.DOTALL).group(1))
    cfg = validate_config({"model": {"path": tiny_model_dir}, "taskset": {"path": "t.jsonl"}, **shown})
    assert (
        cfg.eval.every_versions == 5 and cfg.eval.keep_best.metric == "heldout/pass@1" and cfg.eval.tasksets[0].n == 4
    )
