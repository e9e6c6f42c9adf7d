"""The extension surface (rl_engine/api.py, rl_engine/registry.py): the built-ins are registered in
any process, a config selects a plugin's entries by name or a function by import path (a user
module outside the repository: the README's plugin), each contract is dispatched with hand-valued
results, and a bad plugin or name is refused naming the field and what exists.

    .venv/bin/python -m pytest tests/rl_engine/test_api.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from pydantic import ValidationError

from harness.plugin import write_readme_plugin
from rl_engine import api
from rl_engine.config import AlgorithmConfig, PythonReward, RegisteredReward
from rl_engine.errors import UserError
from rl_engine.registry import ESTIMATORS, LOSSES, REWARDS, TASKS, WORKFLOWS, Registry
from rl_engine.rewards import RolloutSample, Task, build_reward, score_rollouts

BUILTINS = {
    "estimator": (ESTIMATORS, {"grpo", "dr_grpo", "rloo", "reinforce_pp"}),
    "loss": (LOSSES, {"ppo_clip", "gspo", "cispo", "kimi"}),
    "reward": (REWARDS, {"arithmetic", "countdown", "final_answer", "code_tests"}),
    "workflow": (WORKFLOWS, {"calculator", "guess_number"}),
    "task": (TASKS, {"arithmetic", "countdown", "word-arithmetic", "calculator", "guess_number", "python-functions"}),
}


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The README's my_plugin.py on sys.path (and PYTHONPATH, for spawned workers), imported."""
    import importlib

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return importlib.import_module(write_readme_plugin(tmp_path))


@pytest.mark.parametrize("kind", sorted(BUILTINS))
def test_a_fresh_process_sees_every_builtin_and_each_loads(kind):
    registry, names = BUILTINS[kind]
    var = {"estimator": "ESTIMATORS", "loss": "LOSSES", "reward": "REWARDS", "workflow": "WORKFLOWS", "task": "TASKS"}
    code = f"import json; from rl_engine.registry import {var[kind]}; print(json.dumps({var[kind]}.names()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert names <= set(json.loads(out.stdout))
    assert all(callable(registry.get(n)) and registry.builtin(n) for n in names)


def test_nothing_imports_a_builtin_until_it_is_used():
    code = "import sys; import rl_engine.api, rl_engine.config; print(any(m.startswith('rl_engine.demos') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_a_registered_loss_is_dispatched_with_its_kwargs(plugin):
    from rl_engine.algorithms import policy_loss

    cfg = AlgorithmConfig(loss={"type": "reinforce", "kwargs": {"scale": 2.0}})
    logprobs = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)  # [B=1, L=3]; position 0 is the prompt
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    out = policy_loss(logprobs, logprobs.detach(), torch.tensor([0.5]), mask, cfg)
    # token loss -2 * 0.5 * logprob = [1, 2] on the response; token-mean 1.5; no clip of its own
    assert out.loss.item() == pytest.approx(1.5) and out.clipped_tokens.item() == 0
    out.loss.backward()
    assert logprobs.grad.tolist() == [[0.0, -0.5, -0.5]]  # d/dlogprob of mean(-2 * 0.5 * lp) over 2 tokens


def test_the_same_loss_by_import_path_without_registering(plugin):
    from rl_engine.algorithms import policy_loss

    cfg = AlgorithmConfig(loss={"type": "python", "function": "my_plugin:reinforce"})
    lp = torch.tensor([[0.0, -1.0, -2.0]])
    assert policy_loss(lp, lp, torch.tensor([0.5]), torch.tensor([[0.0, 1.0, 1.0]]), cfg).loss.item() == 0.75


def test_a_loss_of_the_wrong_shape_is_refused_naming_the_contract(plugin, tmp_path):
    from rl_engine.algorithms import policy_loss

    (tmp_path / "bad_loss.py").write_text(
        "def scalar(logprobs, proximal, advantages, mask):\n    return logprobs.sum()\n"
    )
    cfg = AlgorithmConfig(loss={"type": "python", "function": "bad_loss:scalar"})
    lp = torch.zeros(2, 3)
    with pytest.raises(UserError, match=r"one value per token, shape \(2, 3\).*PolicyLoss"):
        policy_loss(lp, lp, torch.zeros(2), torch.ones(2, 3), cfg)


def test_a_registered_estimator_gives_the_advantages_prepare_uses(plugin):
    from rl_engine.algorithms import prepare_rows

    cfg = AlgorithmConfig(advantage={"type": "centred"})
    got = ESTIMATORS.build(cfg.advantage)(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    assert got.tolist() == [0.5, -0.5, 0.0, 0.0]
    prepared = prepare_rows(
        torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]), torch.full((4,), 3), torch.zeros(4), cfg, 8
    )
    assert prepared.advantages.tolist() == [0.5, -0.5, 0.0, 0.0]


def test_a_batch_reward_scores_a_step_in_one_call_in_the_pool_and_in_the_thread(plugin):
    from rl_engine.rewards import UserCodePool

    fn = build_reward(RegisteredReward(type="digits", batch=True, kwargs={"weight": 2.0}))
    tasks = [Task(task_id=f"t{i}", prompt="1+1=", answer="2", row={}) for i in range(3)]
    samples = [RolloutSample("1+1=", r, t, "stop") for r, t in zip(["2", "3", "2 and more"], tasks)]
    want = [2.0 - 0.01, -0.01, -0.1]
    assert score_rollouts(fn, samples).rewards == pytest.approx(want)
    pool = UserCodePool(1, name="api-test")
    try:
        result = score_rollouts(fn, samples, pool)
    finally:
        pool.close()
    assert result.rewards == pytest.approx(want) and result.metrics["reward/exact/mean"] == pytest.approx(2 / 3)


def test_a_batch_reward_that_leaves_one_out_or_miscounts(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "batchy.py").write_text(
        "def some(samples):\n    return [None if s.response == 'x' else 1.0 for s in samples]\n"
        "def short(samples):\n    return [1.0]\n"
    )
    task = Task(task_id="t", prompt="p", answer="a", row={})
    samples = [RolloutSample("p", r, task, "stop") for r in ("x", "y")]
    some = score_rollouts(build_reward(_python("batchy:some")), samples)
    assert some.rewards == [None, 1.0] and "returned None for this sample" in some.errors[0]
    with pytest.raises(UserError, match=r"returned 1 values for 2 samples"):
        score_rollouts(build_reward(_python("batchy:short")), samples)


def _python(function: str) -> PythonReward:
    return PythonReward(type="python", function=function, batch=True)


def test_a_task_maker_by_name_or_import_path(plugin, tmp_path, capsys):
    from rl_engine.rewards.make_tasks import main

    out = tmp_path / "sums.jsonl"
    assert main([str(out), "--task", "my_plugin:sums", "--n", "5", "--top", "3", "--seed", "1"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == plugin.sums(5, 1, top=3) and all(int(r["answer"]) <= 6 for r in rows)
    assert main([str(out), "--task", "sums", "--n", "4"]) == 0  # registered by the import above
    assert len(out.read_text().splitlines()) == 4 and "wrote 4 sums tasks" in capsys.readouterr().out


def test_a_plugin_name_is_refused_listing_what_is_registered():
    with pytest.raises(
        ValidationError, match=r"algorithm.loss.type = 'nope': no loss of that name; registered: cispo, gspo"
    ):
        AlgorithmConfig(loss={"type": "nope"})
    with pytest.raises(ValidationError, match=r"pattern"):
        AlgorithmConfig(loss={"type": "python", "function": "not a path"})


def test_a_name_cannot_be_registered_twice_or_as_python():
    reg = Registry("thing", "x.thing", {"a": "math:sqrt"})
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(test_a_name_cannot_be_registered_twice_or_as_python)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("python")(test_a_name_cannot_be_registered_twice_or_as_python)
    assert reg.register("b")(len) is len and reg.get("b") is len and reg.path("b") == "builtins:len"


def test_rft_validate_in_a_fresh_process_takes_a_user_module_outside_the_repository(
    tmp_path, tiny_model_dir, task_file
):
    write_readme_plugin(tmp_path / "site")
    env_path = str(tmp_path / "site")

    def validate(extra: str) -> subprocess.CompletedProcess:
        cfg = tmp_path / "cfg.yaml"
        cfg.write_text(f"model: {{path: {tiny_model_dir}}}\ntaskset: {{path: {task_file}}}\n{extra}")
        return subprocess.run(
            [sys.executable, "-m", "cli.main", "validate", str(cfg), "--print"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": env_path},
        )

    by_path = validate("algorithm: {loss: {type: python, function: 'my_plugin:reinforce'}}\n")
    assert by_path.returncode == 0, by_path.stderr
    by_name = validate("plugins: [my_plugin]\nalgorithm: {loss: {type: reinforce}, advantage: {type: centred}}\n")
    assert by_name.returncode == 0, by_name.stderr
    assert "type: reinforce" in by_name.stdout and "type: centred" in by_name.stdout
    unknown = validate("plugins: [my_plugin]\nalgorithm: {loss: {type: nope}}\n")
    assert unknown.returncode == 2 and "registered: cispo, gspo, kimi, ppo_clip, reinforce" in unknown.stderr
    missing = validate("plugins: [not_installed_anywhere]\n")
    assert missing.returncode == 2 and "plugins[0] = 'not_installed_anywhere': cannot import it" in missing.stderr


def test_the_api_lists_every_contract():
    assert {"PolicyLoss", "AdvantageEstimator", "Reward", "BatchReward", "Workflow", "TaskMaker", "Trainer"} <= set(
        api.__all__
    )


def test_the_readme_config_selects_the_readme_plugin(plugin, tiny_model_dir, task_file):
    import yaml

    from harness.plugin import readme_yaml_after
    from rl_engine.config import validate_config

    data = yaml.safe_load(readme_yaml_after("## Extending rft"))
    data["model"] = {"path": tiny_model_dir}
    data["taskset"]["path"] = task_file
    cfg = validate_config(data)
    assert (cfg.algorithm.loss.type, cfg.algorithm.advantage.type) == ("reinforce", "centred")
    assert (cfg.taskset.reward.type, cfg.taskset.reward.batch, cfg.taskset.workflow.type) == (
        "digits",
        True,
        "two_tries",
    )


def test_taskset_make_writes_a_missing_task_set_once_and_never_over_it(plugin, tmp_path):
    from rl_engine.config import TasksetConfig
    from rl_engine.rewards.make_tasks import make_taskset

    path = tmp_path / "made.jsonl"
    ts = TasksetConfig(path=str(path), make={"type": "sums", "n": 6, "seed": 2, "kwargs": {"top": 3}})
    assert make_taskset(ts) == 6
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == plugin.sums(6, 2, top=3)
    path.write_text('{"id": "mine", "question": "1+1=", "answer": "2"}\n')
    assert make_taskset(ts) is None and "mine" in path.read_text()  # there: never made again
    by_path = TasksetConfig(
        path=str(tmp_path / "p.jsonl"), make={"type": "python", "function": "my_plugin:sums", "n": 2}
    )
    assert make_taskset(by_path) == 2
    with pytest.raises(ValidationError, match=r"taskset\.make\.type = 'chess': no task of that name"):
        TasksetConfig(path="x", make={"type": "chess"})
    with pytest.raises(ValidationError, match=r"needs taskset\.make\.function"):
        TasksetConfig(path="x", make={"type": "python"})
