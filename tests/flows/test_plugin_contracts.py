"""Every extension point, as a third-party plugin would use it, in a real run (tiny model, vLLM
CPU, DeepSpeed CPU, a Prefect flow run): the README's my_plugin.py, in a directory outside the
repository, supplies the task maker that writes the task set (taskset.make), the workflow, the batch reward, the
advantage estimator and the policy loss of a 2-step run. A spy module wraps each README function
under its own registered name and notes every call in a file (the calls happen in the explorer, its
user-code pool's worker processes and the trainer), so the run proves each contract was called
where and as often as it should be, not only that a config naming it validates.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from cli.run import run_config
from harness.plugin import write_readme_plugin
from harness.runs import small_config, stored_rows
from rl_engine.config import validate_config

pytestmark = pytest.mark.slow

SPY = '''"""Each README plugin function under a spy_ name, noting its calls (kind, size) in $RFT_SPY_FILE."""
import json
import os

import my_plugin
from rl_engine.api import register_estimator, register_loss, register_reward, register_task, register_workflow


def _note(kind, size):
    with open(os.environ["RFT_SPY_FILE"], "a") as f:
        f.write(json.dumps([kind, size, os.getpid()]) + "\\n")


@register_loss("spy_reinforce")
def spy_reinforce(logprobs, proximal, advantages, mask, **kw):
    _note("loss", int(mask.sum()))
    return my_plugin.reinforce(logprobs, proximal, advantages, mask, **kw)


@register_estimator("spy_centred")
def spy_centred(rewards, group_index, **kw):
    _note("estimator", len(rewards))
    return my_plugin.centred(rewards, group_index, **kw)


@register_reward("spy_digits")
def spy_digits(samples, **kw):
    _note("reward", len(samples))
    return my_plugin.digits(samples, **kw)


@register_task("spy_sums")
def spy_sums(n, seed, **kw):
    _note("task", n)
    return my_plugin.sums(n, seed, **kw)


@register_workflow("spy_two_tries")
def spy_two_tries(task, episode):
    _note("workflow", 1)
    return my_plugin.two_tries(task, episode)
'''
STEPS = 2


def test_a_plugin_supplies_every_extension_point_of_a_real_run(prefect_server, tiny_model_dir, tmp_path, monkeypatch):
    site = tmp_path / "site"
    write_readme_plugin(site)
    (site / "spy_plugin.py").write_text(SPY)
    spy = tmp_path / "calls.jsonl"
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", str(site))  # the trainer's and the user-code pool's processes
    monkeypatch.setenv("RFT_SPY_FILE", str(spy))

    tasks = tmp_path / "sums.jsonl"  # not there yet: the run makes it (taskset.make)
    data = small_config(tiny_model_dir, str(tasks), str(tmp_path / "runs"), name="plugins", total_steps=STEPS)
    data["plugins"] = ["spy_plugin"]
    data["taskset"]["make"] = {"type": "spy_sums", "n": 40, "kwargs": {"top": 4}}
    data["algorithm"].update(
        advantage={"type": "spy_centred"}, loss={"type": "spy_reinforce", "kwargs": {"scale": 1.0}}
    )
    data["taskset"].update(
        reward={"type": "spy_digits", "batch": True, "kwargs": {"weight": 1.0}}, workflow={"type": "spy_two_tries"}
    )
    cfg = validate_config(data)
    summary = run_config(cfg)
    assert summary["final_version"] == STEPS, summary

    calls = [json.loads(line) for line in spy.read_text().splitlines()]
    kinds = Counter(kind for kind, _, _ in calls)
    import my_plugin

    assert kinds["task"] == 1  # made once, by the run's first start
    assert [json.loads(line) for line in tasks.read_text().splitlines()] == my_plugin.sums(40, 0, top=4)
    group = cfg.explorer.batch_size * cfg.algorithm.repeat_times  # episodes (and samples) of one explorer step
    trained = [size for kind, size, _ in calls if kind == "estimator"]
    assert trained == [group] * STEPS  # the estimator saw each trainer batch whole, once
    assert kinds["loss"] >= STEPS and all(size > 0 for kind, size, _ in calls if kind == "loss")
    steps_explored = kinds["workflow"] // group
    assert kinds["workflow"] == steps_explored * group and steps_explored >= STEPS
    assert [size for kind, size, _ in calls if kind == "reward"] == [group] * steps_explored  # one batch call a step
    reward_pids = {pid for kind, _, pid in calls if kind == "reward"}
    workflow_pids = {pid for kind, _, pid in calls if kind == "workflow"}
    assert reward_pids.isdisjoint(workflow_pids)  # the reward ran in the user-code pool, not the explorer

    run_url = str(Path(tmp_path, "runs", "plugins"))
    rows = stored_rows(run_url)
    assert len(rows) == steps_explored * group
    # "again:" is the environment's: masked from the loss in the rows whose first answer missed
    assert any(0 in r["loss_mask"] for r in rows)
    trainer = [json.loads(p.read_text()) for p in sorted(Path(run_url, "metrics", "role=trainer").glob("*.json"))]
    assert [m["version"] for m in trainer] == list(range(1, STEPS + 1))
    # the README reward's brevity part varies with the response: advantages, a loss and a gradient follow
    assert any(m["reward_std"] > 0 and m["grad_norm"] > 0 and m["pg_loss"] != 0 for m in trainer), trainer
