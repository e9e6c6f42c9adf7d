"""Evaluation during training: held-out task sets scored at fixed trainer versions, and the best version kept."""

from __future__ import annotations

import re

from pydantic import Field, model_validator

from rl_engine.config.base import _Model
from rl_engine.config.model import RewardConfig

# The metrics an evaluation reports per task set (see rl_engine.evaluate.set_metrics); pass@j for j = 1..n.
EVAL_METRICS = ("reward_mean", "response_len_mean", "truncated_frac")
_METRIC = re.compile(r"^(avg@\d+|pass@\d+|reward_mean|response_len_mean|truncated_frac)$")


class EvalTasksetConfig(_Model):
    """One held-out task set: scored with `n` samples per task at `temperature`."""

    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="Name of the set in metrics, trackers and `eval.keep_best.metric` (`<name>/pass@1`).",
    )
    path: str = Field(
        description="JSONL or Parquet file (or folder) of held-out tasks, local or any fsspec URL; same columns as taskset.path."
    )
    reward: RewardConfig | None = Field(
        default=None, description="How its answers are scored; null: the run's taskset.reward."
    )
    n: int = Field(default=4, ge=1, le=256, description="Samples per task (k of avg@k and pass@k).")
    temperature: float = Field(
        default=1.0, ge=0.0, description="Sampling temperature of the evaluation (0: greedy, then n must be 1)."
    )
    max_tasks: int | None = Field(
        default=None, ge=1, description="Score only the first this many tasks of the file (file order); null: all."
    )

    @model_validator(mode="after")
    def _greedy_once(self) -> EvalTasksetConfig:
        if self.temperature < 1e-5 and self.n > 1:
            raise ValueError(
                f"eval set {self.name!r}: temperature {self.temperature} with n = {self.n}: greedy samples are identical; use n: 1 or a temperature > 0"
            )
        return self


class KeepBestConfig(_Model):
    """Which evaluated version is the best, kept whole and named in the summary and the lineage."""

    metric: str = Field(
        description="`<set name>/<metric>`, e.g. `heldout/pass@1` (metrics: avg@n, pass@1..n, reward_mean, response_len_mean, truncated_frac)."
    )
    mode: str = Field(
        default="max", pattern="^(max|min)$", description="`max`: the highest value is best; `min`: the lowest."
    )

    @model_validator(mode="after")
    def _shape(self) -> KeepBestConfig:
        name, _, metric = self.metric.partition("/")
        if not name or not _METRIC.match(metric):
            raise ValueError(
                f"eval.keep_best.metric = {self.metric!r}: write `<set name>/<metric>` with a metric among avg@<n>, pass@<k>, {', '.join(EVAL_METRICS)}"
            )
        return self


class EvalConfig(_Model):
    """Held-out evaluation during training. Explorer 0 scores every set with exactly the version it
    names (rl_engine.roles.evaluation); none by default."""

    tasksets: list[EvalTasksetConfig] = Field(
        default_factory=list, description="The held-out sets; empty: no evaluation."
    )
    every_versions: int | None = Field(
        default=None,
        ge=1,
        description="Evaluate every this many trainer versions (a multiple of synchronizer.sync_interval); null: only at start and end.",
    )
    at_start: bool = Field(
        default=True, description="Evaluate the initial policy (version 0, or the version a resumed run starts from)."
    )
    at_end: bool = Field(default=True, description="Evaluate the final version (trainer.total_steps) too.")
    keep_best: KeepBestConfig | None = Field(
        default=None,
        description="Keep the best evaluated version's weights (never deleted by retention) and name it in the summary and the lineage.",
    )
    after_run: str | None = Field(
        default=None,
        pattern=r"^[^/]+/[^/]+$",
        description="A Prefect deployment (`flow/deployment`, e.g. `rft-eval/default`) started with the run's URL when the run completes: every saved version scored after the fact; null: none.",
    )

    @model_validator(mode="after")
    def _sets(self) -> EvalConfig:
        names = [s.name for s in self.tasksets]
        if len(set(names)) != len(names):
            raise ValueError(f"eval.tasksets: names {names} repeat; give every set its own name")
        if self.keep_best is not None:
            name, _, metric = self.keep_best.metric.partition("/")
            match = [s for s in self.tasksets if s.name == name]
            if not match:
                raise ValueError(
                    f"eval.keep_best.metric = {self.keep_best.metric!r}: no eval set named {name!r} (sets: {names})"
                )
            k = int(metric.split("@")[1]) if "@" in metric else 1
            if k > match[0].n:
                raise ValueError(
                    f"eval.keep_best.metric = {self.keep_best.metric!r}: set {name!r} draws n = {match[0].n} samples per task; k must be <= n"
                )
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.tasksets)
