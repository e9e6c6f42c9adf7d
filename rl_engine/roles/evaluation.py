"""Evaluation during training: explorer 0 scores the held-out sets with exactly the version each evaluation names.

Due versions (`due_versions`): the one the run starts from (`eval.at_start`: 0, or the trainer
version a resumed run restarts at), every `eval.every_versions`-th, and the last
(`eval.at_end`: trainer.total_steps). The trainer saves the weights of every due version after
the start as `<run>/eval/version=<v>/model/` (a Hugging Face directory, `COMMITTED` written
last: `save_due_weights`).

Pinning the version: explorer 0 evaluates between its steps, on its own engine (no second
engine, whose memory a GPU run would rather give to rollouts; the cost is the run's time the
explorer spends evaluating, `bench.learning` reports it). A due version v is evaluated

- as soon as the engine holds exactly v (`after_install`): in the rendezvous modes it receives
  every due version (`eval.every_versions` is a multiple of `synchronizer.sync_interval`), right
  after the sync, before its next rollout;
- otherwise from the trainer's saved weights, loaded into the engine (`catch_up`): a decoupled
  explorer picks up the newest version and may jump past v; it then holds v until its next sync
  (admission control checks the staleness of its next batch as usual); and the last version,
  after the explorer's last step (`finish`).

Each evaluation is a timeline span (kind `eval`) and one record `<run>/metrics/role=eval/step=<v>.json`:
`{version, time, seconds, "<set>/avg@n", "<set>/pass@k", "<set>/reward_mean", ..., probe}`, where
`probe` holds the engine's logprobs of a fixed sequence (the first eval task's prompt), a
fingerprint of the weights it evaluated with
(`rl_engine.evaluate.set_metrics`); a resumed run skips the versions recorded. The samples are
drawn as explorer steps draw theirs (the run's workflow too), with the set's own reward, `n` and
temperature, and seeds apart from the training ones.

Best version (`eval.keep_best`): `<run>/eval/best.json` names it `{version, metric, value, model}`;
its weights stay (version 0's are the run's start model), every other evaluated version's saved
weights are deleted once evaluated. Retention (`rl_engine.run.retention`, `rl_engine.sync`)
never touches `<run>/eval/`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from rl_engine.board import Board
from rl_engine.evaluate import _exact, set_metrics
from rl_engine.experience import ExperienceBatch
from rl_engine.rewards import Task, load_taskset
from rl_engine.rewards.run_service import run_reward
from rl_engine.run.context import RunContext
from rl_engine.run.report import BEST, EVAL_COMMITTED, EVAL_DIR, EVAL_ROLE, METRICS_DIR, read_best, record_step
from rl_engine.storage import join, write_json

log = logging.getLogger(__name__)

_SEED_STEP = 1_000_000  # evaluation seeds start here: apart from every explorer step's
_WAIT_S = 2.0  # how often `finish` looks for the trainer's saved weights
OnEval = Callable[[dict[str, Any]], Any]


def due_versions(eval_cfg: Any, total: int, start: int = 0) -> list[int]:
    """The versions a run evaluates, in order: `start` (at_start), multiples of every_versions
    after it, and `total` (at_end)."""
    out = {start} if eval_cfg.at_start else set()
    if eval_cfg.every_versions:
        out |= {v for v in range(start + 1, total + 1) if v % eval_cfg.every_versions == 0}
    if eval_cfg.at_end:
        out.add(total)
    return sorted(v for v in out if start <= v <= total)


def weights_url(run_url: str, version: int) -> str:
    return f"{run_url.rstrip('/')}/{EVAL_DIR}/version={version}"


def save_due_weights(run: RunContext, trainer: Any, start: int) -> str | None:
    """Trainer side (the trainer role), after a step and when a resumed trainer starts: the weights
    of a due version not evaluated yet, for the evaluation to load (version 0's are model.path,
    never copied). Returns where they went, or None when there is nothing to save."""
    cfg = run.cfg
    v = trainer.version
    if not cfg.eval.enabled or v == 0 or v not in due_versions(cfg.eval, cfg.trainer.total_steps, start):
        return None
    fs, root = run.fs()
    if fs.exists(join(root, METRICS_DIR, f"role={EVAL_ROLE}", f"step={v:08d}.json")):
        return None  # a resumed run's start version that the stopped attempt evaluated already
    url = weights_url(run.url, v)
    with trainer.timeline.span("write", step=v, version=v):
        trainer.trainer.save_hf(f"{url}/model", run.storage_options)
    write_json(fs, join(root, EVAL_DIR, f"version={v}", EVAL_COMMITTED), {"version": v, "time": time.time()})
    return url


class Evaluator:
    """Explorer 0's evaluations (see the module docstring)."""

    def __init__(self, run: RunContext, explorer: Any, start: int, on_eval: OnEval | None = None):
        self.run, self.cfg, self.explorer, self.on_eval = run, run.cfg, explorer, on_eval
        total = run.cfg.trainer.total_steps
        # A resumed run: the stopped attempt's due versions too (a kill between a version's saved
        # weights and its evaluation leaves it pending), and the version it restarts at.
        self.due = sorted(set(due_versions(run.cfg.eval, total, 0)) | set(due_versions(run.cfg.eval, total, start)))
        self.start = start
        self.done = self._recorded()
        self._sets: dict[str, tuple[list[Task], Any]] = {}

    # ---- when

    def _recorded(self) -> set[int]:
        fs, root = self.run.fs()
        fs.invalidate_cache()
        found = fs.glob(join(root, METRICS_DIR, f"role={EVAL_ROLE}", "step=*.json"))
        return {int(p.rsplit("step=", 1)[1].split(".")[0]) for p in found}

    def pending(self) -> list[int]:
        return [v for v in self.due if v not in self.done]

    def _available(self, v: int) -> bool:
        """Weights of `v` to load: model.path for version 0, else the trainer's saved ones."""
        return v == 0 or self._committed(v)

    def _committed(self, v: int) -> bool:
        fs, root = self.run.fs()
        fs.invalidate_cache()
        return fs.exists(join(root, EVAL_DIR, f"version={v}", EVAL_COMMITTED))

    def after_install(self) -> None:
        """The engine holds a new version (or the start's): evaluate it now if it is due."""
        v = self.explorer.version
        if v in self.pending():
            self.evaluate(v)

    def catch_up(self) -> None:
        """Due versions older than the engine's that it never held: evaluate them from the trainer's
        saved weights. Checkpoint sync only: its explorer then loads the newest checkpoint again,
        while a collective explorer could only wait for a broadcast of a version already sent
        (and never skips one: every explorer joins every broadcast)."""
        if self.cfg.synchronizer.sync_method != "checkpoint":
            return
        for v in self.pending():
            if v < self.explorer.version and self._available(v):
                self._load(v)
                self.evaluate(v)

    def finish(self, timeout_s: float, gone: Callable[[], bool]) -> None:
        """After the explorer's last step: the due versions left (the last one), from the trainer's
        saved weights, waiting up to `timeout_s` for each while `gone()` (the run failed or was
        cancelled) is false."""
        for v in self.pending():
            if v == self.explorer.version:
                self.evaluate(v)
                continue
            if v < self.start:  # the stopped attempt's: its weights were saved, or never will be
                if self._available(v):
                    self._load(v)
                    self.evaluate(v)
                else:
                    log.warning("evaluation of version %d skipped: the stopped attempt saved no weights of it", v)
                continue
            deadline = time.monotonic() + timeout_s
            while not self._committed(v):
                if gone() or time.monotonic() > deadline:
                    log.warning(
                        "evaluation of version %d skipped: its weights were not saved within %.0f s", v, timeout_s
                    )
                    return
                time.sleep(_WAIT_S)
            self._load(v)
            self.evaluate(v)

    # ---- how

    def _load(self, v: int) -> None:
        from rl_engine.storage import local_dir

        engine = self.explorer.engine
        url = self.cfg.model.path if v == 0 else f"{weights_url(self.run.url, v)}/model"
        with local_dir(url, self.run.storage_options) as path:
            engine.rpc("rft_load_checkpoint", path, v)
        engine.mark_synced(v)

    def score_set(self, s: Any, version: int) -> dict[str, float]:
        x = self.explorer
        if s.name not in self._sets:
            self._sets[s.name] = eval_tasks(self.cfg, s, self.run.storage_options, self.run.board)
        return score_set(x.engine, self.cfg, s, self._sets[s.name], version, x.workflow, x.pool)

    def evaluate(self, version: int) -> dict[str, Any]:
        """Score every set with the engine's weights (which are `version`), record it, keep the best."""
        started = time.time()
        with self.explorer.timeline.span("eval", version=version):
            results = {s.name: self.score_set(s, version) for s in self.cfg.eval.tasksets}
        self.explorer.timeline.flush()
        record = {
            "version": version,
            "time": time.time(),
            "seconds": time.time() - started,
            **{f"{k}/{m}": v for k, r in results.items() for m, v in r.items()},
        }
        record["probe"] = self._probe()
        record_step(self.run, EVAL_ROLE, version, record)
        self.done.add(version)
        if self.cfg.eval.keep_best is not None:
            record["best"] = self._keep_best(version, record)
        elif version != 0:
            self._drop_weights(version)
        if self.on_eval is not None:
            self.on_eval(record)
        return record

    def _probe(self) -> dict[str, list]:
        """The engine's logprobs of a fixed sequence (the first eval task's prompt): a fingerprint
        of the weights it evaluated with, which a check can recompute from a saved version."""
        s = self.cfg.eval.tasksets[0]
        if s.name not in self._sets:
            self._sets[s.name] = eval_tasks(self.cfg, s, self.run.storage_options, self.run.board)
        ids = self.explorer.engine.tokenizer.encode(self._sets[s.name][0][0].prompt, add_special_tokens=False)[
            : self.cfg.model.max_model_len - 1
        ]
        return {"ids": ids, "logprobs": self.explorer.engine.prompt_logprobs([ids])[0] if len(ids) > 1 else []}

    # ---- the best version

    def _keep_best(self, version: int, record: dict[str, Any]) -> dict[str, Any]:
        kb = self.cfg.eval.keep_best
        fs, root = self.run.fs()
        path = join(root, EVAL_DIR, BEST)
        best = read_best(self.run)
        value = record.get(kb.metric, float("nan"))
        better = best is None or (
            not math.isnan(value) and (value > best["value"] if kb.mode == "max" else value < best["value"])
        )
        if not better:
            self._drop_weights(version)
            return best
        model = self.cfg.model.path if version == 0 else f"{weights_url(self.run.url, version)}/model"
        new = {"version": version, "metric": kb.metric, "value": value, "model": model}
        write_json(fs, path, new)
        if best is not None and best["version"] != 0:
            self._drop_weights(best["version"])
        return new

    def _drop_weights(self, version: int) -> None:
        fs, root = self.run.fs()
        where = join(root, EVAL_DIR, f"version={version}")
        if fs.exists(where):
            fs.rm(join(where, EVAL_COMMITTED))  # the marker first: never a committed half-deleted directory
            fs.rm(where, recursive=True)


def eval_tasks(
    cfg: Any, s: Any, storage_options: dict[str, Any] | None, board: Board | None = None
) -> tuple[list[Task], Any]:
    """(tasks, reward function) of eval set `s`: its file's first `max_tasks` tasks, its reward or the
    run's. With the run's `board` (evaluation during training) a model reward of the run's reward
    service's settings scores with the reward role's service (placement deployments); any other
    model reward, and every one without a board (`rft eval`, the after-run flow), starts a service
    of its own in this process (rl_engine.rewards.run_service.run_reward)."""
    tasks = load_taskset(cfg.taskset.model_copy(update={"path": s.path}), storage_options)
    return tasks[: s.max_tasks] if s.max_tasks else tasks, run_reward(s.reward or cfg.taskset.reward, cfg, board)


def score_set(
    engine: Any,
    cfg: Any,
    s: Any,
    tasks_reward: tuple[list[Task], Any],
    version: int,
    workflow: Any = None,
    pool: Any = None,
) -> dict[str, float]:
    """Eval set `s`'s metrics with the weights `engine` holds (`version`): `s.n` samples of each
    task at `s.temperature`, drawn as an explorer step draws them (through `workflow` when the run
    has one), scored by the set's reward."""
    from rl_engine.roles.episodes import explore_episodes
    from rl_engine.roles.explorer import generate_experiences

    tasks, reward_fn = tasks_reward
    cfg = cfg.model_copy(
        update={
            "algorithm": cfg.algorithm.model_copy(update={"repeat_times": s.n}),
            "explorer": cfg.explorer.model_copy(
                update={"sampling": cfg.explorer.sampling.model_copy(update={"temperature": s.temperature})}
            ),
        }
    )
    step = _SEED_STEP + version
    if workflow is None:
        batch, _ = generate_experiences(engine, tasks, reward_fn, cfg, 0, step, pool)
    else:
        batch, _ = explore_episodes(engine, tasks, workflow, reward_fn, cfg, 0, step, pool)
    return set_metrics(_samples(batch, (s.reward or cfg.taskset.reward).type), s.n, [t.task_id for t in tasks])


def _samples(batch: ExperienceBatch, reward_type: str) -> list[tuple[str, bool, float | None, int, str]]:
    rows = batch.experiences()
    return [
        (r.task_id, _exact(reward_type, r.reward, r.reward_components), r.reward, len(r.response_ids), r.finish_reason)
        for r in rows
    ]
