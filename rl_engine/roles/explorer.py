"""The explorer: one rollout engine, its task stream, the reward, and its buffer writer.

`Explorer.step(e)` is one explorer step: take `batch_size` tasks, generate `repeat_times`
rollouts each with the engine's current weights, score them, and commit the experiences to the
buffer under `explorer=<id>/step=<e>/`. Every token is tagged with the engine's weight version,
which is what the schedule tests read back. Each action is recorded as a timeline span.

Weight sync: `receive(version)` is the rendezvous side (wait for the trainer to reach the
version, then load it), `pick_up_newest()` the decoupled side (load the newest published
version if any; wait only when admission control requires it: `max_staleness`, or the backlog cap
without it, see `rl_engine.schedule.admission_wait`). How the weights travel, and the
board keys of that handshake, are the sync method's business (`rl_engine.sync`).

Engines are expensive to start (~12 s on 2 CPU cores, and vLLM's first generate call may pay one-off
set-up costs, which `warm_up` takes before the first step). The explorer records both as
its `engine_start` span, so rollout 1 is generation only. `ENGINES` keeps engines warm across
runs of one process when RFT_KEEP_ENGINES=1 (tests, benchmarks; Prefect's `serve` and workers
start each flow run in a new process, where it keeps nothing): a reused engine is reset to the run's base
weights (version 0) before it is handed out. Across processes, an engine server does that
(`explorer.engine.servers`, rl_engine.rollout.server): the explorer claims it, loads the base
weights into it, and releases it at the end.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from typing import Any

import pyarrow.compute as pc

from rl_engine.adapter import synced_adapter
from rl_engine.board import TRAINER_KEY, StopSignal, role_name
from rl_engine.buffer import BufferWriter, ContinuationStore
from rl_engine.experience import ExperienceBatch
from rl_engine.proc.failpoints import failpoint
from rl_engine.rewards import TaskIterator, encode_task, load_taskset
from rl_engine.rewards.remote import TimedReward
from rl_engine.rewards.run_service import run_reward
from rl_engine.roles.episodes import explore_episodes
from rl_engine.roles.groups import Group, group_id, one_step_generation, score_groups
from rl_engine.roles.partial import PartialRollouts, PartialSettings
from rl_engine.rollout.engine import build_rollout_engine
from rl_engine.rollout.workflow import build_workflow
from rl_engine.run.context import RunContext
from rl_engine.run.devices import device_plan
from rl_engine.run.lease import Fence
from rl_engine.run.timeline import STARTUP, TimelineRecorder
from rl_engine.schedule import admission_wait, batch_number, batches_needed
from rl_engine.sync import build_weight_receiver
from rl_engine.sync.base import SyncError


def _trainer_state(trainer: dict[str, Any]) -> tuple[int, int, int]:
    """What an explorer waiting at admission control waits to change on the trainer's board entry."""
    return trainer.get("version", 0), trainer.get("published", -1), trainer.get("lost_rows", 0)


# The explorer step's metrics of a multi-turn workflow (rl_engine.roles.episodes).
WORKFLOW_METRICS = ("episodes", "turns_mean", "env_token_frac", "workflow_errors")


def warm_up(engine: Any, sampling: Any) -> None:
    """One tiny generate call with the run's sampling settings: what vLLM's first call pays once
    (kernel set-up; on CPU 1.8-4 s of torch.compile before the engine ran without dynamo, now 0.02 s)
    belongs to start-up, not to rollout 1. A one-token prompt is shorter
    than a KV block, so nothing of it stays in the prefix cache; the per-request seeds of later
    calls make their samples independent of this one."""
    token = engine.tokenizer.eos_token_id or 0
    engine.generate([[token]], 1, sampling.model_copy(update={"max_tokens": 2}), seed=0)


def _engine_devices(run: RunContext, explorer_id: int) -> str | None:
    """CUDA_VISIBLE_DEVICES of this explorer's engine from the run's device plan (None: inherit; CPU, deployments)."""
    return device_plan(run.cfg).engine_visible(explorer_id)


class EnginePool:
    """Warm rollout engines of this process, keyed by everything that fixes an engine's shape."""

    def __init__(self) -> None:
        self._idle: dict[str, list[Any]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(run: RunContext, explorer_id: int) -> str:
        m = run.cfg.model
        return json.dumps(
            [
                m.path,
                m.tokenizer_path,
                m.dtype,
                m.max_model_len,
                None if (lora := synced_adapter(m.lora)) is None else lora.model_dump(),  # an engine serving LoRA
                run.cfg.explorer.engine.model_dump(),
                run.cfg.seed,
                explorer_id,
                _engine_devices(run, explorer_id),
            ]
        )

    def acquire(self, run: RunContext, explorer_id: int) -> Any:
        if run.cfg.explorer.engine.servers:  # a served engine, up between runs (rl_engine.rollout.server)
            from rl_engine.rollout.server import build_server_engine

            engine = build_server_engine(run.cfg, explorer_id, owner=f"{run.url} explorer {explorer_id}")
            try:
                self._reset(run, engine)
            except BaseException:
                engine.close()
                raise
            return engine
        with self._lock:
            idle = self._idle.get(self._key(run, explorer_id), [])
            engine = idle.pop() if idle else None
        if engine is None:
            engine = build_rollout_engine(run.cfg, explorer_id, cuda_visible=_engine_devices(run, explorer_id))
            warm_up(engine, run.cfg.explorer.sampling)
            return engine
        self._reset(run, engine)
        return engine

    @staticmethod
    def _reset(run: RunContext, engine: Any) -> None:
        """A reused engine holds the last run's weights: load the base model's again (version 0)."""
        engine.rpc("rft_load_checkpoint", run.cfg.model.path, 0)
        engine.mark_synced(0)

    def release(self, run: RunContext, explorer_id: int, engine: Any) -> None:
        if run.cfg.explorer.engine.servers:
            engine.close()  # releases the server's claim; the server stays up
        elif os.environ.get("RFT_KEEP_ENGINES") == "1":
            with self._lock:
                self._idle.setdefault(self._key(run, explorer_id), []).append(engine)
        else:
            engine.close()

    def close_all(self) -> None:
        with self._lock:
            engines = [e for idle in self._idle.values() for e in idle]
            self._idle.clear()
        for e in engines:
            e.close()


ENGINES = EnginePool()


def build_user_code_pool(taskset: Any, name: str) -> Any:
    """The explorer's pool of worker processes for user code (python rewards, workflows' tool
    calls); None when the task set runs none (built-in rewards run in the explorer's thread)."""
    from rl_engine.registry import REWARDS
    from rl_engine.rewards.isolation import UserCodePool

    if REWARDS.builtin(taskset.reward.type) and taskset.workflow.type == "single_turn":
        return None
    return UserCodePool(taskset.user_code.workers, name)


def generate_experiences(
    engine: Any, tasks: list[Any], reward_fn: Any, cfg: Any, explorer_id: int, step: int, pool: Any = None
) -> tuple[ExperienceBatch, dict[str, Any]]:
    """`repeat_times` rollouts of each task with the engine's current weights, scored, as experiences.

    Step `step`'s `tasks` are the step-th batch of the explorer's task stream (a resumed explorer
    skips the batches of committed steps), which numbers their draws for the group ids. Each
    rollout is a one-segment generation; rows come from the same builder as partial rollouts'
    (`rl_engine.roles.groups`). A sample whose reward raised is left out (counted in the returned
    reward metrics); the rest of its group stays. Every token is tagged with the engine's weight version.
    """
    encoded = [encode_task(engine.tokenizer, cfg.taskset.template, t, cfg.model.max_model_len) for t in tasks]
    texts, prompts = [text for text, _ in encoded], [ids for _, ids in encoded]
    # A distinct seed per (explorer, step) keeps runs reproducible without repeating samples.
    outs = engine.generate(
        prompts, cfg.algorithm.repeat_times, cfg.explorer.sampling, seed=cfg.seed * 100_003 + 1009 * explorer_id + step
    )
    drawn = (step - 1) * len(tasks)  # draws of the steps before: one batch each
    groups = [
        Group(
            group_id(explorer_id, drawn + i + 1, task.task_id),
            task,
            text,
            [one_step_generation(uuid.uuid4().hex, step, r) for r in rollouts],
        )
        for i, (task, text, rollouts) in enumerate(zip(tasks, texts, outs))
    ]
    flat = [(g, m, r.text) for g, rollouts in zip(groups, outs) for m, r in zip(g.members, rollouts)]
    batch, scores = score_groups(
        flat, reward_fn, explorer_id, step, pool=pool, failed_reward=cfg.taskset.user_code.failed_reward
    )
    return batch, scores.metrics


def partial_settings(cfg: Any, explorer_id: int) -> PartialSettings:
    x = cfg.explorer
    return PartialSettings(
        x.partial,
        x.sampling,
        x.batch_size,
        cfg.algorithm.repeat_times,
        cfg.model.max_model_len,
        cfg.taskset.template,
        cfg.seed,
        explorer_id,
        cfg.taskset.user_code.failed_reward,
    )


class Explorer:
    """Generates, scores and writes experiences; holds a live vLLM engine."""

    def __init__(
        self,
        run: RunContext,
        explorer_id: int = 0,
        stop: StopSignal | None = None,
        first_step: int = 1,
        fence: Fence | None = None,
    ):
        cfg = run.cfg
        self.run, self.cfg, self.explorer_id = run, cfg, explorer_id
        self.name = role_name(explorer_id)
        self.timeline = TimelineRecorder(*run.fs(), self.name, enabled=cfg.monitor.timeline)
        self.board = run.board
        with self.timeline.span(STARTUP, version=0):  # engine start-up and warm-up: before step 1, not in it
            self.engine = ENGINES.acquire(run, explorer_id)
        self.receiver = build_weight_receiver(cfg, self.board, explorer_id)
        self.receiver.connect(self.engine, stop)  # collective: blocks until the trainer and every explorer joined
        self.tokenizer = self.engine.tokenizer
        tasks = load_taskset(cfg.taskset, run.storage_options)
        # Each explorer walks its own seeded order, so several explorers do not repeat each other in lockstep.
        self.tasks = TaskIterator(
            tasks, cfg.explorer.batch_size, seed=cfg.seed + 1000 * explorer_id, shuffle=cfg.taskset.shuffle
        )
        # Under placement deployments a model reward is the reward role's service, found on the board.
        self.reward_fn = run_reward(cfg.taskset.reward, cfg, self.board, stop)
        if hasattr(self.reward_fn, "score_samples"):  # a service's or sandbox's scoring is a span of its own (timeline)
            self.reward_fn = TimedReward(self.reward_fn, self.timeline)
        self.workflow = build_workflow(cfg.taskset.workflow)  # None: single-turn rollouts
        self.pool = build_user_code_pool(cfg.taskset, self.name)
        self.fence = fence or Fence(*run.fs(), None)
        self.writer = BufferWriter(*run.fs(), explorer_id, before_commit=self.fence.check)
        self.partial: PartialRollouts | None = None
        if cfg.explorer.partial.enabled:  # it restores the task stream's position with its continuations
            store = ContinuationStore(*run.fs(), explorer_id)
            self.partial = PartialRollouts(
                self.engine,
                store,
                self.tasks,
                self.reward_fn,
                partial_settings(cfg, explorer_id),
                first_step,
                self.pool,
            )
        else:
            self.tasks.advance(first_step - 1)  # step e draws the e-th batch of the stream, also after a resume

    @property
    def version(self) -> int:
        return self.engine.version

    def step(self, e: int) -> dict[str, Any]:
        """Explorer step e: rollout -> reward -> buffer; returns its metrics."""
        v, started = self.engine.version, time.time()
        if isinstance(self.reward_fn, TimedReward):
            self.reward_fn.step, self.reward_fn.version = e, v
        with self.timeline.span("rollout", step=e, version=v) as span:
            if self.workflow is not None:
                batch, reward_metrics = explore_episodes(
                    self.engine,
                    self.tasks.next_batch(),
                    self.workflow,
                    self.reward_fn,
                    self.cfg,
                    self.explorer_id,
                    e,
                    self.pool,
                )
                span.turns = round(reward_metrics["turns_mean"], 3)
            elif self.partial is None:
                batch, reward_metrics = generate_experiences(
                    self.engine, self.tasks.next_batch(), self.reward_fn, self.cfg, self.explorer_id, e, self.pool
                )
            else:
                batch, reward_metrics = self.partial.generate(e)
                span.cut, span.resumed = (
                    reward_metrics.get("cut_generations"),
                    reward_metrics.get("resumed_generations"),
                )
        with self.timeline.span("write", step=e, version=v):
            if self.partial is not None:
                self.fence.check()  # the continuation store's manifest is the new holder's too
                self.partial.stage(e, batch)
                failpoint("explorer.after_stage", e)
            self.writer.write(e, batch)
            if self.partial is not None:
                failpoint("explorer.after_commit", e)
                self.partial.committed(e)
        self.timeline.flush()
        rewards = batch.column("reward")
        lengths = pc.list_value_length(batch.to_table().column("response_ids")).to_numpy()
        return {
            "explorer_id": self.explorer_id,
            "explorer_step": e,
            "version": v,
            "experiences": len(batch),
            "reward_mean": float(rewards.mean()) if len(batch) else 0.0,
            "response_len_mean": float(lengths.mean()) if len(batch) else 0.0,
            "tokens": int(lengths.sum()),
            "rollout_s": time.time() - started,
            "reward_errors": reward_metrics.get("reward/errors", reward_metrics.get("reward_errors", 0)),
            "reward_timeouts": reward_metrics.get("reward/timeouts", 0),
            "reward_crashes": reward_metrics.get("reward/crashes", 0),
            # code_tests: its sandbox runs (timeouts, killed, output_limit, errors, passed_frac, run_ms_mean)
            **{
                k.replace("reward/sandbox/", "sandbox_"): v
                for k, v in reward_metrics.items()
                if k.startswith("reward/sandbox/")
            },
            # the model reward's service and the judge: latency_ms, samples_per_s, failures, timeouts, ...
            **{k: v for k, v in reward_metrics.items() if k.startswith(("reward/model/", "reward/judge/"))},
            **({"partial": self._partial_metrics(reward_metrics)} if self.partial is not None else {}),
            **({k: reward_metrics[k] for k in WORKFLOW_METRICS} if self.workflow is not None else {}),
        }

    def _partial_metrics(self, m: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in m.items() if not k.startswith("reward/")}
        if "continuations" in out:  # who they belong to, and whether to mirror them as an artifact
            out["continuations"] = {**out["continuations"], "run": self.cfg.name, "publish": self.cfg.monitor.artifacts}
        return out

    # ---- weight sync

    def _install(self, version: int, stop: StopSignal) -> int:
        """Load `version` (announced by the trainer) into the engine; the receiver acknowledges it."""
        with self.timeline.span(
            "wait", version=self.engine.version
        ):  # the trainer's go (collective) or the commit (checkpoint)
            self.receiver.prepare(version, stop)
        with self.timeline.span("sync", version=version, method=self.receiver.method) as span:
            got = self.receiver.receive(self.engine, version)
            span.version = got
        self.timeline.flush()
        return got

    def _wait_published(self, newer_than: int, what: str, stop: StopSignal) -> int:
        with self.timeline.span("wait", version=self.engine.version):
            m = self.board.wait(
                TRAINER_KEY,
                lambda m: m.get("published", -1) > newer_than,
                what=what,
                timeout_s=self.cfg.synchronizer.wait_timeout_s,
                stop=stop,
            )
        return m["published"]

    def receive(self, version: int, stop: StopSignal) -> int:
        """Rendezvous: wait until the trainer has published `version`, then load exactly it."""
        self._wait_published(version - 1, f"trainer to publish version {version}", stop)
        got = self._install(version, stop)
        if got != version:  # delta checkpoint sync fell back to an older full version (its log says why)
            raise SyncError(
                f"explorer {self.explorer_id} must load version {version} at this rendezvous but could install only version {got}: "
                "a delta of the chain is missing or damaged. Resume the run (`rft run CONFIG --resume RUN`): the trainer publishes a full checkpoint first"
            )
        return got

    def _install_newest(self, stop: StopSignal) -> dict[str, Any]:
        trainer = self.board.get(TRAINER_KEY) or {}
        if trainer.get("published", -1) > self.engine.version:
            self._install(trainer["published"], stop)
        return trainer

    def pick_up_newest(self, e: int, stop: StopSignal) -> int:
        """Decoupled, before explorer step e: wait while admission control forbids starting the
        batch, then load the newest published version if newer. Its number among all the
        explorers' batches is fixed in advance (`batch_number`: round robin), and the trainer
        consumes batches in that order, so the bound admission checks is the one training keeps.
        The wait judges the newest published version, and only an admitted batch loads it: an
        explorer waiting its turn behind the others would otherwise download every version
        meanwhile. A broadcast waits for every explorer, so there each version is joined as it comes."""
        b = batch_number(self.explorer_id, e, self.cfg.explorer.count)
        trainer = self.board.get(TRAINER_KEY) or {}
        while not stop.is_set():
            if self.receiver.joins_every_version:
                trainer = self._install_newest(stop)
            why = self._why_wait(b, max(self.engine.version, trainer.get("published", -1)), trainer)
            if why is None:
                trainer = self._install_newest(stop)
                if (
                    why := self._why_wait(b, self.engine.version, trainer)
                ) is None:  # a delta chain's fallback may leave it older
                    break
            seen = _trainer_state(trainer)
            with self.timeline.span("wait", step=e, version=self.engine.version):
                self.board.wait(
                    TRAINER_KEY,
                    lambda m: _trainer_state(m) != seen,
                    what=why,
                    timeout_s=self.cfg.synchronizer.wait_timeout_s,
                    stop=stop,
                )
            trainer = self.board.get(TRAINER_KEY) or {}
        return self.engine.version

    def _why_wait(self, b: int, version: int, trainer: dict[str, Any]) -> str | None:
        """Why batch b may not start yet with weights `version` (admission control), or None."""
        cfg = self.cfg
        explorer_batch = cfg.explorer.batch_size * cfg.algorithm.repeat_times
        if b > (
            needed := batches_needed(
                cfg.trainer.total_steps, explorer_batch, cfg.trainer.train_batch_size, trainer.get("lost_rows", 0)
            )
        ):
            return f"the trainer to finish: its {cfg.trainer.total_steps} steps train {needed} batches, none past them"
        return admission_wait(
            b - 1,
            version,
            trainer.get("version", 0),
            explorer_batch,
            cfg.trainer.train_batch_size,
            cfg.synchronizer.max_staleness,
            cfg.synchronizer.max_backlog_steps,
        )

    def close(self) -> None:
        self.timeline.flush()
        if self.pool is not None:
            self.pool.close()
        if hasattr(self.reward_fn, "close"):  # the model reward's service: the last client stops it
            self.reward_fn.close()
        self.receiver.close()
        ENGINES.release(self.run, self.explorer_id, self.engine)
