"""Partial rollouts: generations cut by a token budget per explorer step and continued later.

With `explorer.partial.enabled`, every generation gets at most `segment_max_tokens` new tokens
per explorer step (one **segment**). After each segment a generation is finished (`stop`: EOS or
a stop string; `repeat`: its tail repeats; `truncated`: `max_response_tokens` or the context is
full) or **cut**, and then continued in a later explorer step by re-prefilling prompt + tokens
so far with the weights the explorer then holds. Stop strings and the repetition rule are
checked on the whole response after every segment, across segment boundaries, and it ends at
the first one found (vLLM sees only the segment). Every token keeps its behavior logprob and
version; every generation keeps its segments (explorer step, version, token span).

A step still yields exactly one trainer batch: `explorer.batch_size` complete GRPO groups, oldest
first. It starts new tasks until it holds `max_groups_in_flight` groups (finished or not, the
bound on work in flight), gives every unfinished one its next segment in one batched generate
call, and, only if fewer than `batch_size` groups are then complete, gives the oldest
unfinished ones another segment in the same step (counted as `extra_rounds`). Groups finished
beyond the batch wait for the next step; nothing generated is dropped. Starting only what the
batch needs this step was measured too: on a long-tailed task it left the engine mostly idle
(small generate calls, many extra rounds) and bought 1.1x over no partial rollouts, against
1.9x for filling the pool (`python -m bench.partial`).

Crash safety (the continuation store's manifest is the source of truth): step e first stages
its batch as the store's **outbox** together with the groups still pending, retiring the previous
pending set, in one manifest write; then commits the batch to the buffer; then retires the
outbox. A resumed explorer starts at one past its last committed step: an outbox for an older
step was committed (retire it), an outbox for the step it starts at was not (write it as that
step's batch, without generating). So a group is written exactly once, and a pending one is
never lost or continued twice. The task stream's position is saved in the same write.

    partial = PartialRollouts(engine, store, tasks, reward_fn, settings, first_step=e0, pool=pool)
    batch, metrics = partial.generate(e)     # step e's batch: outbox if recovered, else segments
    partial.stage(e, batch); writer.write(e, batch); partial.committed(e)

Groups, group ids and the rows they become are shared with plain rollouts (`rl_engine.roles.groups`).

Tests: `.venv/bin/python -m pytest tests/rl_engine/roles/test_partial.py tests/rl_engine/sync/test_partial_engine.py`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
import uuid
from collections.abc import Sequence
from typing import Any

from rl_engine.buffer import ContinuationStore
from rl_engine.buffer.continuations import UNFINISHED
from rl_engine.config import PartialRolloutConfig, SamplingConfig
from rl_engine.errors import UserError
from rl_engine.experience import ExperienceBatch
from rl_engine.rewards import Task, TaskIterator, encode_task
from rl_engine.roles.groups import Generation, Group, experience_row, group_id, score_groups

# --------------------------------------------------------------------------- ending a segment


def repeat_cut(response_ids: Sequence[int], since: int, ngram: int, count: int) -> int | None:
    """Shortest prefix length k > since at which the response's tail repeats (vLLM's rule: the
    last 1..ngram tokens occurred `count` times in a row), or None. Checked on the whole
    response, so a loop that began in an earlier segment is seen too (vLLM checks only the
    segment's own tokens)."""
    from vllm.sampling_params import RepetitionDetectionParams
    from vllm.v1.core.sched.utils import check_sequence_repetition

    params = RepetitionDetectionParams(max_pattern_size=ngram, min_pattern_size=1, min_count=count)
    for k in range(max(since, 0) + 1, len(response_ids) + 1):
        if check_sequence_repetition(response_ids[:k], params):
            return k
    return None


def stop_cut(tokenizer: Any, response_ids: Sequence[int], since: int, stops: Sequence[str]) -> int | None:
    """Shortest prefix length k > since whose text contains a stop string, or None. vLLM matches
    stop strings within one segment only; one that spans a segment boundary is found here
    (token ids are the source of truth: the text is decoded from them)."""
    if not stops or not any(s in tokenizer.decode(list(response_ids), skip_special_tokens=True) for s in stops):
        return None
    for k in range(max(since, 0) + 1, len(response_ids) + 1):
        text = tokenizer.decode(list(response_ids[:k]), skip_special_tokens=True)
        if any(s in text for s in stops):
            return k
    return None


def response_text(tokenizer: Any, response_ids: Sequence[int], stops: Sequence[str]) -> str:
    """The response as text, decoded once from all its tokens, ending before the first stop string."""
    text = tokenizer.decode(list(response_ids), skip_special_tokens=True)
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(cuts)] if cuts else text


# --------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class PartialSettings:
    """What partial rollouts need from the config (components take values, not the tree)."""

    partial: PartialRolloutConfig
    sampling: SamplingConfig
    batch_size: int
    repeat_times: int
    max_model_len: int
    template: str | None
    seed: int
    explorer_id: int
    failed_reward: float | None = None  # taskset.user_code.failed_reward

    @property
    def max_groups_in_flight(self) -> int:
        return self.partial.max_groups_in_flight or 2 * self.batch_size


# --------------------------------------------------------------------------- the explorer's side


class PartialRollouts:
    """Segments, continuations and the step's batch of one explorer (see the module docstring)."""

    def __init__(
        self,
        engine: Any,
        store: ContinuationStore,
        tasks: TaskIterator,
        reward_fn: Any,
        settings: PartialSettings,
        first_step: int,
        pool: Any = None,
    ):
        self.engine, self.store, self.tasks, self.reward_fn, self.s, self.pool = (
            engine,
            store,
            tasks,
            reward_fn,
            settings,
            pool,
        )
        self.tok = engine.tokenizer
        self.by_id = {t.task_id: t for t in tasks.tasks}
        self.groups: list[Group] = []  # held, oldest first
        self._pending_ids: list[str] = []
        self._outbox: tuple[int, str] | None = None
        self.draws = 0
        self._resume(first_step)

    # ---- resume

    def _resume(self, first_step: int) -> None:
        entries = self.store.list()
        for e in (x for x in entries if x.kind == "outbox"):
            if e.explorer_step < first_step:
                self.store.retire([e.id])  # its buffer commit happened before the crash
            elif e.explorer_step == first_step:
                self._outbox = (e.explorer_step, e.id)
            else:
                raise UserError(
                    f"{self.store.manifest()['uri']}: staged batch of explorer step {e.explorer_step}, but the buffer's last committed "
                    f"step of explorer {self.s.explorer_id} is {first_step - 1}: the buffer and the continuation store disagree"
                )
        state = self.store.state()
        if state:
            self.tasks.load_state_dict(state["tasks"])
            self.draws = state["draws"]
        else:
            self.tasks.advance(first_step - 1)  # nothing staged yet: no partial step ever ran
        pending = [e.id for e in entries if e.kind == "pending"]
        if pending:
            self.groups = self._groups_from(self.store.load(pending))
        self._pending_ids = pending

    def _groups_from(self, batch: ExperienceBatch) -> list[Group]:
        groups: dict[str, Group] = {}
        carried = {
            k: Task(**t) for k, t in self.store.carried_tasks().items()
        }  # continued from a lineage's previous run
        for x in batch.experiences():
            task = self.by_id.get(x.task_id) or carried.get(x.task_id)
            if task is None:
                raise UserError(
                    f"{self.store.manifest()['uri']}: continuation of task {x.task_id!r}, which the task set no longer has; restore the task set or start a new run"
                )
            g = groups.setdefault(x.group_id, Group(x.group_id, task, x.prompt_text, []))
            g.members.append(
                Generation(
                    x.experience_id,
                    x.prompt_ids,
                    x.started_at or x.created_at,
                    x.response_ids,
                    x.logprobs,
                    x.versions,
                    x.segments or [],
                    None if x.finish_reason == UNFINISHED else x.finish_reason,
                )
            )
        return sorted(groups.values(), key=lambda g: g.first_step)

    # ---- one step

    def generate(self, e: int) -> tuple[ExperienceBatch, dict[str, Any]]:
        """Step e's batch: `batch_size` complete groups, oldest first (the staged one, if a crash left it)."""
        if self._outbox is not None and self._outbox[0] == e:
            return self.store.load([self._outbox[1]]), {"recovered_staged_batch": 1}
        b = self.s.batch_size
        resumed = sum(1 for g in self.groups for m in g.members if m.finish_reason is None)
        counts = {"rounds": 0, "extra_rounds": 0, "started_groups": 0, "segments": 0, "tokens": 0}
        new = [self._start_group() for _ in range(max(0, self.s.max_groups_in_flight - len(self.groups)))]
        self.groups += new
        counts["started_groups"] = len(new)
        # One generate call gives every held unfinished group its segment: a long batch keeps the
        # engine busy while the long tail waits for later steps.
        todo = [g for g in self.groups if not g.done]
        while True:
            self._segment(todo, e, counts["rounds"], counts)
            counts["rounds"] += 1
            short = b - sum(g.done for g in self.groups)
            if short <= 0:
                break
            todo = [g for g in self.groups if not g.done][:short]  # the batch is short: the oldest go on
            counts["extra_rounds"] += 1
        done = [g for g in self.groups if g.done][:b]
        self.groups = [g for g in self.groups if g not in done]
        batch, metrics = self._experiences(done, e)
        cut = sum(
            1
            for g in self.groups
            for m in g.members
            if m.finish_reason is None and m.segments[-1]["explorer_step"] == e
        )
        return batch, {
            **metrics,
            **counts,
            "resumed_generations": resumed,
            "cut_generations": cut,
            "pending_groups": len(self.groups),
            "continuations": self.catalog(e),
        }

    def catalog(self, e: int) -> dict[str, Any]:
        """The groups held after step e, for people (a Prefect table artifact mirrors it); the
        store's manifest, named by `manifest`, stays the source of truth."""
        rows = [
            {
                "group": g.group_id,
                "task": g.task.task_id,
                "finished": f"{sum(m.finish_reason is not None for m in g.members)}/{len(g.members)}",
                "segments": max(len(m.segments) for m in g.members),
                "tokens": sum(len(m.response_ids) for m in g.members),
                "versions": sorted({v for m in g.members for v in m.versions}),
                "age_steps": e - g.first_step,
            }
            for g in self.groups
        ]
        return {"manifest": self.store.manifest_uri, "groups": rows}

    def _start_group(self) -> Group:
        task = self.tasks.next_task()
        self.draws += 1
        text, ids = encode_task(self.tok, self.s.template, task, self.s.max_model_len)
        now = time.time()
        members = [Generation(uuid.uuid4().hex, list(ids), now) for _ in range(self.s.repeat_times)]
        return Group(group_id(self.s.explorer_id, self.draws, task.task_id), task, text, members)

    def _segment(self, groups: list[Group], e: int, round_: int, counts: dict[str, int]) -> None:
        """One segment for every unfinished member of `groups`, in one batched generate call."""
        p, limit = self.s.partial, self.s.max_model_len
        members = [(g, m) for g in groups for m in g.members if m.finish_reason is None]
        budgets = [
            min(
                p.segment_max_tokens,
                p.max_response_tokens - len(m.response_ids),
                limit - len(m.prompt_ids) - len(m.response_ids),
            )
            for _, m in members
        ]
        ready = [(m, n) for (_, m), n in zip(members, budgets) if n > 0]
        for (g, m), n in zip(members, budgets):
            if n <= 0 and not m.segments:
                raise UserError(
                    f"the prompt of task {g.task.task_id!r} has {len(m.prompt_ids)} tokens, which leaves no room for a response within "
                    f"model.max_model_len = {limit}; shorten the prompt or raise model.max_model_len"
                )
            if n <= 0:
                m.finish_reason = "truncated"
        if not ready:
            return
        # A distinct seed per (explorer, step, round): segments never share a sampling stream.
        seed = int.from_bytes(
            hashlib.blake2b(f"{self.s.seed}/{self.s.explorer_id}/{e}/{round_}".encode(), digest_size=6).digest(),
            "little",
        )
        version = self.engine.version
        out = self.engine.generate(
            [m.prompt_ids + m.response_ids for m, _ in ready],
            1,
            self.s.sampling,
            seed,
            max_tokens=[n for _, n in ready],
            repeat=(p.repeat_ngram, p.repeat_threshold),
        )
        for (m, _), (r,) in zip(ready, out):
            start = m.extend(e, version, r.response_ids, r.logprobs)
            self._finish(m, r.finish_reason, start)
            counts["segments"] += 1
            counts["tokens"] += len(r.response_ids)

    def _finish(self, m: Generation, reason: str, start: int) -> None:
        """Classify a member after the segment that began at `start`: stop / repeat / truncated,
        or still cut (None).

        vLLM's repetition detector and stop strings see only this segment's tokens (the earlier
        ones are its prompt), so whatever reason the engine gave, the whole response decides
        where it ends: at the first prefix past `start` that repeats or holds a stop string (the
        earlier of the two). An engine `repeat` or a `stop` on EOS can come after a loop that
        began in an earlier segment has already completed. Since every segment end is checked,
        no repetition can complete inside an earlier segment. With neither found the engine's
        reason stands; after `length` the response is truncated at its limits, or cut."""
        p = self.s.partial
        cuts = {
            "stop": stop_cut(self.tok, m.response_ids, start, self.s.sampling.stop),
            "repeat": repeat_cut(m.response_ids, start, p.repeat_ngram, p.repeat_threshold),
        }
        found = {k: v for k, v in cuts.items() if v is not None}
        if found:
            why = min(found, key=found.get)
            m.keep(found[why])
            m.finish_reason = why
        elif reason in ("stop", "repeat"):
            m.finish_reason = reason
        elif (
            len(m.response_ids) >= p.max_response_tokens
            or len(m.prompt_ids) + len(m.response_ids) >= self.s.max_model_len
        ):
            m.finish_reason = "truncated"

    def _experiences(self, groups: list[Group], e: int) -> tuple[ExperienceBatch, dict[str, Any]]:
        """Score finished groups (a repeat gets `repeat_penalty` added) into step e's rows."""
        flat = [
            (g, m, response_text(self.tok, m.response_ids, self.s.sampling.stop)) for g in groups for m in g.members
        ]
        batch, scores = score_groups(
            flat, self.reward_fn, self.s.explorer_id, e, self.s.partial.repeat_penalty, self.pool, self.s.failed_reward
        )
        reasons = [m.finish_reason for _, m, _ in flat]
        mix = {f"finish/{r}": reasons.count(r) for r in sorted(set(reasons))}
        return batch, {
            **mix,
            **{k: v for k, v in scores.metrics.items() if k in ("reward/errors", "reward/timeouts", "reward/crashes")},
        }

    # ---- staging and committing

    def stage(self, e: int, batch: ExperienceBatch) -> None:
        """Before step e's buffer commit: stage its batch and the still-pending groups, retiring
        the previous pending set, in one manifest write (a no-op for a recovered batch)."""
        if self._outbox is not None and self._outbox[0] == e:
            return
        now = time.time()
        pending = ExperienceBatch.from_experiences(
            experience_row(g, m, self.s.explorer_id, m.segments[-1]["explorer_step"], 0.0, {}, "", now)
            for g in self.groups
            for m in g.members
        )
        state = {"tasks": self.tasks.state_dict(), "draws": self.draws}
        ids = self.store.commit(
            [(batch, "outbox"), (pending, "pending")], explorer_step=e, retire=self._pending_ids, state=state
        )
        self._outbox, self._pending_ids = (e, ids[0]), [i for i in ids[1:] if i is not None]

    def committed(self, e: int) -> None:
        """After step e's buffer commit: retire its outbox."""
        if self._outbox is not None and self._outbox[0] == e:
            self.store.retire([self._outbox[1]])
            self._outbox = None
