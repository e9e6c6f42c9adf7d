"""The model reward (rl_engine/rewards/reward_model.py) and its service process
(reward_model_server.py), on a tiny randomly initialised sequence classifier built here: the
service's scores are the model's own, in order, across batches; two clients share one service;
a slow service times out into failed_reward; a killed one fails the step or scores failed_reward,
as configured, and is started again; nothing is left running after close; preflight refuses a
directory that is not a one-label classifier.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import psutil
import pytest

from rl_engine.config import ModelReward
from rl_engine.errors import UserError
from rl_engine.rewards import RewardError, RolloutSample, Task, build_reward, score_rollouts
from rl_engine.rewards.reward_model import ModelRewardFn, RunningMoments, check_classifier
from rl_engine.rewards.reward_model_server import DELAY_ENV, format_pair, load_scorer, score_pairs
from rl_engine.tiny_model import make_tiny_classifier

PAIRS = [
    ("1+1=", "2"),
    ("what is twelve plus thirty?", " 42, because 12 + 30 = 42"),
    ("", "x"),
    ("a long prompt " * 6, "and a short answer"),
    ("q", ""),
    ("7*6=", "42" * 10),
    ("last", " one"),
]


def make_classifier(out, num_labels: int = 1) -> str:
    """A randomly initialised Qwen2 sequence classifier (hidden 32, 2 layers) with the tiny byte tokenizer."""
    return str(make_tiny_classifier(out, num_labels=num_labels))


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory) -> str:
    return make_classifier(tmp_path_factory.mktemp("rm") / "rm")


def direct_scores(path: str, pairs) -> list[float]:
    """Each pair scored alone, unpadded, by the model in this process: logits[:, 0]."""
    import torch

    model, tok = load_scorer(path)
    out = []
    for p, r in pairs:
        text, templated = format_pair(tok, p, r)
        enc = tok(text, return_tensors="pt", add_special_tokens=not templated)  # [1, L]
        with torch.inference_mode():
            out.append(float(model(**enc).logits[0, 0]))
    return out


def samples(pairs=PAIRS) -> list[RolloutSample]:
    return [RolloutSample(p, r, Task(f"t{i}", p, None, {}), "stop") for i, (p, r) in enumerate(pairs)]


@pytest.mark.slow
def test_scores_are_the_models_own_in_order_across_batches(rm_dir):
    fn = ModelRewardFn(rm_dir, batch_size=3, max_length=256)
    try:
        result = score_rollouts(fn, samples())
    finally:
        fn.close()
    want = direct_scores(rm_dir, PAIRS)
    assert len(set(want)) == len(want)  # distinct scores: an order mix-up would show
    assert result.rewards == pytest.approx(want, abs=1e-5)
    m = result.metrics
    assert m["reward/count"] == 7 and m["reward/model/failures"] == m["reward/model/timeouts"] == 0
    assert m["reward/model/batch_size"] == pytest.approx(7 / 3)  # batches of 3, 3, 1
    assert m["reward/model/latency_ms"] > 0 and m["reward/model/samples_per_s"] > 0


def test_chat_template_renders_the_pair_as_user_and_assistant(rm_dir):
    model, tok = load_scorer(rm_dir)
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    text, templated = format_pair(tok, "1+1=", "2")
    assert (text, templated) == ("<user>1+1=<assistant>2", True)
    batch = score_pairs(model, tok, [("1+1=", "2"), ("a", "bcd")], max_length=64)
    enc = tok("<user>1+1=<assistant>2", return_tensors="pt", add_special_tokens=False)  # [1, L]
    assert batch[0] == pytest.approx(float(model(**enc).logits[0, 0].detach()), abs=1e-5)


def test_long_pairs_keep_their_last_tokens(rm_dir):
    model, tok = load_scorer(rm_dir)
    long = ("x" * 100, "the end")
    cut = score_pairs(model, tok, [long], max_length=20)
    assert cut == pytest.approx(score_pairs(model, tok, [("", ("x" * 100 + "the end")[-20:])], max_length=64), abs=1e-5)


@pytest.mark.slow
def test_two_clients_share_one_service(rm_dir):
    a, b = (ModelRewardFn(rm_dir, batch_size=4, max_length=256) for _ in range(2))
    results: dict[str, list] = {}

    def score(name, fn, pairs):
        results[name] = score_rollouts(fn, samples(pairs)).rewards

    try:
        threads = [
            threading.Thread(target=score, args=("a", a, PAIRS[:4])),
            threading.Thread(target=score, args=("b", b, PAIRS[4:])),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert a._service is b._service and a._service.refs == 2
        proc = a._service.proc
    finally:
        a.close()
        assert proc.poll() is None  # b still holds it
        b.close()
    assert proc.wait(10) is not None  # the last client stopped it: nothing left running
    left = [p for p in psutil.Process().children(recursive=True) if "reward_model_server" in " ".join(p.cmdline())]
    assert left == []
    want = direct_scores(rm_dir, PAIRS)
    assert results["a"] + results["b"] == pytest.approx(want, abs=1e-5)


@pytest.mark.slow
def test_a_slow_service_times_out_into_failed_reward(rm_dir, monkeypatch):
    monkeypatch.setenv(DELAY_ENV, "30")  # every batch waits 30 s: far past the 0.5 s timeout
    fn = ModelRewardFn(rm_dir, batch_size=2, max_length=128, timeout_s=0.5)
    try:
        scored = score_rollouts(fn, samples(), failed_reward=-1.0)
        assert scored.rewards == [-1.0] * 7
        assert scored.metrics["reward/timeouts"] == scored.metrics["reward/model/timeouts"] == 7
        with pytest.raises(
            RewardError, match="the reward service of .* did not return within taskset.reward.timeout_s = 0.5"
        ):
            score_rollouts(fn, samples(PAIRS[:2]))  # no failed_reward: nothing scored fails the step
    finally:
        proc = fn._service.proc
        fn.close()
    assert proc.poll() is not None


def kill_service(fn: ModelRewardFn) -> None:
    """SIGKILL `fn`'s service, which still looks alive to the registry: it died between the
    registry's look and the request (the request finds it gone)."""
    svc = fn._service
    os.kill(svc.proc.pid, signal.SIGKILL)
    svc.proc.wait(10)
    svc.proc.poll = lambda: None


@pytest.mark.slow
def test_a_killed_service_scores_failed_reward_or_fails_the_step(rm_dir):
    scoring = ModelRewardFn(rm_dir, batch_size=6, max_length=128)
    failing = ModelRewardFn(rm_dir, batch_size=6, max_length=128, on_failure="fail")
    try:
        scoring.score_samples(samples(PAIRS[:1]))
        first = scoring._service
        kill_service(scoring)
        result = score_rollouts(scoring, samples(), failed_reward=0.0)
        assert result.rewards == [0.0] * 7
        assert result.metrics["reward/crashes"] == result.metrics["reward/model/failures"] == 7
        del first.proc.poll  # dead to the registry now: the next step starts a new service
        assert score_rollouts(failing, samples(PAIRS[:2])).ok == [True, True]
        assert failing._service is not first and failing._service.refs == 1
        kill_service(failing)
        with pytest.raises(
            RewardError, match="the reward service of taskset.reward.path = .* failed .*cannot be reached"
        ):
            score_rollouts(failing, samples(), failed_reward=0.0)
    finally:
        scoring.close()
        failing.close()


def test_preflight_refuses_what_is_not_a_one_label_classifier(tmp_path, rm_dir):
    with pytest.raises(UserError, match="taskset.reward.path = .*no config.json"):
        ModelRewardFn(str(tmp_path))
    lm = tmp_path / "lm"
    lm.mkdir()
    (lm / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    with pytest.raises(UserError, match=r"taskset.reward.path = .*ForSequenceClassification.*num_labels=1"):
        build_reward(ModelReward(type="model", path=str(lm)))
    two = make_classifier(tmp_path / "two", num_labels=2)
    with pytest.raises(UserError, match="a classifier with 2 labels"):
        check_classifier(two)
    check_classifier(rm_dir)


def test_running_normalization_is_welfords():
    import numpy as np

    xs = [0.5, -1.0, 2.0, 3.5, 0.0]
    m = RunningMoments()
    out = []
    for x in xs:
        m.add(x)
        out.append(m.normalize(x))
    assert m.mean == pytest.approx(np.mean(xs)) and m.std == pytest.approx(np.std(xs))
    assert out[0] == 0.0  # one value: centred, no spread to divide by
    assert out[-1] == pytest.approx((0.0 - np.mean(xs)) / np.std(xs))


def test_running_normalization_counts_the_whole_step(rm_dir):
    from rl_engine.rewards.isolation import UserCodeTimeout

    fn = ModelRewardFn(rm_dir, normalize="running")  # no service: the rewards of given scores
    timeout = UserCodeTimeout("slow")
    assert fn._rewards([1.0, 3.0, timeout]) == [
        (-1.0, {}),
        (1.0, {}),
        timeout,
    ]  # mean 2, std 1: the failure counts nowhere
    assert fn._rewards([2.0]) == [(0.0, {})]  # mean of 1, 3, 2
    assert ModelRewardFn(rm_dir)._rewards([1.5, timeout]) == [(1.5, {}), timeout]  # normalize none: the raw score


def test_the_config_variant_builds_the_reward(rm_dir):
    from rl_engine.config import RFTConfig

    cfg = RFTConfig.model_validate(
        {"model": {"path": rm_dir}, "taskset": {"path": "t.jsonl", "reward": {"type": "model", "path": rm_dir}}}
    )
    fn = build_reward(cfg.taskset.reward)
    assert (
        isinstance(fn, ModelRewardFn) and fn.settings["batch_size"] == 16 and fn._service is None
    )  # started on first use
    with pytest.raises(Exception, match="normalize"):
        ModelReward(type="model", path=rm_dir, normalize="zscore")


OWNER = """
import os, sys
from rl_engine.rewards import RolloutSample, Task
from rl_engine.rewards.reward_model import ModelRewardFn
fn = ModelRewardFn(sys.argv[1], batch_size=2, max_length=64)
fn.score_samples([RolloutSample("1+1=", "2", Task("t", "1+1=", None, {}), "stop")])
print(fn._service.proc.pid, flush=True)
os.kill(os.getpid(), 9)
"""


@pytest.mark.slow
def test_the_service_stops_when_the_process_that_started_it_is_killed(rm_dir):
    import subprocess
    import sys

    owner = subprocess.run([sys.executable, "-c", OWNER, rm_dir], capture_output=True, text=True, timeout=120)
    assert owner.returncode == -signal.SIGKILL, owner.stderr[-2000:]
    try:
        service = psutil.Process(int(owner.stdout.split()[0]))
    except psutil.NoSuchProcess:
        return  # gone already
    psutil.wait_procs([service], timeout=30)  # its owner watch polls every 0.5 s
    assert not service.is_running() or service.status() == psutil.STATUS_ZOMBIE


class Recorded:
    """A batch reward's samples and outcomes as scoring asks for them (the real reward underneath)."""

    def __init__(self, reward):
        self.reward, self.samples, self.outcomes = reward, [], []

    def score_samples(self, samples):
        outcomes, metrics = self.reward.score_samples(samples)
        self.samples += list(samples)
        self.outcomes += outcomes
        return outcomes, metrics

    def __call__(self, *args, **kwargs):
        return self.reward(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.reward, name)


@pytest.mark.slow
def test_an_eval_set_scored_by_the_reward_model(rm_dir, engine, tiny_model_dir, task_file):
    """`eval.tasksets[].reward: {type: model}`: the set's samples, drawn on the (shared) engine,
    are scored by the classifier's service (each reward the model's own score of that prompt and
    response), and the set's reward_mean is their mean; the run's own reward stays the rule."""
    from rl_engine.roles.evaluation import eval_tasks, score_set
    from tests.rl_engine.rollout.engines import make_config

    cfg = make_config(
        tiny_model_dir,
        taskset={"path": task_file},
        eval={
            "tasksets": [
                {"name": "rm", "path": task_file, "n": 2, "max_tasks": 3, "reward": {"type": "model", "path": rm_dir}}
            ]
        },
    )
    (s,) = cfg.eval.tasksets
    tasks, fn = eval_tasks(cfg, s, None)
    assert isinstance(fn, ModelRewardFn) and len(tasks) == 3
    recorded = Recorded(fn)
    try:
        metrics = score_set(engine, cfg, s, (tasks, recorded), engine.version)
    finally:
        fn.close()
    assert len(recorded.samples) == 6 and all(not isinstance(o, Exception) for o in recorded.outcomes)
    got = [o[0] for o in recorded.outcomes]
    assert got == pytest.approx(direct_scores(rm_dir, [(x[0], x[1]) for x in recorded.samples]), abs=1e-5)
    assert metrics["reward_mean"] == pytest.approx(sum(got) / len(got), abs=1e-6)
    assert cfg.taskset.reward.type != "model"
