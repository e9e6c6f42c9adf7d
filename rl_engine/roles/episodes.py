"""An explorer step under a multi-turn workflow: run the step's episodes, group them, score them into rows.

`repeat_times` episodes of each task form its GRPO group, as single-turn rollouts do, with the
same group ids (`rl_engine.roles.groups`), so the schedule, staleness and exactly-once rules of
every mode hold unchanged. A row's response is the whole episode after the prompt: the policy's
tokens (loss mask 1) and the environment's (loss mask 0, behavior logprob 0), each tagged with
the engine's weight version. Its reward is the workflow's return value, or, when that is None,
`taskset.reward` on the last model turn's text (in the user-code pool for python rewards). An
episode whose workflow raised or timed out is left out (counted, its task named in the log),
is trained as far as it got with `taskset.user_code.failed_reward`, or fails the run, as
`taskset.user_code.on_episode_error` says. When a chat template rendered the prompt, the episode
starts with that chat (`episode.messages`: the task's prompt as the user's message).

    batch, metrics = explore_episodes(engine, tasks, workflow, reward_fn, cfg, explorer_id, step, pool)
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from rl_engine.errors import UserError
from rl_engine.experience import ExperienceBatch, version_runs
from rl_engine.rewards import RolloutSample, encode_task, score_rollouts
from rl_engine.roles.groups import Generation, Group, experience_row, group_id
from rl_engine.rollout.workflow import EpisodeJob, EpisodeResult, derived_seed, run_episodes

log = logging.getLogger(__name__)


def episode_generation(step: int, r: EpisodeResult) -> Generation:
    """A finished episode as a one-step generation: its segments are the runs of equal versions."""
    return Generation(
        uuid.uuid4().hex,
        list(r.prompt_ids),
        None,
        list(r.response_ids),
        list(r.logprobs),
        list(r.versions),
        version_runs(step, r.versions),
        r.finish_reason,
        list(r.loss_mask),
    )


def explore_episodes(
    engine: Any,
    tasks: list[Any],
    workflow: Any,
    reward_fn: Any,
    cfg: Any,
    explorer_id: int,
    step: int,
    pool: Any = None,
) -> tuple[ExperienceBatch, dict[str, Any]]:
    """Explorer step `step` of a workflow: `repeat_times` episodes of each task, scored; (rows, metrics)."""
    uc, n = cfg.taskset.user_code, cfg.algorithm.repeat_times
    encoded = [encode_task(engine.tokenizer, cfg.taskset.template, t, cfg.model.max_model_len) for t in tasks]
    step_seed = cfg.seed * 100_003 + 1009 * explorer_id + step  # as single-turn rollouts seed their step
    chat = cfg.taskset.template is None and bool(
        getattr(engine.tokenizer, "chat_template", None)
    )  # format_prompt's rule
    jobs = [
        EpisodeJob(
            t, text, ids, derived_seed(step_seed, i, k), [{"role": "user", "content": t.prompt}] if chat else None
        )
        for i, (t, (text, ids)) in enumerate(zip(tasks, encoded))
        for k in range(n)
    ]
    started = time.time()
    results = run_episodes(
        engine,
        workflow,
        jobs,
        cfg.explorer.sampling,
        cfg.model.max_model_len,
        uc.episode_timeout_s,
        pool,
        uc.tool_timeout_s,
        cfg.model.path,
    )
    failed = [r for r in results if r.error is not None]
    for r in failed:
        log.warning(
            "explorer %d step %d: the episode of task %r failed: %s",
            explorer_id,
            step,
            jobs[r.index].task.task_id,
            r.error,
        )
    if failed and uc.on_episode_error == "score":  # trained as far as it got, with the failure's reward
        for r in failed:
            if 1 in r.loss_mask:  # one without a model token has nothing to train
                r.reward, r.error = {"failed": uc.failed_reward}, None
    elif failed and (uc.on_episode_error == "fail" or len(failed) == len(results)):
        r = failed[0]
        why = (
            "taskset.user_code.on_episode_error is fail"
            if uc.on_episode_error == "fail"
            else f"it failed on all {len(results)} episodes of the step"
        )
        raise UserError(
            f"taskset.workflow ({_describe(cfg.taskset.workflow)}) failed on task {jobs[r.index].task.task_id!r}: {r.error} ({why}); "
            "fix the workflow (a sporadic failure is left out and counted as workflow_errors with on_episode_error: drop)"
        )
    drawn = (step - 1) * len(tasks)  # draws of the steps before: one batch each
    flat: list[tuple[Group, Generation, EpisodeResult]] = []
    for i, (task, (text, _)) in enumerate(zip(tasks, encoded)):
        mine = [r for r in results[i * n : (i + 1) * n] if r.error is None]
        g = Group(
            group_id(explorer_id, drawn + i + 1, task.task_id), task, text, [episode_generation(step, r) for r in mine]
        )
        flat += list(zip([g] * len(mine), g.members, mine))
    batch, metrics = score_episodes(flat, reward_fn, engine.tokenizer, explorer_id, step, pool, uc.failed_reward)
    ok = [r for _, _, r in flat]
    env = sum(len(r.loss_mask) - sum(r.loss_mask) for r in ok)
    tokens = sum(len(r.loss_mask) for r in ok)
    return batch, {
        **metrics,
        "episodes": len(ok),
        "turns_mean": sum(r.turns for r in ok) / max(len(ok), 1),
        "env_token_frac": env / max(tokens, 1),
        "workflow_errors": len(failed),
        "episodes_s": time.time() - started,
    }


def score_episodes(
    flat: list[tuple[Group, Generation, EpisodeResult]],
    reward_fn: Any,
    tokenizer: Any,
    explorer_id: int,
    step: int,
    pool: Any = None,
    failed_reward: float | None = None,
) -> tuple[ExperienceBatch, dict[str, Any]]:
    """Rows of finished episodes: the workflow's reward where it returned one, else taskset.reward on
    the last turn's text; a sample whose reward failed is left out (counted in the metrics). The
    row's response text is the whole episode, the environment's text included."""
    samples = [RolloutSample(g.prompt_text, r.last_text, g.task, r.finish_reason) for g, _, r in flat]
    scores = score_rollouts(reward_fn, samples, pool, failed_reward, given=[r.reward for _, _, r in flat])
    now = time.time()
    rows = [
        experience_row(
            g, m, explorer_id, step, reward, comps, tokenizer.decode(r.response_ids, skip_special_tokens=False), now
        )
        for (g, m, r), reward, comps, ok in zip(flat, scores.rewards, scores.components, scores.ok)
        if ok
    ]
    return ExperienceBatch.from_experiences(rows), scores.metrics


def _describe(wf: Any) -> str:
    return f"python {wf.function!r}" if wf.type == "python" else wf.type  # a registered name says itself
