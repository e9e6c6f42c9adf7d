"""The workflow runtime: episodes' turns batched into engine calls, token in / token out, failures per episode.

The unit tests drive `run_episodes` with a scripted engine (its answers are a function of the
turn's seed, so batching may not change them); the `slow` ones with the session's vLLM engine,
comparing the trainer's view of the rows with what was sampled and appended.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rl_engine.config import SamplingConfig
from rl_engine.experience import ExperienceBatch
from rl_engine.rewards import Task
from rl_engine.roles.episodes import episode_generation
from rl_engine.roles.groups import Group, experience_row
from rl_engine.rollout.engine import Rollout
from rl_engine.rollout.workflow import EpisodeJob, run_episodes
from rl_engine.tiny_model import build_tokenizer

SAMPLING = SamplingConfig(temperature=1.0, max_tokens=4)


class ScriptedEngine:
    """generate_each answers every request with 3 tokens derived from its seed; records call sizes."""

    def __init__(self, version: int = 7):
        self.tokenizer = build_tokenizer()
        self.version = version
        self.calls: list[int] = []

    def generate_each(self, requests):
        self.calls.append(len(requests))
        out = []
        for ids, sampling, seed in requests:
            new = [10 + seed % 50, 11 + seed % 40, 12 + seed % 30][: sampling.max_tokens]
            out.append(Rollout(list(ids), new, [-0.5] * len(new), "stop", self.version, self.tokenizer.decode(new)))
        return out


def jobs(n: int) -> list[EpisodeJob]:
    return [EpisodeJob(Task(f"t{i}", "q", "a"), "q", [5, 6], seed=100 + i) for i in range(n)]


def two_turns(task, episode):
    episode.generate()
    episode.append_text("ok\n")
    episode.generate(max_tokens=2)
    return 1.0


def test_turns_are_batched_and_env_tokens_masked():
    eng = ScriptedEngine()
    res = run_episodes(eng, two_turns, jobs(5), SAMPLING, max_model_len=64, episode_timeout_s=5)
    assert eng.calls == [5, 5]  # every episode's turn 1 in one call, then every turn 2
    env = eng.tokenizer.encode("ok\n", add_special_tokens=False)
    for r in res:
        assert r.error is None and r.turns == 2 and r.reward == 1.0
        assert r.response_ids[3:6] == env
        assert r.loss_mask == [1, 1, 1] + [0] * len(env) + [1, 1]
        assert r.logprobs[3:6] == [0.0] * len(env)
        assert r.versions == [7] * len(r.response_ids)


def test_a_turns_sample_does_not_depend_on_the_batch():
    alone = run_episodes(ScriptedEngine(), two_turns, jobs(1), SAMPLING, 64, 5)[0]
    among = run_episodes(ScriptedEngine(), two_turns, jobs(4), SAMPLING, 64, 5)[0]
    assert alone.response_ids == among.response_ids
    # Different episodes and turns get different seeds.
    res = run_episodes(ScriptedEngine(), two_turns, jobs(3), SAMPLING, 64, 5)
    assert len({tuple(r.response_ids) for r in res}) == 3
    assert res[0].response_ids[:3] != res[0].response_ids[-2:] + [0]


def test_a_raising_episode_fails_alone_and_others_finish():
    def flaky(task, episode):
        episode.generate()
        if task.task_id == "t1":
            raise RuntimeError("environment broke")
        episode.generate()
        return 0.5

    res = run_episodes(ScriptedEngine(), flaky, jobs(3), SAMPLING, 64, 5)
    assert res[1].error == "RuntimeError: environment broke"
    assert [r.error for r in (res[0], res[2])] == [None, None] and res[0].turns == 2


def test_a_hanging_episode_times_out_without_holding_the_others():
    release = threading.Event()

    def hangs(task, episode):
        episode.generate()
        if task.task_id == "t0":
            release.wait(30)  # its own code never returns to the model within the timeout
        episode.generate()
        return 1.0

    started = time.monotonic()
    try:
        res = run_episodes(ScriptedEngine(), hangs, jobs(3), SAMPLING, 64, episode_timeout_s=0.5)
    finally:
        release.set()
    assert time.monotonic() - started < 10
    assert "episode_timeout_s" in res[0].error
    assert [r.turns for r in res[1:]] == [2, 2] and res[1].error is None


def test_context_full_ends_the_episode_as_truncated():
    def chatty(task, episode):
        while True:
            episode.generate()
            episode.append_text("more ")

    res = run_episodes(ScriptedEngine(), chatty, jobs(2), SAMPLING, max_model_len=20, episode_timeout_s=5)
    for r in res:
        assert r.error is None and r.finish_reason == "truncated"
        assert len(r.prompt_ids) + len(r.response_ids) == 20
        assert len(r.loss_mask) == len(r.response_ids) == len(r.logprobs) == len(r.versions)


def test_an_engine_failure_fails_the_step():
    class Dead(ScriptedEngine):
        def generate_each(self, requests):
            raise RuntimeError("engine died")

    with pytest.raises(RuntimeError, match="engine died"):
        run_episodes(Dead(), two_turns, jobs(2), SAMPLING, 64, 5)


# --------------------------------------------------------------------------- with vLLM


def calc_like(task, episode):
    """A tool-using shape on an untrained model: a turn, the environment's answer, a last turn."""
    first = episode.generate(max_tokens=6, stop=["7"])
    episode.append_text(f"[{len(first.ids)}]=")
    episode.generate(max_tokens=5)
    return None


@pytest.mark.slow
def test_token_in_token_out_on_vllm(engine, tiny_model_dir):
    """The ids the trainer sees are the sampled ids plus the environment's, the mask covers exactly
    the environment's tokens, and the trainer's logprobs of the sampled tokens equal vLLM's."""
    from transformers import AutoModelForCausalLM

    tok = engine.tokenizer
    prompt = tok.encode("12+7=", add_special_tokens=False)
    res = run_episodes(engine, calc_like, [EpisodeJob(Task(f"t{i}", "12+7=", "19"), "12+7=", prompt, seed=i) for i in range(6)], SAMPLING, 128, 30)
    task = Task("t", "12+7=", "19")
    g = Group("g", task, "12+7=", [episode_generation(1, r) for r in res])
    batch = ExperienceBatch.from_experiences([experience_row(g, m, 0, 1, 0.0, {}, "", 0.0) for m in g.members])
    t = batch.to_tensors(pad_id=tok.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=t["input_ids"], attention_mask=t["attention_mask"]).logits[:, :-1].float(), -1)  # [B, L-1, V]
    logp = logp.gather(-1, t["input_ids"][:, 1:, None])[..., 0]  # [B, L-1]: logprob of token i+1
    for b, r in enumerate(res):
        assert r.error is None and r.turns == 2
        n = len(r.prompt_ids) + len(r.response_ids)
        assert t["input_ids"][b, :n].tolist() == r.prompt_ids + r.response_ids
        first_len = r.loss_mask.index(0)
        env = tok.encode(f"[{first_len}]=", add_special_tokens=False)
        assert r.response_ids[first_len : first_len + len(env)] == env
        mask = t["loss_mask"][b, len(r.prompt_ids) : n].tolist()
        assert mask == [1.0] * first_len + [0.0] * len(env) + [1.0] * (len(r.response_ids) - first_len - len(env))
        trained = t["loss_mask"][b, 1:n] > 0  # positions 1..n-1 whose token is the policy's
        gap = (logp[b, : n - 1][trained] - t["behavior_logprobs"][b, 1:n][trained]).abs().max().item()
        assert gap < 1e-3, gap


def test_the_readme_workflow_and_its_config(tiny_model_dir):
    """The README's example workflow runs as shown, and its YAML validates."""
    import re
    from pathlib import Path

    import yaml

    from rl_engine.config import validate_config

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    section = readme.split("## Multi-turn workflows and tools", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    config = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))
    scope: dict = {}
    exec(code, scope)  # noqa: S102 - the README's own example
    eng = ScriptedEngine()
    res = run_episodes(eng, lambda t, ep: scope["play"](t, ep, max_turns=3), jobs(2), SAMPLING, 64, 5)
    no = eng.tokenizer.encode(" no\n", add_special_tokens=False)
    for r in res:
        assert r.error is None and r.turns == 3 and r.reward == 0.0  # the scripted model never says "a"
        assert r.loss_mask.count(0) == 3 * len(no)
    cfg = validate_config({"model": {"path": tiny_model_dir}, "taskset": {"path": "t.jsonl", **config["taskset"]}})
    assert cfg.taskset.workflow.function == "my_env.game:play" and cfg.taskset.user_code.failed_reward == 0.0
