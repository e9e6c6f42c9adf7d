"""Bad input, second round (issue 45 item 8): mistakes aimed at what is newest: evaluation sets,
plugins and the registries, user losses, estimators and batch rewards, task makers, presets,
engine servers that are gone, `rft eval` on what is not a model. Same rules and runner as the first
round (harness/bad_input.py): each row ends in a UserError (exit 2 through `rft`) naming the field
and the fix, or in a counted, excluded sample; nothing stored changes. `TABLE` is both rounds.

`before` says what the row gave at 325d905: `clean`, `fixed` (a traceback, an error found only
after engines started, or a message without its fix), or `new` (the feature did not exist).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from harness.bad_input import CASES, Case, Env, _preflight, _validate
from rl_engine.trainer.dist import free_port

NOT_CALLABLE = "LIMIT = 3\n"
RAISES_AT_IMPORT = "raise RuntimeError('boom at import')\n"
LOSSES = """\
import torch

def three_args(logprobs, proximal, advantages):
    return -logprobs

def scalar(logprobs, proximal, advantages, mask):
    return logprobs.sum()

def estimate(rewards, group_index):
    return rewards[:1]
"""
BATCH = """\
def per_sample(prompt, response, task):
    return 1.0

def short(samples):
    return [1.0]

def words(samples):
    return ['high' if s.response == 'bad' else 1.0 for s in samples]

def some(samples):
    return [None if s.response == 'bad' else 1.0 for s in samples]
"""
MAKERS = """\
def as_dict(n, seed):
    return {'id': 1}

def needs_level(n, seed, level):
    return [{'id': str(i), 'question': 'q', 'answer': str(level)} for i in range(n or 1)]
"""


def _eval_set(setup: Callable[[Env], str], **extra: Any) -> Callable[[Env], list[str]]:
    """An eval set whose file `setup(env)` writes (returning its path)."""
    return lambda env: [f"eval.tasksets={json.dumps([{'name': 'held', 'path': setup(env), **extra}])}"]


def _module_override(field: str, source: str, attr: str, **more: Any) -> Callable[[Env], list[str]]:
    """`field` = {type: python, function: <a module holding source>:attr, ...}."""
    return lambda env: [f"{field}={json.dumps({'type': 'python', 'function': f'{env.module(source)}:{attr}', **more})}"]


def _plugin(source: str | None) -> Callable[[Env], Callable[[], Any]]:
    """A config whose `plugins:` names a module holding `source` (None: a module nowhere)."""

    def build(env: Env) -> Callable[[], Any]:
        from rl_engine.config import validate_config

        data = {**env.raw(), "plugins": [env.module(source) if source is not None else "no_such_plugin_x"]}
        return lambda: validate_config(data, "bad.yaml")

    return build


def _policy_loss(attr: str) -> Callable[[Env], Callable[[], Any]]:
    """A user loss called as the trainer calls it, on a [2, 3] batch."""

    def build(env: Env) -> Callable[[], Any]:
        import torch

        from rl_engine.algorithms import policy_loss
        from rl_engine.config import AlgorithmConfig

        cfg = AlgorithmConfig(loss={"type": "python", "function": f"{env.module(LOSSES)}:{attr}"})
        lp = torch.zeros(2, 3)
        return lambda: policy_loss(lp, lp, torch.zeros(2), torch.ones(2, 3), cfg)

    return build


def _estimator(attr: str) -> Callable[[Env], Callable[[], Any]]:
    def build(env: Env) -> Callable[[], Any]:
        import torch

        from rl_engine.algorithms import prepare_rows
        from rl_engine.config import AlgorithmConfig

        cfg = AlgorithmConfig(advantage={"type": "python", "function": f"{env.module(LOSSES)}:{attr}"})
        r, g = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([0, 0, 1, 1])
        return lambda: prepare_rows(r, g, torch.full((4,), 3), torch.zeros(4), cfg, 8)

    return build


def _batch_reward(attr: str, excluded: bool = False) -> Callable[[Env], Callable[[], Any]]:
    """Score 4 samples (every other one's response `bad`) with a batch reward."""

    def build(env: Env) -> Callable[[], Any]:
        from rl_engine.config import PythonReward
        from rl_engine.rewards import RolloutSample, Task, build_reward, score_rollouts

        fn = build_reward(PythonReward(type="python", function=f"{env.module(BATCH)}:{attr}", batch=True))
        items = [RolloutSample("1+1=", "bad" if i % 2 else "2", Task(f"t{i}", "1+1=", "2"), "stop") for i in range(4)]

        def call() -> str:
            result = score_rollouts(fn, items)
            failed = sum(not ok for ok in result.ok)
            assert failed == result.metrics["reward/errors"] == 2 and result.metrics["reward/count"] == 2
            return f"{failed} of 4 samples excluded (reward/errors): {result.metrics['reward/error_messages']}"

        return call

    return build


def _make_tasks(task: str, *args: str, source: str = MAKERS) -> Callable[[Env], Callable[[], Any]]:
    def build(env: Env) -> Callable[[], Any]:
        spec = task.replace("MOD", env.module(source))
        return lambda: env.rft("make-tasks", str(env.tmp / "out.jsonl"), "--task", spec, *args)

    return build


def _not_a_model(env: Env) -> Callable[[], Any]:
    d = env.tmp / "not-a-model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    tasks = env.tasks()
    return lambda: env.rft("eval", str(d), "--taskset", tasks, timeout=10)


def _gone_server(env: Env) -> list[str]:
    return [f"explorer.engine.servers=['http://127.0.0.1:{free_port()}']"]


FEATURE_CASES: list[Case] = [
    # ---- evaluation sets: preflight reads them, naming eval.tasksets[i]
    Case(
        "eval set missing",
        "eval",
        _preflight(setup=_eval_set(lambda env: str(env.tmp / "none.jsonl"))),
        r"eval\.tasksets\[0\]\.path = '.*none\.jsonl': file not found",
        r"fix eval\.tasksets\[0\]\.path",
        "fixed",
    ),
    Case(
        "eval set empty",
        "eval",
        _preflight(setup=_eval_set(lambda env: env.tasks([], "empty.jsonl"))),
        r"eval\.tasksets\[0\]\.path = '.*empty\.jsonl': the task set is empty",
        r"add rows",
        "fixed",
    ),
    Case(
        "eval set without answers",
        "eval",
        _preflight(setup=_eval_set(lambda env: env.tasks(['{"id": "h1", "question": "1+1="}'], "noanswer.jsonl"))),
        r"noanswer\.jsonl: line 1: no 'answer' value",
        r"give every row its answer",
        "fixed",
    ),
    Case(
        "eval set of an unknown file type",
        "eval",
        _preflight(setup=_eval_set(lambda env: env.tasks(["a,b"], "held.csv"))),
        r"eval\.tasksets\[0\]\.path = '.*held\.csv': unknown file type",
        r"use \.jsonl",
        "fixed",
    ),
    Case(
        "eval set with a line that is not JSON",
        "eval",
        _preflight(setup=_eval_set(lambda env: env.tasks(["{not json"], "broken.jsonl"))),
        r"broken\.jsonl: line 1",
        r"JSON",
        "fixed",
    ),
    Case(
        "eval set reward from a missing module",
        "eval",
        _preflight(
            setup=_eval_set(lambda env: env.tasks(), reward={"type": "python", "function": "no_such_module_x:f"})
        ),
        r"eval\.tasksets\[0\]\.reward \('held'\): taskset\.reward\.function = 'no_such_module_x:f': cannot import",
        r"PYTHONPATH",
        "fixed",
    ),
    Case(
        "rft eval of a directory that is not a model",
        "cli",
        _not_a_model,
        r"not-a-model/config\.json: not a Hugging Face model config \(no 'model_type'\)",
        r"restore the model's config\.json",
        "fixed",
    ),
    # ---- plugins and registries
    Case(
        "plugin module not installed",
        "plugin",
        _plugin(None),
        r"plugins\[0\] = 'no_such_plugin_x': cannot import it",
        r"PYTHONPATH",
        "new",
    ),
    Case(
        "plugin module raising at import",
        "plugin",
        _plugin(RAISES_AT_IMPORT),
        r"plugins\[0\] = 'rewards_\w+': cannot import it \(RuntimeError: boom at import\)",
        r"PYTHONPATH",
        "new",
    ),
    Case(
        "loss type nobody registered",
        "plugin",
        _validate("algorithm.loss={type: ppo}"),
        r"algorithm\.loss\.type = 'ppo': no loss of that name; registered: cispo, gspo, kimi, ppo_clip",
        r"@register_loss\('ppo'\).*type: python",
        "new",
    ),
    Case(
        "workflow type nobody registered",
        "plugin",
        _validate("taskset.workflow={type: chess}"),
        r"taskset\.workflow\.type = 'chess': no workflow of that name; registered: calculator, guess_number",
        r"@register_workflow",
        "new",
    ),
    Case(
        "reward type nobody registered",
        "plugin",
        _validate("taskset.reward={type: rubric}"),
        r"taskset\.reward\.type = 'rubric': no reward of that name; registered: arithmetic, .*final_answer",
        r"@register_reward",
        "new",
    ),
    # ---- user losses and estimators: refused by preflight, or at the call naming the contract
    Case(
        "loss function not in its module",
        "algorithm",
        _preflight(setup=_module_override("algorithm.loss", LOSSES, "missing")),
        r"algorithm\.loss\.function = 'rewards_\w+:missing': module 'rewards_\w+' has no attribute 'missing'",
        r"check the name after the colon",
        "new",
    ),
    Case(
        "loss with the wrong signature",
        "algorithm",
        _preflight(setup=_module_override("algorithm.loss", LOSSES, "three_args")),
        r"algorithm\.loss\.function \('python'\): 'three_args' cannot be called as \(logprobs, proximal, advantages, mask",
        r"rl_engine\.api",
        "new",
    ),
    Case(
        "loss kwargs it does not take",
        "algorithm",
        _preflight(setup=_module_override("algorithm.loss", LOSSES, "scalar", kwargs={"temperature": 2})),
        r"'scalar' cannot be called as .*\['temperature'\]",
        r"contract",
        "new",
    ),
    Case(
        "estimator that is not a function",
        "algorithm",
        _preflight(setup=_module_override("algorithm.advantage", NOT_CALLABLE, "LIMIT")),
        r"algorithm\.advantage\.function \('python'\): 3 is not callable",
        r"name a function",
        "new",
    ),
    Case(
        "loss returning one number",
        "algorithm",
        _policy_loss("scalar"),
        r"algorithm\.loss 'python' returned torch\.Size\(\[\]\)",
        r"one value per token, shape \(2, 3\)",
        "new",
    ),
    Case(
        "estimator returning too few advantages",
        "algorithm",
        _estimator("estimate"),
        r"algorithm\.advantage 'python' returned torch\.Size\(\[1\]\)",
        r"one advantage per experience",
        "new",
    ),
    Case(
        "strict preset overridden",
        "config",
        _validate("algorithm={preset: gspo, strict_preset: true, loss: {type: ppo_clip}}"),
        r"overrides preset 'gspo''s algorithm\.loss\.type = 'ppo_clip'",
        r"remove those fields.*strict_preset: false",
        "new",
    ),
    # ---- batch rewards
    Case(
        "batch reward with a per-sample signature",
        "reward",
        lambda env: _build_batch(env, "per_sample"),
        r"\(batch: true\): signature \(prompt, response, task\) cannot be called as \(samples, \*\*kwargs\)",
        r"a batch reward takes the step's list of samples",
        "new",
    ),
    Case(
        "batch reward returning too few values",
        "reward",
        lambda env: _score_batch(env, "short"),
        r"failed on all 4 samples.*returned 1 values for 4 samples",
        r"return one value \(or None\) per sample",
        "new",
    ),
    Case(
        "batch reward returning words for some",
        "reward",
        _batch_reward("words"),
        r"2 of 4 samples excluded \(reward/errors\).*reward returned str 'high'",
        r"expected a float",
        "new",
        excluded=True,
    ),
    Case(
        "batch reward returning None for some",
        "reward",
        _batch_reward("some"),
        r"2 of 4 samples excluded \(reward/errors\).*returned None for this sample",
        r"left out",
        "new",
        excluded=True,
    ),
    # ---- task makers
    Case(
        "make-tasks: a task nobody registered",
        "cli",
        _make_tasks("chess"),
        r"--task = 'chess': no task of that name; registered: arithmetic, calculator",
        r"--task package\.module:function",
        "new",
    ),
    Case(
        "make-tasks: a maker returning a dict",
        "cli",
        _make_tasks("MOD:as_dict"),
        r"--task rewards_\w+:as_dict: a task maker returns a list of dict rows, got dict",
        r"list of dict rows",
        "new",
    ),
    Case(
        "make-tasks: a maker's required parameter left out",
        "cli",
        _make_tasks("MOD:needs_level"),
        r"the following arguments are required: --level",
        r"--level",
        "new",
    ),
    Case(
        "make-tasks: a maker not in its module",
        "cli",
        _make_tasks("MOD:nope"),
        r"--task = 'rewards_\w+:nope': module 'rewards_\w+' has no attribute 'nope'",
        r"check the name after the colon",
        "new",
    ),
    # ---- what a run meets that is gone
    Case(
        "engine server gone",
        "rollout",
        _preflight(setup=_gone_server),
        r"explorer\.engine\.servers\[0\] = 'http://127\.0\.0\.1:\d+': no engine server answers there",
        r"rft engine serve CONFIG.*drop explorer\.engine\.servers",
        "fixed",
    ),
]


def _build_batch(env: Env, attr: str) -> Callable[[], Any]:
    from rl_engine.config import PythonReward
    from rl_engine.rewards import build_reward

    cfg = PythonReward(type="python", function=f"{env.module(BATCH)}:{attr}", batch=True)
    return lambda: build_reward(cfg)


def _score_batch(env: Env, attr: str) -> Callable[[], Any]:
    from rl_engine.rewards import RolloutSample, Task, score_rollouts

    fn = _build_batch(env, attr)()
    items = [RolloutSample("1+1=", "2", Task(f"t{i}", "1+1=", "2"), "stop") for i in range(4)]
    return lambda: score_rollouts(fn, items)


TABLE: list[Case] = CASES + FEATURE_CASES
