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
    assert res[0].response_ids[:2] != res[0].response_ids[-2:]  # turn 2 has a seed of its own


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


def _stuck_sleep(stop):
    time.sleep(30)


def _stuck_busy(stop):
    while not stop.is_set():  # pure Python: holds the GIL between switches
        pass


def _stuck_io(stop):
    import socket

    a, b = socket.socketpair()
    with a, b:
        a.settimeout(30)
        try:
            a.recv(1)  # nobody ever writes
        except OSError:
            pass


def _stuck_thread(stop):
    t = threading.Thread(target=stop.wait, args=(30,), daemon=True)
    t.start()
    t.join()  # waits on a thread of its own


def _stuck_subprocess(stop):
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", "import time; time.sleep(30)"], timeout=30)


@pytest.mark.parametrize(
    "stuck", [_stuck_sleep, _stuck_busy, _stuck_io, _stuck_thread, _stuck_subprocess], ids=lambda f: f.__name__[7:]
)
def test_the_episode_timeout_bounds_whatever_the_workflow_does(stuck, caplog):
    """Issue 45: 16 episodes whose code never gives control back (before their first model call
    or after it) all end as timed out within about the timeout, each logged as it is abandoned;
    the 16 stuck threads used to cost a second's wait each after the step. Spinning threads take
    the GIL from the step's own thread: 4 of them, so a loaded machine still tells the bound."""
    n = 4 if stuck is _stuck_busy else 16
    stop = threading.Event()

    def workflow(task, episode):
        if int(task.task_id[1:]) % 2:
            episode.generate()  # half of them after a turn, half before their first
        stuck(stop)
        return 1.0

    started = time.monotonic()
    try:
        with caplog.at_level("WARNING", logger="rl_engine.rollout.workflow"):
            res = run_episodes(ScriptedEngine(), workflow, jobs(n), SAMPLING, 64, episode_timeout_s=0.5)
    finally:
        stop.set()
    took = time.monotonic() - started
    assert all("episode_timeout_s = 0.5" in r.error for r in res), [r.error for r in res]
    assert [r.turns for r in res] == [i % 2 for i in range(n)]
    abandoned = [m for m in caplog.messages if "abandoned" in m]
    assert len(abandoned) == n and "task t0" in abandoned[0]
    assert took < 12, f"{took:.1f} s for {n} episodes stuck past a 0.5 s timeout (a wait of 1 s each: {n} s)"


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
    """A tool-using shape on an untrained model: a turn, the tool's answer (computed in the
    user-code pool), a last turn."""
    from rl_engine.demos.calculator import calc

    episode.generate(max_tokens=6, stop=["7"])
    episode.append_text("=" + episode.call(calc, "3*4") + "\n")
    episode.generate(max_tokens=5)


def recording(workflow, appended: dict):
    """`workflow` with every text the environment appends recorded per task."""

    def run(task, episode):
        plain = episode.append_text

        def append_text(text):
            appended.setdefault(task.task_id, []).append(text)
            return plain(text)

        episode.append_text = append_text
        return workflow(task, episode)

    return run


@pytest.mark.slow
@pytest.mark.parametrize("example", ["tool_call", "guess_number"])
def test_token_in_token_out_on_vllm(example, engine, tiny_model_dir):
    """For each example, the ids the trainer sees are exactly the ids sampled plus the
    environment's, the mask covers exactly the environment's tokens, and the trainer's logprobs
    of the sampled tokens equal vLLM's (the sync tests' tolerance)."""
    from transformers import AutoModelForCausalLM

    from rl_engine.demos.guess_number import guess_number_workflow
    from rl_engine.rewards.isolation import UserCodePool

    tok = engine.tokenizer
    appended: dict = {}
    workflow = recording(
        calc_like if example == "tool_call" else lambda t, ep: guess_number_workflow(t, ep, max_turns=3), appended
    )
    prompt = tok.encode("guess 1..15\n", add_special_tokens=False)
    jobs_ = [EpisodeJob(Task(f"t{i}", "guess 1..15\n", "11"), "guess 1..15\n", prompt, seed=i) for i in range(6)]
    with UserCodePool(1, "test") as pool:
        res = run_episodes(engine, workflow, jobs_, SAMPLING, 128, 30, pool=pool)
    g = Group("g", jobs_[0].task, "q", [episode_generation(1, r) for r in res])
    batch = ExperienceBatch.from_experiences([experience_row(g, m, 0, 1, 0.0, {}, "", 0.0) for m in g.members])
    t = batch.to_tensors(pad_id=tok.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(
            model(input_ids=t["input_ids"], attention_mask=t["attention_mask"]).logits[:, :-1].float(), -1
        )  # [B, L-1, V]
    logp = logp.gather(-1, t["input_ids"][:, 1:, None])[..., 0]  # [B, L-1]: logprob of token i+1
    assert sum(len(v) for v in appended.values()) > 0, "the environment spoke in some episode"
    for b, (r, job) in enumerate(zip(res, jobs_)):
        assert r.error is None and r.turns >= 1
        n = len(r.prompt_ids) + len(r.response_ids)
        assert t["input_ids"][b, :n].tolist() == r.prompt_ids + r.response_ids  # what the trainer sees
        env_ids = [i for i, m in zip(r.response_ids, r.loss_mask) if m == 0]
        assert env_ids == [
            i for text in appended.get(job.task.task_id, []) for i in tok.encode(text, add_special_tokens=False)
        ]
        assert t["loss_mask"][b, len(r.prompt_ids) : n].tolist() == [float(m) for m in r.loss_mask]
        assert sum(r.loss_mask) > 0 and all(lp == 0.0 for lp, m in zip(r.logprobs, r.loss_mask) if m == 0)
        trained = t["loss_mask"][b, 1:n] > 0  # positions 1..n-1 whose token the policy sampled
        gap = (logp[b, : n - 1][trained] - t["behavior_logprobs"][b, 1:n][trained]).abs().max().item()
        assert gap < 1e-3, gap


# --------------------------------------------------------------------------- chat turns, class workflows, failed episodes

CHATML = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
TURN_COUNTER = "{{ '<|im_start|>system\\nTurn ' + (messages | length) | string + '<|im_end|>\\n' }}" + CHATML


def chat_jobs(eng, n: int) -> list[EpisodeJob]:
    from rl_engine.rollout.chat import chat_prompt_ids

    messages = [{"role": "user", "content": "q"}]
    return [
        EpisodeJob(
            Task(f"t{i}", "q", "a"), "q", chat_prompt_ids(eng.tokenizer, messages, "tiny-chat"), 100 + i, messages
        )
        for i in range(n)
    ]


def chat_engine(template: str) -> ScriptedEngine:
    eng = ScriptedEngine()
    eng.tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    eng.tokenizer.chat_template = template
    return eng


def test_chat_turns_render_only_whats_new_and_equal_the_whole_rendering():
    from rl_engine.config import PythonWorkflow
    from rl_engine.rollout.workflow import build_workflow

    eng = chat_engine(CHATML)
    game = build_workflow(
        PythonWorkflow(type="python", function="tests.rl_engine.rollout.user_workflows:Game", kwargs={"turns": 2})
    )  # a class
    res = run_episodes(eng, game, chat_jobs(eng, 2), SAMPLING, 128, 5, model="tiny-chat")
    tok = eng.tokenizer
    for r in res:
        assert r.error is None and r.reward == {"played": 2.0} and r.turns == 2
        sampled = [r.response_ids[i] for i, m in enumerate(r.loss_mask) if m]  # [turn 1 (2 ids), turn 2 (2 ids)]
        chat = [{"role": "user", "content": "q"}]
        for k in range(2):
            chat += [
                {"role": "assistant", "content": tok.decode(sampled[2 * k : 2 * k + 2])},
                {"role": "user", "content": "again"},
            ]
        whole = tok(
            tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True), add_special_tokens=False
        )["input_ids"]
        assert r.prompt_ids + r.response_ids == whole  # token in / token out: nothing re-tokenised, nothing lost
        assert r.loss_mask[:2] == [1, 1] and r.loss_mask[2] == 0  # the environment's part begins after the sampled ids


def test_a_template_that_is_not_append_only_fails_the_episode_naming_model_and_turn():
    eng = chat_engine(TURN_COUNTER)
    from tests.rl_engine.rollout.user_workflows import Game

    res = run_episodes(eng, Game(turns=2).run, chat_jobs(eng, 1), SAMPLING, 128, 5, model="runs/models/tiny-chat")
    assert (
        "TemplateNotAppendOnly" in res[0].error and "runs/models/tiny-chat" in res[0].error and "turn 1" in res[0].error
    ), res[0].error


def test_append_message_without_a_chat_prompt_says_to_use_append_text():
    from tests.rl_engine.rollout.user_workflows import Game

    res = run_episodes(ScriptedEngine(), Game(turns=1).run, jobs(1), SAMPLING, 64, 5, model="m")
    assert "not rendered by a chat template" in res[0].error and "append_text" in res[0].error


@pytest.mark.parametrize("on_error", ["drop", "score", "fail"])
def test_a_failed_episode_is_dropped_scored_or_fails_the_run(on_error, tiny_model_dir):
    from rl_engine.config import validate_config
    from rl_engine.errors import UserError
    from rl_engine.rewards import build_reward
    from rl_engine.roles.episodes import explore_episodes

    user_code = {"on_episode_error": on_error, **({"failed_reward": -0.5} if on_error == "score" else {})}
    cfg = validate_config(
        {
            "model": {"path": tiny_model_dir, "max_model_len": 64},
            "taskset": {
                "path": "t.jsonl",
                "workflow": {
                    "type": "python",
                    "function": "tests.rl_engine.rollout.user_workflows:breaks_on_odd_tasks",
                },
                "user_code": user_code,
            },
            "algorithm": {"repeat_times": 2},
            "explorer": {"sampling": {"max_tokens": 4}},
        }
    )
    from rl_engine.rollout.workflow import build_workflow

    tasks = [Task(f"t-{i}", "1+2=", "3") for i in range(4)]
    args = (ScriptedEngine(), tasks, build_workflow(cfg.taskset.workflow), build_reward(cfg.taskset.reward), cfg, 0, 1)
    if on_error == "fail":
        with pytest.raises(
            UserError,
            match=r"failed on task 't-1': ValueError: the environment cannot handle t-1 \(taskset.user_code.on_episode_error is fail\)",
        ):
            explore_episodes(*args)
        return
    batch, metrics = explore_episodes(*args)
    rows = batch.experiences()
    assert metrics["workflow_errors"] == 4 and metrics["episodes"] == (4 if on_error == "drop" else 8)
    assert sorted({r.task_id for r in rows}) == (["t-0", "t-2"] if on_error == "drop" else ["t-0", "t-1", "t-2", "t-3"])
    for r in rows:
        assert r.reward == (1.0 if r.task_id in ("t-0", "t-2") else -0.5)
        assert r.loss_mask == [1] * len(r.response_ids)
    assert len({r.group_id for r in rows}) == len(rows) // 2  # groups of repeat_times episodes


def test_the_readme_workflow_and_its_config(tiny_model_dir):
    """The workflows guide's example workflow runs as shown, and its YAML validates."""
    import re
    from pathlib import Path

    import yaml

    from rl_engine.config import validate_config

    readme = (Path(__file__).resolve().parents[3] / "docs" / "guides" / "workflows.md").read_text()
    section = readme.split("## Multi-turn workflows and tools", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    config = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.DOTALL).group(1))
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
