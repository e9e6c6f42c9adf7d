"""The one generation path: plain rollouts' rows (`generate_experiences`) come from the builder
partial rollouts use (rl_engine/roles/groups.py), column by column, with one group-id format.

The engine is scripted (no vLLM engine starts): it returns fixed rollouts, so every column of
every row is known. Partial rollouts' own rows are checked in tests/rl_engine/roles/test_partial.py.

    .venv/bin/python -m pytest tests/rl_engine/roles/test_groups.py
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rl_engine.config import SamplingConfig, UserCodeConfig
from rl_engine.rewards import Task, TaskIterator
from rl_engine.roles.explorer import generate_experiences
from rl_engine.roles.groups import Generation, group_id, one_step_generation
from rl_engine.rollout.engine import Rollout
from rl_engine.tiny_model import build_tokenizer

TOK = build_tokenizer()
REASONS = ("stop", "length", "repeat")


class FixedEngine:
    """Member k of prompt j answers `[5 + k] * (j + k + 1)` (prompt 1's member 1: nothing) at version 3."""

    tokenizer, version = TOK, 3

    def generate(self, prompts, n, sampling, seed):
        def rollout(j: int, k: int, p: list[int]) -> Rollout:
            resp = [] if (j, k) == (1, 1) else [5 + k] * (j + k + 1)
            return Rollout(
                prompt_ids=p,
                response_ids=resp,
                logprobs=[-0.25] * len(resp),
                finish_reason=REASONS[k % 3],
                version=self.version,
                text=f"ans{j}{k}",
            )

        return [[rollout(j, k, p) for k in range(n)] for j, p in enumerate(prompts)]


def reward(prompt: str, response: str, task: Task, finish_reason: str) -> dict[str, float]:
    if response == "ans21":
        raise ValueError("this sample's reward fails")
    return {"correct": float(len(response)), "format": 0.5}


CFG = SimpleNamespace(
    taskset=SimpleNamespace(template="Q: {prompt}", user_code=UserCodeConfig()),
    model=SimpleNamespace(max_model_len=512),
    algorithm=SimpleNamespace(repeat_times=3),
    explorer=SimpleNamespace(sampling=SamplingConfig()),
    seed=1,
)


def _tasks(*names: str) -> list[Task]:
    return [Task(task_id=n, prompt=f"prompt of {n}", answer="1") for n in names]


def test_plain_rows_every_column():
    batch, metrics = generate_experiences(FixedEngine(), _tasks("t0", "t1", "t2"), reward, CFG, explorer_id=2, step=5)
    rows = batch.to_table().to_pylist()
    assert len(rows) == 8 and metrics["reward/errors"] == 1  # prompt 2's member 1 is left out, its group stays
    assert [r["group_id"] for r in rows] == ["2-d13-t0"] * 3 + ["2-d14-t1"] * 3 + [
        "2-d15-t2"
    ] * 2  # step 5 draws 13..15
    prompt = TOK("Q: prompt of t0", add_special_tokens=False).input_ids
    assert rows[1] | {"experience_id": None, "created_at": None} == {
        "experience_id": None,
        "task_id": "t0",
        "group_id": "2-d13-t0",
        "explorer_id": 2,
        "explorer_step": 5,
        "prompt_ids": prompt,
        "response_ids": [6, 6],
        "logprobs": [-0.25, -0.25],
        "versions": [3, 3],
        "loss_mask": [1, 1],
        "reward": 5.5,
        "reward_components": [("correct", 5.0), ("format", 0.5)],
        "finish_reason": "length",
        "num_segments": 1,
        "segments": [{"explorer_step": 5, "version": 3, "start": 0, "end": 2}],
        "created_at": None,
        "started_at": None,
        "prompt_text": "Q: prompt of t0",
        "response_text": "ans01",
    }
    empty = rows[4]  # prompt 1, member 1: no tokens, one empty segment of version -1 (what the schema derives)
    assert empty["response_ids"] == [] and empty["segments"] == [
        {"explorer_step": 5, "version": -1, "start": 0, "end": 0}
    ]
    assert len({r["experience_id"] for r in rows}) == 8 and all(r["created_at"] == rows[0]["created_at"] for r in rows)


def test_a_task_drawn_twice_in_one_step_makes_two_groups():
    batch, _ = generate_experiences(FixedEngine(), _tasks("t0", "t0"), lambda *a: 1.0, CFG, explorer_id=0, step=1)
    assert batch.column("group_id").tolist() == ["0-d1-t0"] * 3 + ["0-d2-t0"] * 3
    assert batch.group_index().tolist() == [0, 0, 0, 1, 1, 1]  # two GRPO groups of 3, not one of 6


def test_plain_draw_numbers_follow_the_task_stream_across_steps_and_explorers():
    """Step e's tasks are the stream's e-th batch (a resumed explorer skips committed steps'),
    so its draw numbers continue the previous step's: ids never repeat within an explorer."""
    stream = TaskIterator(_tasks(*(f"t{i}" for i in range(5))), batch_size=2, seed=0)
    ids = []
    for e in (1, 2, 3, 4):
        for explorer in (0, 1):
            batch, _ = generate_experiences(
                FixedEngine(),
                stream.next_batch() if explorer == 0 else _tasks("t0", "t1"),
                lambda *a: 1.0,
                CFG,
                explorer,
                e,
            )
            ids += sorted(set(batch.column("group_id").tolist()))
    assert len(ids) == len(set(ids)) == 16
    assert [int(g.split("-")[1].removeprefix("d")) for g in ids if g.startswith("0-")] == list(range(1, 9))


@pytest.mark.parametrize("tokens", [[7, 8, 9], []])
def test_a_plain_rollout_is_a_one_segment_generation(tokens):
    r = Rollout(prompt_ids=[1, 2], response_ids=tokens, logprobs=[-0.5] * len(tokens), finish_reason="stop", version=4)
    plain = one_step_generation("x", 6, r)
    if tokens:  # what partial rollouts hold after one segment that finished
        cut = Generation("x", [1, 2], None)
        cut.extend(6, 4, tokens, [-0.5] * len(tokens))
        cut.finish_reason = "stop"
        assert plain == cut
    else:  # no token, no version: the schema's segment of an empty response
        assert plain.segments == [{"explorer_step": 6, "version": -1, "start": 0, "end": 0}]


def test_group_id_format():
    assert group_id(3, 12, "task-a") == "3-d12-task-a"
    assert group_id(3, 12, "task-a").split("-", 2)[2] == "task-a"  # readers take the task id as the rest


def test_a_too_long_prompt_is_refused_before_the_engine_naming_its_task():
    """The explorer tokenizes each task once (rewards.encode_task): a prompt that fills
    model.max_model_len names the task row and the config field, and no engine call is made."""
    import pytest

    from rl_engine.errors import UserError

    class NoEngine(FixedEngine):
        def generate(self, *a, **k):
            raise AssertionError("the engine must not be called")

    cfg = SimpleNamespace(**{**vars(CFG), "model": SimpleNamespace(max_model_len=40)})
    tasks = _tasks("short.jsonl#1") + [Task(task_id="tasks.jsonl#2", prompt="x" * 100, answer="1")]
    with pytest.raises(
        UserError,
        match=r"task 'tasks.jsonl#2': its prompt is \d+ tokens .* model.max_model_len = 40; .*raise model.max_model_len",
    ):
        generate_experiences(NoEngine(), tasks, reward, cfg, explorer_id=0, step=1)
