"""GRPO groups and the one place that turns finished groups into experience rows.

Plain rollouts (`rl_engine.roles.explorer.generate_experiences`) and partial rollouts
(`rl_engine.roles.partial`) both hold a step's work as `Group`s of `Generation`s and write them
through `score_groups` / `experience_row`, so a schema change touches one function. A plain
rollout is the one-segment case: its generation's segments are the runs of equal versions of
the one explorer step that produced it (`one_step_generation`), exactly what the schema
derives for a row without segments.

Group ids have one format, `group_id(explorer_id, draw, task_id)` = `"<explorer>-d<draw>-<task>"`,
where `draw` numbers the explorer's task draws from 1 (a task set smaller than a batch may hand
out one task twice; the draw keeps the groups apart). Ids are unique across explorers (the
prefix), steps and resumes (draw numbers continue with the task stream: plain rollouts derive
them from the explorer step, since step e draws the e-th batch; partial rollouts save theirs
with the continuations). Rows written before this format (`"<explorer>-<step>-<task>"`, plain
rollouts) cannot collide with it: their middle part has no `d`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from rl_engine.buffer.continuations import UNFINISHED
from rl_engine.experience import Experience, ExperienceBatch, version_runs
from rl_engine.rewards import RolloutSample, ScoreResult, Task, score_rollouts


def group_id(explorer_id: int, draw: int, task_id: str) -> str:
    """The group of the `draw`-th task (from 1) explorer `explorer_id` drew; see the module docstring."""
    return f"{explorer_id}-d{draw}-{task_id}"


@dataclasses.dataclass
class Generation:
    """One member of a group: its response so far, and where every token came from."""

    experience_id: str
    prompt_ids: list[int]
    started_at: float | None  # None: not recorded (plain rollouts)
    response_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    segments: list[dict[str, int]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None  # None while cut (to be continued)
    loss_mask: list[int] | None = None  # None: every token trained; a workflow's episode masks the environment's tokens

    def extend(self, step: int, version: int, ids: Sequence[int], logprobs: Sequence[float]) -> int:
        """Append one segment; returns where it starts."""
        start = len(self.response_ids)
        self.response_ids += list(ids)
        self.logprobs += list(logprobs)
        self.versions += [version] * len(ids)
        self.segments.append({"explorer_step": step, "version": version, "start": start, "end": len(self.response_ids)})
        return start

    def keep(self, k: int) -> None:
        """Keep the first k response tokens (a stop or a repeat found inside the last segment)."""
        if not self.segments[-1]["start"] < k <= self.segments[-1]["end"]:
            raise ValueError(f"keep({k}): outside the last segment {self.segments[-1]}")
        del self.response_ids[k:], self.logprobs[k:], self.versions[k:]
        self.segments[-1]["end"] = k


def one_step_generation(experience_id: str, step: int, rollout: Any) -> Generation:
    """A finished generation made in one explorer step by one engine call (a plain rollout).

    Its segments are `version_runs` of its versions, what the schema gives a row without
    segments (an empty response keeps its one empty segment of version -1)."""
    versions = [rollout.version] * len(rollout.response_ids)
    return Generation(
        experience_id,
        list(rollout.prompt_ids),
        None,
        list(rollout.response_ids),
        list(rollout.logprobs),
        versions,
        version_runs(step, versions),
        rollout.finish_reason,
    )


@dataclasses.dataclass
class Group:
    """The `repeat_times` generations of one task; enters the buffer only when all are finished."""

    group_id: str
    task: Task
    prompt_text: str
    members: list[Generation]

    @property
    def done(self) -> bool:
        return all(m.finish_reason is not None for m in self.members)

    @property
    def first_step(self) -> int:
        return min((m.segments[0]["explorer_step"] for m in self.members if m.segments), default=0)


def experience_row(
    g: Group, m: Generation, explorer_id: int, step: int, reward: float, comps: dict[str, float], text: str, now: float
) -> Experience:
    """Member `m` of group `g` as the row explorer `explorer_id` writes in `step` (a buffer row,
    or a continuation while `m` is cut)."""
    return Experience(
        experience_id=m.experience_id,
        task_id=g.task.task_id,
        group_id=g.group_id,
        explorer_id=explorer_id,
        explorer_step=step,
        prompt_ids=m.prompt_ids,
        response_ids=m.response_ids,
        logprobs=m.logprobs,
        versions=m.versions,
        loss_mask=list(m.loss_mask) if m.loss_mask is not None else [1] * len(m.response_ids),
        reward=float(reward),
        reward_components=comps,
        finish_reason=m.finish_reason or UNFINISHED,
        segments=[dict(s) for s in m.segments],
        num_segments=len(m.segments),
        created_at=now,
        started_at=m.started_at,
        prompt_text=g.prompt_text,
        response_text=text,
    )


def score_groups(
    flat: list[tuple[Group, Generation, str]],
    reward_fn: Any,
    explorer_id: int,
    step: int,
    repeat_penalty: float = 0.0,
    pool: Any = None,
    failed_reward: float | None = None,
) -> tuple[ExperienceBatch, ScoreResult]:
    """Score finished (group, member, response text) triples into step `step`'s rows.

    A sample whose reward raised is left out (counted in the scores' metrics); the rest of its
    group stays. A `repeat` finish gets `repeat_penalty` added (and named) when it is non-zero.
    Python rewards run in `pool` (a timed-out or crashed call scores `failed_reward`, or is left
    out when that is None)."""
    scores = score_rollouts(
        reward_fn,
        [RolloutSample(g.prompt_text, text, g.task, m.finish_reason) for g, m, text in flat],
        pool=pool,
        failed_reward=failed_reward,
    )
    now = time.time()
    rows = []
    for (g, m, text), reward, comps, ok in zip(flat, scores.rewards, scores.components, scores.ok):
        if not ok:
            continue
        if m.finish_reason == "repeat" and repeat_penalty:
            reward, comps = reward + repeat_penalty, {**comps, "repeat_penalty": repeat_penalty}
        rows.append(experience_row(g, m, explorer_id, step, reward, comps, text, now))
    return ExperienceBatch.from_experiences(rows), scores
