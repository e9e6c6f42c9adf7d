"""The root `RFTConfig`: every section composed, the cross-section checks, the one resolve step."""

from __future__ import annotations

import datetime as _dt
import importlib
import os
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from rl_engine.config.algorithm import AlgorithmConfig
from rl_engine.config.base import _Model
from rl_engine.config.buffer import BufferConfig
from rl_engine.config.evaluation import EvalConfig
from rl_engine.config.explorer import ExplorerConfig
from rl_engine.config.migrate import migrate
from rl_engine.config.model import ModelConfig, TasksetConfig
from rl_engine.config.placement import LocalPlacement, PlacementConfig
from rl_engine.config.synchronizer import DecoupledSync, RendezvousSync, SynchronizerConfig
from rl_engine.config.trainer import TrainerConfig


class TensorBoardTracker(_Model):
    """TensorBoard event files under `<run>/trackers/tensorboard/` (written locally, then copied there, for a remote run)."""

    type: Literal["tensorboard"] = Field(description="`tensorboard`.")


class MLflowTracker(_Model):
    """An MLflow run, through MLflow's client; credentials come from MLflow's environment variables only."""

    type: Literal["mlflow"] = Field(description="`mlflow`.")
    tracking_uri: str | None = Field(
        default=None,
        description="Tracking URI (`http://127.0.0.1:5000`, a local `file:` or `sqlite:` store); null: MLFLOW_TRACKING_URI. No credentials in it: MLFLOW_TRACKING_TOKEN or MLFLOW_TRACKING_USERNAME/PASSWORD.",
    )
    experiment: str = Field(
        default="rft", min_length=1, description="Experiment the run is logged under (created if missing)."
    )

    @field_validator("tracking_uri")
    @classmethod
    def _no_credentials(cls, v: str | None) -> str | None:
        if v is not None and (urlsplit(v).password is not None or urlsplit(v).username is not None):
            raise ValueError(
                "has credentials in it; they would be saved with the run's config: put them in MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) instead"
            )
        return v


class WandbTracker(_Model):
    """A Weights & Biases run; the API key comes from WANDB_API_KEY (or `wandb login`) only."""

    type: Literal["wandb"] = Field(description="`wandb`.")
    project: str = Field(default="rft", min_length=1, description="W&B project.")
    entity: str | None = Field(default=None, description="W&B entity (team or user); null: the key's default.")
    mode: Literal["offline", "online"] = Field(
        default="offline",
        description="`offline` writes the run's files only (`wandb sync` uploads them later); `online` sends it as it goes.",
    )
    dir: str | None = Field(
        default=None,
        description="Local directory of W&B's files; null: `<run>/trackers/wandb` for a local run, a temporary directory copied there at the end for a remote one.",
    )


TrackerConfig = Annotated[TensorBoardTracker | MLflowTracker | WandbTracker, Field(discriminator="type")]


class MonitorConfig(_Model):
    """What a run reports."""

    timeline: bool = Field(default=True, description="Record spans of every component and render the Gantt chart.")
    artifacts: bool = Field(
        default=True, description="Publish metrics, timeline and continuations as Prefect artifacts."
    )
    log_every: int = Field(default=1, ge=1, description="Print a progress line every this many trainer steps.")
    trackers: list[TrackerConfig] = Field(
        default_factory=list,
        description="Experiment trackers that get every step's metrics and the run's config: `tensorboard`, `mlflow`, `wandb` (a name, or a mapping with `type` and its settings); none by default.",
    )

    @field_validator("trackers", mode="before")
    @classmethod
    def _names_as_mappings(cls, v: Any) -> Any:
        # `trackers: [tensorboard, mlflow]` is short for `[{type: tensorboard}, {type: mlflow}]`.
        return [{"type": t} if isinstance(t, str) else t for t in v] if isinstance(v, list) else v

    @field_validator("trackers")
    @classmethod
    def _one_of_each(cls, v: list[Any]) -> list[Any]:
        types = [t.type for t in v]
        if len(set(types)) < len(types):
            raise ValueError(f"{types}: each tracker type at most once (a run keeps one tracker run of each)")
        return v


class LineageConfig(_Model):
    """Scheduled retraining: a series of runs under one name, each continuing from the last successful one (rl_engine/run/lineage.py)."""

    name: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.=-]*$",
        description="Lineage of the run (state under `<buffer.storage.url>/lineages/<name>/`); null: a standalone run.",
    )
    start_from: Literal["latest", "base"] = Field(
        default="latest",
        description="Start from the model of the lineage's last successful run (`latest`), or from model.path (`base`); the first run always starts from model.path.",
    )
    when_busy: Literal["wait", "refuse"] = Field(
        default="wait",
        description="When another run of the lineage holds its lock: wait up to wait_timeout_s, or refuse at once.",
    )
    wait_timeout_s: float = Field(
        default=3600.0,
        gt=0.0,
        description="Longest a new run waits for the lineage's lock before failing (when_busy: wait).",
    )
    lock_ttl_s: float = Field(
        default=60.0,
        gt=0.0,
        description="The lock's lease: renewed every ttl/3 by its holder, free again this long after a holder died.",
    )
    promote: Literal["last", "best"] = Field(
        default="last",
        description="Which model of a completed run the next run starts from: its last (`model/`), or its best evaluated version (`best`: needs eval.keep_best).",
    )


# numpy's global seed is 0..2**32-1 (torch takes up to 2**64-1): vLLM seeds both with the engine's seed,
# which is `seed + explorer id`, so the largest seed leaves room for explorer.count's largest id (1023).
MAX_SEED = 2**32 - 1024


def import_plugins(plugins: Any) -> None:
    """Import each module of a config's `plugins:` list (their registrations run at import)."""
    if not isinstance(plugins, list):
        return  # not a list: the field's own validation names it
    for i, name in enumerate(plugins):
        if isinstance(name, str):
            try:
                importlib.import_module(name)
            except Exception as e:  # noqa: BLE001 - ImportError, or the module failing at import
                raise ValueError(
                    f"plugins[{i}] = {name!r}: cannot import it ({type(e).__name__}: {e}); is it installed or on PYTHONPATH?"
                ) from None


class RFTConfig(_Model):
    """A whole RFT run."""

    name: str | None = Field(
        default=None,
        description="Run name (directory under buffer.storage.url); null resolves to `<mode>-[<lineage.name>-]<UTC timestamp>-<6 random hex digits>`.",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.=-]*$",
    )
    seed: int = Field(
        default=42,
        ge=0,
        le=MAX_SEED,
        description=f"Seed of sampling, task order and trainer; 0..{MAX_SEED} (explorer i's vLLM engine gets seed + i, which numpy takes only below 2**32).",
    )
    plugins: list[Annotated[str, Field(pattern=r"^[\w.]+$")]] = Field(
        default_factory=list,
        description="Modules imported before the rest of the config is checked (in every process of the run), so that the losses, estimators, rewards and workflows they register with rl_engine.api can be named by `type`.",
    )
    model: ModelConfig = Field(description="The policy model.")
    taskset: TasksetConfig = Field(description="Tasks and reward.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Advantages and loss.")
    explorer: ExplorerConfig = Field(default_factory=ExplorerConfig, description="Rollout side.")
    buffer: BufferConfig = Field(default_factory=BufferConfig, description="Experience buffer and storage.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="DeepSpeed trainer.")
    synchronizer: SynchronizerConfig = Field(
        default_factory=RendezvousSync,
        description="Sync mode and its schedule (rendezvous: sync_interval, sync_offset; decoupled: sync_interval, max_staleness, max_backlog_steps) and method.",
    )
    placement: PlacementConfig = Field(
        default_factory=LocalPlacement,
        description="Where the roles run: `local` (tasks of one flow run) or `deployments` (a flow run each).",
    )
    monitor: MonitorConfig = Field(default_factory=MonitorConfig, description="Reporting.")
    eval: EvalConfig = Field(
        default_factory=EvalConfig,
        description="Held-out evaluation during training (none by default) and the best version kept.",
    )
    lineage: LineageConfig = Field(
        default_factory=LineageConfig, description="Scheduled retraining: the lineage this run continues, if any."
    )

    @model_validator(mode="before")
    @classmethod
    def _older_shape(cls, data: Any) -> Any:
        # The one rewrite before checking, and why: Prefect validates a deployment's stored `cfg`
        # parameter with this model itself (not through validate_config), so a deployment or
        # schedule registered before a shape change would fail every run until redeployed.
        if not isinstance(data, dict):
            return data
        data = migrate(data)[0]
        import_plugins(data.get("plugins"))
        return data

    @field_validator("seed", mode="before")
    @classmethod
    def _seed_fits(cls, v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool) and v > MAX_SEED:
            raise ValueError(
                f"too large: numpy takes seeds below 2**32 and vLLM seeds explorer i's engine with seed + i; use a seed in 0..{MAX_SEED}"
            )
        return v

    @model_validator(mode="after")
    def _explorers_fit_mode(self) -> RFTConfig:
        s, x = self.synchronizer, self.explorer
        if x.partial.enabled and (x.partial.max_groups_in_flight or 2 * x.batch_size) < x.batch_size:
            raise ValueError(
                f"explorer.partial.max_groups_in_flight = {x.partial.max_groups_in_flight} is below explorer.batch_size = {x.batch_size}; a step could never fill its batch"
            )
        if s.mode == "multi_explorer" and x.count < 2:
            raise ValueError(
                f"explorer.count = {x.count}: synchronizer.mode 'multi_explorer' needs explorer.count >= 2 (or use mode 'fully_async')"
            )
        if s.mode != "multi_explorer" and x.count != 1:
            raise ValueError(
                f"explorer.count = {x.count}: only synchronizer.mode 'multi_explorer' runs several explorers; set the mode or explorer.count = 1"
            )
        if x.engine.servers and len(x.engine.servers) != x.count:
            raise ValueError(
                f"explorer.engine.servers lists {len(x.engine.servers)} server(s) for explorer.count = {x.count}; list one per explorer (or none: each starts its own engine)"
            )
        if x.engine.servers and self.model.lora is not None and self.model.lora.sync == "adapter":
            raise ValueError(
                "explorer.engine.servers with model.lora.sync = 'adapter': a served engine serves a whole model, not the run's adapter; set model.lora.sync: merged, or drop explorer.engine.servers (each explorer starts its own engine with LoRA)"
            )
        return self

    @model_validator(mode="after")
    def _batches_fit(self) -> RFTConfig:
        s = self.synchronizer
        group = self.explorer.batch_size * self.algorithm.repeat_times
        tbs = self.trainer.train_batch_size
        if (
            isinstance(s, DecoupledSync)
            and s.max_staleness is None
            and s.max_backlog_steps is not None
            and s.max_backlog_steps * group < (tbs or group)
        ):
            raise ValueError(
                f"synchronizer.max_backlog_steps = {s.max_backlog_steps}: explorers pause at {s.max_backlog_steps} unconsumed steps of {group} experiences, "
                f"fewer than one trainer batch (trainer.train_batch_size = {tbs}); raise it to at least {-(-tbs // group)}"
            )
        if isinstance(s, RendezvousSync) and tbs is not None and tbs != group:
            raise ValueError(
                f"trainer.train_batch_size = {tbs}: in the rendezvous modes one trainer step trains one explorer step, "
                f"so it must equal explorer.batch_size x algorithm.repeat_times = {group} (or null)"
            )
        if tbs is not None and self.buffer.whole_groups and tbs % self.algorithm.repeat_times:
            raise ValueError(
                f"trainer.train_batch_size = {tbs} must be a multiple of algorithm.repeat_times = {self.algorithm.repeat_times} when buffer.whole_groups is true"
            )
        rows = tbs or group
        if rows % (self.trainer.micro_batch_size * self.trainer.num_ranks):
            raise ValueError(
                f"trainer.train_batch_size = {rows} must be a multiple of trainer.micro_batch_size = {self.trainer.micro_batch_size} x trainer.num_ranks = {self.trainer.num_ranks} "
                "(each rank trains an equal share in whole micro-batches); change micro_batch_size or num_ranks"
            )
        return self

    @model_validator(mode="after")
    def _devices_fit_roles(self) -> RFTConfig:
        d = getattr(self.placement, "devices", None)
        if d is None:
            return self
        ranks, tp = self.trainer.num_ranks // self.trainer.nodes, self.explorer.engine.tensor_parallel_size
        if len(d.trainer) != ranks:
            raise ValueError(
                f"placement.devices.trainer lists {len(d.trainer)} device(s) for the trainer's {ranks} rank(s) on this machine "
                f"(trainer.num_ranks / trainer.nodes); list one device per rank"
            )
        if len(d.explorers) != self.explorer.count:
            raise ValueError(
                f"placement.devices.explorers lists {len(d.explorers)} engine(s) for explorer.count = {self.explorer.count}; list one per explorer"
            )
        for i, devs in enumerate(d.explorers):
            if len(devs) != tp:
                raise ValueError(
                    f"placement.devices.explorers[{i}] lists {len(devs)} device(s), explorer.engine.tensor_parallel_size = {tp}: "
                    f"an engine runs one tensor parallel worker per device; list {tp}"
                )
        return self

    @model_validator(mode="after")
    def _lora_fits_zero(self) -> RFTConfig:
        if self.model.lora is not None and self.trainer.zero_stage == 3:
            raise ValueError(
                "model.lora with trainer.zero_stage = 3 is refused: ZeRO-3 partitions the frozen base weights too, "
                "and the merged weights (the saved model, and every sync with model.lora.sync: merged) would need a "
                "gather of each base weight with its adapter (not built); use zero_stage 0, 1 or 2 (LoRA's optimizer "
                "state is small: ZeRO-3 saves little there)"
            )
        return self

    @model_validator(mode="after")
    def _promote_best_needs_one(self) -> RFTConfig:
        if self.lineage.promote == "best" and self.eval.keep_best is None:
            raise ValueError(
                "lineage.promote = best needs eval.keep_best (the metric that names the best version) and eval.tasksets"
            )
        return self

    @model_validator(mode="after")
    def _eval_fits_schedule(self) -> RFTConfig:
        n, s = self.eval.every_versions, self.synchronizer
        # With checkpoint sync a decoupled explorer 0 loads a due version it never held from the
        # trainer's saved weights; otherwise it evaluates the versions it receives, every sync_interval-th.
        exact_only = isinstance(s, RendezvousSync) or s.sync_method == "collective"
        if self.eval.enabled and n is not None and n % s.sync_interval and exact_only:
            raise ValueError(
                f"eval.every_versions = {n}: explorers receive only versions that are multiples of synchronizer.sync_interval = {s.sync_interval} "
                f"(mode {s.mode}, sync_method {s.sync_method}), and explorer 0 evaluates with exactly the version it holds; use a multiple of {s.sync_interval}"
            )
        return self

    @model_validator(mode="after")
    def _generation_fits(self) -> RFTConfig:
        x = self.explorer
        if x.sampling.temperature < 1e-5 and self.algorithm.repeat_times > 1 and not x.partial.enabled:
            raise ValueError(
                f"explorer.sampling.temperature = {x.sampling.temperature}: greedy sampling gives algorithm.repeat_times = {self.algorithm.repeat_times} "
                "identical rollouts per task (vLLM refuses n > 1 when greedy, and GRPO learns nothing from them); use a temperature > 0, e.g. 1.0"
            )
        if x.sampling.max_tokens >= self.model.max_model_len:
            raise ValueError(
                f"explorer.sampling.max_tokens = {x.sampling.max_tokens} leaves no room for the prompt within model.max_model_len = {self.model.max_model_len}"
            )
        if x.partial.enabled and self.taskset.workflow.type != "single_turn":
            raise ValueError(
                f"explorer.partial.enabled with taskset.workflow.type = {self.taskset.workflow.type!r}: partial rollouts continue single-turn generations only "
                "(a multi-turn episode's state lives in its workflow's Python objects between model calls, which a continuation cannot store); "
                "disable explorer.partial or use taskset.workflow.type: single_turn"
            )
        if x.partial.enabled and x.partial.max_response_tokens >= self.model.max_model_len:
            raise ValueError(
                f"explorer.partial.max_response_tokens = {x.partial.max_response_tokens} leaves no room for the prompt within model.max_model_len = {self.model.max_model_len}"
            )
        return self

    # ---- derived values (the one resolve step)

    def resolved(self, now: _dt.datetime | None = None) -> RFTConfig:
        """Return a copy with every derived value filled in; the copy is what a run saves and uses."""
        out = self.model_copy(deep=True)
        if out.name is None:
            stamp = (now or _dt.datetime.now(_dt.UTC)).strftime("%Y%m%d-%H%M%S")
            # The random tail keeps runs started in the same second (schedules, several users) apart.
            lineage = f"{out.lineage.name}-" if out.lineage.name else ""
            out.name = f"{out.synchronizer.mode}-{lineage}{stamp}-{os.urandom(3).hex()}"
        if out.trainer.train_batch_size is None:
            out.trainer.train_batch_size = out.explorer.batch_size * out.algorithm.repeat_times
        if out.model.tokenizer_path is None:
            out.model.tokenizer_path = out.model.path
        return out

    @property
    def run_url(self) -> str:
        """URL of the run directory, `<storage.url>/<name>` (call on a resolved config)."""
        if self.name is None:
            raise ValueError("run_url of an unresolved config: call cfg.resolved() first")
        return f"{self.buffer.storage.url.rstrip('/')}/{self.name}"
