"""Configuration: one pydantic model per component, composed into the root `RFTConfig`.

A YAML file loads into `RFTConfig` (`load_config(path, overrides)`), `--set a.b=c` overrides
apply before validation, and `resolve(cfg)` fills the derived values (run name, run dir,
train batch size) in one explicit step. The resolved config is written to the run directory
by `save_resolved`. Validators only check; they never rewrite.

Field paths are part of the interface (`synchronizer.sync_interval`, ...): they appear in error
messages, in `--set` overrides and in the Prefect UI form of every flow.

    python -m rl_engine.config configs/demo.yaml      # validate and print the resolved config
"""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from rl_engine.errors import UserError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator


class _Model(BaseModel):
    # allow_inf_nan=False: a NaN passes every bound (each comparison is false), an inf every lower one;
    # no field of a run means anything by them, so they are refused as not finite.
    model_config = ConfigDict(extra="forbid", validate_assignment=False, frozen=False, allow_inf_nan=False)


# --------------------------------------------------------------------------- model


class ModelConfig(_Model):
    """The policy model: a local Hugging Face directory (nothing is ever downloaded)."""

    path: str = Field(description="Local directory of a Hugging Face causal LM (config.json, *.safetensors, tokenizer files).")
    tokenizer_path: str | None = Field(default=None, description="Tokenizer directory; defaults to `model.path`.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="Parameter dtype in both vLLM and the trainer. float32 keeps their logprobs tight on CPU."
    )
    max_model_len: int = Field(default=512, ge=16, le=1_048_576, description="Context length (prompt + response tokens) for vLLM and the trainer.")

    @field_validator("path", "tokenizer_path")
    @classmethod
    def _local_dir(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return v
        p = Path(v).expanduser()
        if p.is_file():
            raise ValueError(
                f"{v!r} is a file, not a directory; point model.{info.field_name} at the directory that holds the model's config.json, "
                f"*.safetensors and tokenizer files (this file's directory is {str(p.parent)!r})"
            )
        if not p.is_dir():
            raise ValueError(
                f"model directory {v!r} does not exist; build one with `rft make-tiny-model {v}` "
                f"(or `rft warmstart`) or point model.{info.field_name} at a local Hugging Face model directory"
            )
        # A tokenizer directory needs only the tokenizer's files (rl_engine.run.preflight checks them).
        if info.field_name == "path" and not (p / "config.json").is_file():
            raise ValueError(f"{v!r} has no config.json; model.path must be a Hugging Face model directory")
        return v


# --------------------------------------------------------------------------- taskset + rewards


class ArithmeticReward(_Model):
    """Exact-answer reward for the demo arithmetic task, plus a format reward."""

    type: Literal["arithmetic"] = Field(description="Reward variant selector.")
    correct_weight: float = Field(default=1.0, description="Reward for an exactly correct final answer.")
    format_weight: float = Field(default=0.1, ge=0.0, description="Reward for a well-formed answer (digits only, then a stop).")


class CountdownReward(_Model):
    """Reward of the long-tail countdown task: exact answer then a stop, plus shaped progress."""

    type: Literal["countdown"] = Field(description="Reward variant selector.")
    correct_weight: float = Field(default=1.0, description="Reward for exactly the answer, ended by a stop.")
    close_weight: float = Field(default=0.5, ge=0.0, description="Weight of the progress term: the fraction of the answer's numbers right from the start, over the longer of answer and response.")


class PythonReward(_Model):
    """A user reward function `module:function(prompt, response, task) -> float | dict[str, float]`."""

    type: Literal["python"] = Field(description="Reward variant selector.")
    function: str = Field(description="Import path `package.module:function` of the reward callable.", pattern=r"^[\w.]+:\w+$")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments passed to the function.")
    timeout_s: float = Field(
        default=60.0, gt=0.0, description="Longest one call may take; a call still running then fails the explorer step (and the run) naming the function."
    )


RewardConfig = Annotated[Union[ArithmeticReward, CountdownReward, PythonReward], Field(discriminator="type")]
_REWARD_TAGS = ("arithmetic", "countdown", "python")


class TasksetConfig(_Model):
    """Where prompts come from and how they are scored."""

    path: str = Field(description="JSONL or Parquet file of tasks; a local path or any fsspec URL (s3://...).")
    prompt_key: str = Field(default="question", description="Column holding the prompt text.")
    answer_key: str = Field(default="answer", description="Column holding the reference answer passed to the reward.")
    template: str | None = Field(
        default=None,
        description="Python format string with `{prompt}`; if unset the tokenizer's chat template is used when it has one, else the raw prompt.",
    )
    shuffle: bool = Field(default=True, description="Shuffle task order each epoch (seeded by `seed`).")
    reward: RewardConfig = Field(default_factory=lambda: ArithmeticReward(type="arithmetic"), description="Reward function variant.")


# --------------------------------------------------------------------------- algorithm


class KLConfig(_Model):
    """KL penalty to a frozen copy of the initial policy."""

    coef: float = Field(default=0.01, gt=0.0, description="Weight of the KL term in the loss.")
    estimator: Literal["k1", "k3"] = Field(default="k3", description="Per-token KL estimator (Schulman's k1 or k3).")


class AlgorithmConfig(_Model):
    """GRPO advantages and the clipped policy-gradient loss."""

    type: Literal["grpo"] = Field(default="grpo", description="Algorithm variant (GRPO group-relative advantages).")
    repeat_times: int = Field(default=4, ge=1, le=1024, description="Rollouts per task (the GRPO group size).")
    std_normalize: bool = Field(default=True, description="Divide group-centred rewards by the group std (False: mean-centre only, Dr.GRPO).")
    clip_eps_low: float = Field(default=0.2, gt=0.0, lt=1.0, description="PPO lower clip: ratio >= 1 - clip_eps_low.")
    clip_eps_high: float = Field(default=0.2, gt=0.0, lt=10.0, description="PPO upper clip: ratio <= 1 + clip_eps_high.")
    old_logprobs: Literal["behavior", "recompute"] = Field(
        default="behavior", description="Denominator of the importance ratio: vLLM's behavior logprobs, or recomputed by the trainer before the update."
    )
    loss_agg: Literal["token-mean", "seq-mean"] = Field(default="token-mean", description="Aggregate the per-token loss over all tokens, or per sequence then over sequences.")
    kl: KLConfig | None = Field(default=None, description="KL penalty to the initial policy; null disables it (and the reference model).")
    max_version_gap: int | None = Field(
        default=None, ge=0, description="Mask response tokens produced by a policy more than this many versions older than the trainer's; null keeps all."
    )

    @model_validator(mode="after")
    def _grpo_needs_group(self) -> "AlgorithmConfig":
        if self.repeat_times < 2:
            raise ValueError(f"algorithm.repeat_times = {self.repeat_times}: GRPO needs at least 2 rollouts per task to compare; set it >= 2")
        return self


# --------------------------------------------------------------------------- explorer


class SamplingConfig(_Model):
    """vLLM sampling parameters of a rollout."""

    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description="Sampling temperature, 0..2 as vLLM accepts; 1.0 samples the policy itself (what the loss assumes).")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(default=-1, ge=-1, description="Top-k sampling; -1 disables.")
    max_tokens: int = Field(default=64, ge=1, description="Response token budget of one generation (one segment when partial rollouts are on).")
    stop: list[str] = Field(default_factory=list, description="Stop strings (EOS always stops); none may be empty.")

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError("an empty stop string would stop every generation at once (vLLM refuses it); remove it")
        return v


class EngineConfig(_Model):
    """How the vLLM engine of an explorer is started."""

    enforce_eager: bool = Field(default=True, description="Disable CUDA graphs / compilation (required on the CPU build).")
    kv_cache_space_gib: float = Field(default=1.0, gt=0.0, le=1024, description="CPU KV cache size in GiB (sets VLLM_CPU_KVCACHE_SPACE); ignored on GPU.")
    gpu_memory_utilization: float = Field(default=0.5, gt=0.0, le=1.0, description="Fraction of GPU memory vLLM may use; ignored on CPU.")
    tensor_parallel_size: int = Field(default=1, ge=1, description="vLLM tensor parallel size.")
    num_threads: int | None = Field(default=None, ge=1, description="CPU threads for the engine (VLLM_CPU_OMP_THREADS_BIND); null lets vLLM decide.")


class PartialRolloutConfig(_Model):
    """Cut long generations by a token budget and resume them in a later explorer step."""

    enabled: bool = Field(default=False, description="Turn partial rollouts on.")
    segment_max_tokens: int = Field(default=32, ge=1, description="Token budget of one segment within one explorer step.")
    max_response_tokens: int = Field(default=128, ge=1, description="Total response budget; a trajectory reaching it is complete, marked truncated.")
    max_groups_in_flight: int | None = Field(default=None, ge=1, description="GRPO groups an explorer holds unfinished or unwritten: each step starts new tasks up to it, so it bounds work in flight and how many versions a group can span; null = 2 x explorer.batch_size.")
    repeat_ngram: int = Field(default=4, ge=1, description="Longest repeating pattern, in tokens, the repetition detector looks for (patterns of 1..n tokens).")
    repeat_threshold: int = Field(default=8, ge=2, description="Stop a generation early (finish reason `repeat`) once its last pattern occurred this many times in a row, across segment boundaries.")
    repeat_penalty: float = Field(default=0.0, le=0.0, description="Reward added to trajectories stopped for repetition (<= 0).")

    @model_validator(mode="after")
    def _budgets(self) -> "PartialRolloutConfig":
        if self.enabled and self.segment_max_tokens >= self.max_response_tokens:
            raise ValueError(
                f"explorer.partial.segment_max_tokens = {self.segment_max_tokens} must be below "
                f"explorer.partial.max_response_tokens = {self.max_response_tokens}, or nothing is ever cut"
            )
        return self


class ExplorerConfig(_Model):
    """Rollout side: how many explorers, how big a step, how the engine samples."""

    count: int = Field(default=1, ge=1, le=1024, description="Number of explorers (engines) writing to the buffer; > 1 only in multi_explorer mode.")
    batch_size: int = Field(default=4, ge=1, description="Tasks per explorer step (each repeated algorithm.repeat_times times).")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Sampling parameters.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="vLLM engine settings.")
    partial: PartialRolloutConfig = Field(default_factory=PartialRolloutConfig, description="Partial rollout settings.")


# --------------------------------------------------------------------------- buffer / storage

_SECRET_KEYS = {"key", "secret", "token", "password", "aws_access_key_id", "aws_secret_access_key", "aws_session_token", "session_token"}


def _find_secret(options: Any, prefix: str = "") -> str | None:
    if isinstance(options, dict):
        for k, v in options.items():
            if str(k).lower() in _SECRET_KEYS:
                return f"{prefix}{k}"
            found = _find_secret(v, f"{prefix}{k}.")
            if found:
                return found
    return None


class StorageConfig(_Model):
    """Where a run's files live: any fsspec URL. Credentials never go here."""

    url: str = Field(default="runs", description="Root of all runs: a local directory, `s3://bucket/prefix` or `memory://...`.")
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Non-secret fsspec options, e.g. {client_kwargs: {endpoint_url: ...}} for S3. Credentials come from the environment (AWS_ACCESS_KEY_ID, ...).",
    )
    outage_timeout_s: float = Field(
        default=120.0,
        gt=0.0,
        description="How long one operation on an object store (S3) keeps retrying, with backoff, while the store is unreachable "
        "(connections refused or timing out, 5xx answers) before the run fails with an error naming the URL and the operation. Local disk never retries.",
    )

    @field_validator("options")
    @classmethod
    def _no_secrets(cls, v: dict[str, Any]) -> dict[str, Any]:
        found = _find_secret(v)
        if found:
            raise ValueError(
                f"storage options must not hold credentials ({found!r}); they would be saved with the run. "
                "Set them in the environment instead (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or FSSPEC_S3_KEY / FSSPEC_S3_SECRET)"
            )
        return v

    @model_validator(mode="after")
    def _one_outage_limit(self) -> "StorageConfig":
        given = self.options.get("outage_timeout_s", self.outage_timeout_s)
        if given != self.outage_timeout_s:
            raise ValueError(f"options.outage_timeout_s = {given!r} disagrees with outage_timeout_s = {self.outage_timeout_s!r}; set only buffer.storage.outage_timeout_s")
        return self

    def fs_options(self) -> dict[str, Any]:
        """The options every component opens this storage with (`rl_engine.storage.open_storage`): fsspec's plus the outage limit."""
        return {**self.options, "outage_timeout_s": self.outage_timeout_s}


class BufferConfig(_Model):
    """The experience buffer on the run's storage."""

    storage: StorageConfig = Field(default_factory=StorageConfig, description="Storage root and fsspec options.")
    whole_groups: bool = Field(default=True, description="Trainer batches contain only complete GRPO groups.")
    read_timeout_s: float = Field(default=600.0, gt=0.0, description="How long the trainer waits for enough committed experiences before failing.")
    poll_interval_s: float | None = Field(
        default=None, gt=0.0, le=60.0, description="How often a waiting reader (and the control board) looks for news; null: 5 ms on local disk, 100 ms on object stores."
    )
    commit_window_s: float = Field(
        default=60.0,
        gt=0.0,
        description="A reader's poll lists only commit records stamped within this many seconds of its clock, so its cost stays flat as the run grows; "
        "a record visible later than that after its stamp (a stalled commit, clocks apart between machines) waits for the next full listing.",
    )
    full_listing_interval_s: float = Field(
        default=600.0, gt=0.0, description="A reader lists every commit record when it starts and then this often, finding records later than commit_window_s."
    )
    on_corrupt: Literal["fail", "skip"] = Field(default="fail", description="What a reader does with a committed file it cannot read: stop with its path, or report and skip it.")
    max_backlog_steps: int | None = Field(
        default=8,
        ge=1,
        description="Async modes without synchronizer.max_staleness: explorers pause while this many explorer steps are written but not yet trained; null: no cap.",
    )
    verify_checksums: bool = Field(
        default=True,
        description="Check each file's CRC32 against its commit record before use. Off saves one pass over the bytes (reads ~2-3x faster) "
        "but lets a bit flip inside a committed file through; size, Arrow structure and schema are checked either way.",
    )


# --------------------------------------------------------------------------- trainer


class TrainerConfig(_Model):
    """DeepSpeed trainer."""

    total_steps: int = Field(default=10, ge=1, description="Trainer steps of the run; the policy reaches version total_steps.")
    train_batch_size: int | None = Field(
        default=None, ge=1, description="Experiences per trainer step; null resolves to explorer.batch_size x algorithm.repeat_times (one explorer step)."
    )
    micro_batch_size: int = Field(default=8, ge=1, description="Experiences per forward/backward pass (gradient accumulation makes up the rest).")
    lr: float = Field(default=1e-5, gt=0.0, lt=1.0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(default=0.0, ge=0.0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas.")
    warmup_steps: int = Field(default=0, ge=0, description="Linear LR warmup over this many trainer steps (torch LambdaLR; DeepSpeed's WarmupLR trains its first steps at lr 0).")
    grad_clip: float = Field(default=1.0, gt=0.0, description="Gradient norm clip.")
    zero_stage: Literal[0, 1, 2, 3] = Field(default=0, description="DeepSpeed ZeRO stage (0 on CPU).")
    checkpoint_interval: int = Field(default=5, ge=1, description="Save resumable trainer state (with the buffer cursor) every this many trainer steps.")
    keep_last_states: int | None = Field(
        default=3,
        ge=1,
        description="Keep the newest this many committed trainer states (trainer_state/step=*), deleting older ones after each save; the newest is always kept (a resume loads it); null keeps all.",
    )
    num_threads: int | None = Field(default=None, ge=1, description="torch intra-op threads of the trainer; null keeps torch's default (per rank).")
    num_ranks: int = Field(
        default=1,
        ge=1,
        description="Data-parallel trainer ranks in all, started by torchrun (one per device on GPU); rank 0 reads the buffer and sends weights, "
        "each rank trains on train_batch_size / num_ranks experiences of every batch.",
    )
    nodes: int = Field(
        default=1,
        ge=1,
        description="Machines the trainer's ranks span (num_ranks / nodes each): node 0 is the trainer role's, each other one runs `rft trainer-node RUN --node-rank i`.",
    )
    rendezvous: str | None = Field(
        default=None,
        pattern=r"^[^\s:]+:\d+$",
        description="host:port on node 0 where the other nodes' ranks meet trainer rank 0 (torchrun's static rendezvous); required when nodes > 1.",
    )

    @model_validator(mode="after")
    def _nodes(self) -> "TrainerConfig":
        if self.num_ranks % self.nodes:
            raise ValueError(f"trainer.num_ranks = {self.num_ranks} does not split over trainer.nodes = {self.nodes}; use a multiple of nodes")
        if self.nodes > 1 and self.rendezvous is None:
            raise ValueError(f"trainer.nodes = {self.nodes} needs trainer.rendezvous = 'host:port' (node 0's address, a port free there) where the nodes' ranks meet")
        return self


# --------------------------------------------------------------------------- synchronizer


class CollectiveConfig(_Model):
    """The extra process group between trainer rank 0 and the explorers' inference workers."""

    host: str = Field(default="127.0.0.1", description="TCP rendezvous host of the weight-sync group (trainer rank 0's address).")
    port: int | None = Field(
        default=None, ge=1024, le=65535, description="TCP rendezvous port of the weight-sync group; null: the trainer picks a free one and publishes it on the run's board."
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(default="auto", description="auto: nccl on CUDA, gloo on CPU.")
    bucket_mb: float = Field(default=64.0, gt=0.0, description="Parameters are broadcast in buckets of about this many MiB.")
    timeout_s: float = Field(default=300.0, gt=0.0, description="Timeout of a group join and of one sync.")


Mode = Literal["synchronous", "one_step_off_policy", "fully_async", "multi_explorer"]
RENDEZVOUS_MODES = ("synchronous", "one_step_off_policy")


class SynchronizerConfig(_Model):
    """When and how weights flow from the trainer to the explorers (see DESIGN.md, sync modes)."""

    mode: Mode = Field(default="synchronous", description="Sync mode: synchronous / one_step_off_policy (rendezvous schedule), fully_async / multi_explorer (decoupled).")
    sync_interval: int = Field(default=1, ge=1, description="k: rendezvous every k explorer steps; in async modes publish weights every k trainer steps.")
    sync_offset: int = Field(default=0, ge=0, description="m: the explorer runs m steps ahead before its first sync (rendezvous modes only).")
    sync_method: Literal["collective", "checkpoint"] = Field(default="collective", description="Broadcast over a process group, or committed checkpoints on storage.")
    max_staleness: int | None = Field(
        default=None,
        ge=0,
        description="Async modes: bound on (trainer version at training - generating version), enforced as admission control: explorers wait for newer weights before generating what would be too stale; null for no bound.",
    )
    keep_last_checkpoints: int | None = Field(
        default=3,
        ge=0,
        description="Checkpoint sync: keep the newest this many committed checkpoints/version=*, deleting older ones after each publish, "
        "but never one an explorer may still load (the version just published; in the decoupled modes any newer than an explorer holds); 0 keeps only those; null keeps all.",
    )
    collective: CollectiveConfig = Field(default_factory=CollectiveConfig, description="Settings of the collective method.")
    wait_timeout_s: float = Field(default=600.0, gt=0.0, description="Longest a side waits at a rendezvous before failing.")


# --------------------------------------------------------------------------- placement


class LocalPlacement(_Model):
    """Every role (explorers, trainer) as a concurrent task of the mode's flow run, in one process."""

    type: Literal["local"] = Field(default="local", description="Roles run as tasks of the mode's flow run.")
    heartbeat_s: float = Field(default=5.0, gt=0.0, description="Seconds between a role's heartbeats on the run's board.")
    heartbeat_timeout_s: float = Field(default=60.0, gt=0.0, description="A role silent this long is taken for dead and the run stops.")


class DeploymentsPlacement(_Model):
    """Each role as its own flow run of its Prefect deployment: its own process, on the pool that serves it."""

    type: Literal["deployments"] = Field(description="Roles run as flow runs of their deployments (`prefect deploy --all` creates them).")
    explorer_deployment: str = Field(default="rft-explorer/default", description="Deployment (`flow-name/deployment-name`) that runs an explorer role.")
    trainer_deployment: str = Field(default="rft-trainer/default", description="Deployment (`flow-name/deployment-name`) that runs the trainer role.")
    job_variables: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Work-pool job variables per role: key `trainer`, `explorer` (every explorer) or `explorer-<i>`, e.g. {explorer-1: {env: {CUDA_VISIBLE_DEVICES: '1'}}}.",
    )
    start_timeout_s: float = Field(default=600.0, gt=0.0, description="Longest a role's flow run may wait for a worker before the run fails.")
    heartbeat_s: float = Field(default=5.0, gt=0.0, description="Seconds between a role's heartbeats on the run's board.")
    heartbeat_timeout_s: float = Field(default=60.0, gt=0.0, description="A role silent this long is taken for dead and the run stops.")

    @field_validator("job_variables")
    @classmethod
    def _roles(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for key in v:
            if key not in ("trainer", "explorer") and not (key.startswith("explorer-") and key[9:].isdigit()):
                raise ValueError(f"job_variables key {key!r}: use `trainer`, `explorer` or `explorer-<i>`")
        return v


PlacementConfig = Annotated[Union[LocalPlacement, DeploymentsPlacement], Field(discriminator="type")]


# --------------------------------------------------------------------------- monitor


class MonitorConfig(_Model):
    """What a run reports."""

    timeline: bool = Field(default=True, description="Record spans of every component and render the Gantt chart.")
    artifacts: bool = Field(default=True, description="Publish metrics, timeline and continuations as Prefect artifacts.")
    log_every: int = Field(default=1, ge=1, description="Print a progress line every this many trainer steps.")


# --------------------------------------------------------------------------- lineage


class LineageConfig(_Model):
    """Scheduled retraining: a series of runs under one name, each continuing from the last successful one (rl_engine/run/lineage.py)."""

    name: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.=-]*$",
        description="Lineage of the run (state under <buffer.storage.url>/lineages/<name>/); null: a standalone run.",
    )
    start_from: Literal["latest", "base"] = Field(
        default="latest", description="Start from the model of the lineage's last successful run (`latest`), or from model.path (`base`); the first run always starts from model.path."
    )
    when_busy: Literal["wait", "refuse"] = Field(default="wait", description="When another run of the lineage holds its lock: wait up to wait_timeout_s, or refuse at once.")
    wait_timeout_s: float = Field(default=3600.0, gt=0.0, description="Longest a new run waits for the lineage's lock before failing (when_busy: wait).")
    lock_ttl_s: float = Field(
        default=60.0, gt=0.0, description="The lock's lease: renewed every ttl/3 by its holder, free again this long after a holder died."
    )


# --------------------------------------------------------------------------- root

# numpy's global seed is 0..2**32-1 (torch takes up to 2**64-1): vLLM seeds both with the engine's seed,
# which is `seed + explorer id`, so the largest seed leaves room for explorer.count's largest id (1023).
MAX_SEED = 2**32 - 1024


class RFTConfig(_Model):
    """A whole RFT run."""

    name: str | None = Field(default=None, description="Run name (directory under buffer.storage.url); null resolves to `<mode>-[<lineage.name>-]<UTC timestamp>-<6 random hex digits>`.", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.=-]*$")
    seed: int = Field(
        default=42, ge=0, le=MAX_SEED, description=f"Seed of sampling, task order and trainer; 0..{MAX_SEED} (explorer i's vLLM engine gets seed + i, which numpy takes only below 2**32)."
    )
    model: ModelConfig = Field(description="The policy model.")
    taskset: TasksetConfig = Field(description="Tasks and reward.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Advantages and loss.")
    explorer: ExplorerConfig = Field(default_factory=ExplorerConfig, description="Rollout side.")
    buffer: BufferConfig = Field(default_factory=BufferConfig, description="Experience buffer and storage.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="DeepSpeed trainer.")
    synchronizer: SynchronizerConfig = Field(default_factory=SynchronizerConfig, description="Sync mode, schedule and method.")
    placement: PlacementConfig = Field(default_factory=LocalPlacement, description="Where the roles run: `local` (tasks of one flow run) or `deployments` (a flow run each).")
    monitor: MonitorConfig = Field(default_factory=MonitorConfig, description="Reporting.")
    lineage: LineageConfig = Field(default_factory=LineageConfig, description="Scheduled retraining: the lineage this run continues, if any.")

    @field_validator("seed", mode="before")
    @classmethod
    def _seed_fits(cls, v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool) and v > MAX_SEED:
            raise ValueError(f"too large: numpy takes seeds below 2**32 and vLLM seeds explorer i's engine with seed + i; use a seed in 0..{MAX_SEED}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "RFTConfig":
        s, x = self.synchronizer, self.explorer
        if x.partial.enabled and (x.partial.max_groups_in_flight or 2 * x.batch_size) < x.batch_size:
            raise ValueError(f"explorer.partial.max_groups_in_flight = {x.partial.max_groups_in_flight} is below explorer.batch_size = {x.batch_size}; a step could never fill its batch")
        if s.mode == "multi_explorer" and x.count < 2:
            raise ValueError(f"explorer.count = {x.count}: synchronizer.mode 'multi_explorer' needs explorer.count >= 2 (or use mode 'fully_async')")
        if s.mode != "multi_explorer" and x.count != 1:
            raise ValueError(f"explorer.count = {x.count}: only synchronizer.mode 'multi_explorer' runs several explorers; set the mode or explorer.count = 1")
        if s.mode == "synchronous" and s.sync_offset != 0:
            raise ValueError(f"synchronizer.sync_offset = {s.sync_offset}: mode 'synchronous' has sync_offset 0; use mode 'one_step_off_policy' to let the explorer run ahead")
        if s.mode == "one_step_off_policy" and s.sync_offset < 1:
            raise ValueError("synchronizer.sync_offset = 0: mode 'one_step_off_policy' needs sync_offset >= 1 (1 for one step ahead)")
        if s.mode not in RENDEZVOUS_MODES and s.sync_offset != 0:
            raise ValueError(f"synchronizer.sync_offset = {s.sync_offset}: only the rendezvous modes (synchronous, one_step_off_policy) use it; set it to 0")
        if s.mode in RENDEZVOUS_MODES and s.max_staleness is not None:
            raise ValueError(
                f"synchronizer.max_staleness = {s.max_staleness}: the rendezvous modes fix staleness by sync_interval/sync_offset; set it to null or use an async mode"
            )
        if s.mode not in RENDEZVOUS_MODES and s.max_staleness is not None and s.max_staleness < s.sync_interval - 1:
            raise ValueError(
                f"synchronizer.max_staleness = {s.max_staleness}: weights are published every sync_interval = {s.sync_interval} trainer steps, "
                f"so explorers are up to {s.sync_interval - 1} versions behind by design; set max_staleness >= {s.sync_interval - 1}"
            )
        group = self.explorer.batch_size * self.algorithm.repeat_times
        tbs = self.trainer.train_batch_size
        backlog = self.buffer.max_backlog_steps
        if s.mode not in RENDEZVOUS_MODES and s.max_staleness is None and backlog is not None and backlog * group < (tbs or group):
            raise ValueError(
                f"buffer.max_backlog_steps = {backlog}: explorers pause at {backlog} unconsumed steps of {group} experiences, "
                f"fewer than one trainer batch (trainer.train_batch_size = {tbs}); raise it to at least {-(-tbs // group)}"
            )
        if s.mode in RENDEZVOUS_MODES and tbs is not None and tbs != group:
            raise ValueError(
                f"trainer.train_batch_size = {tbs}: in the rendezvous modes one trainer step trains one explorer step, "
                f"so it must equal explorer.batch_size x algorithm.repeat_times = {group} (or null)"
            )
        if tbs is not None and self.buffer.whole_groups and tbs % self.algorithm.repeat_times:
            raise ValueError(f"trainer.train_batch_size = {tbs} must be a multiple of algorithm.repeat_times = {self.algorithm.repeat_times} when buffer.whole_groups is true")
        rows = tbs or group
        if rows % (self.trainer.micro_batch_size * self.trainer.num_ranks):
            raise ValueError(
                f"trainer.train_batch_size = {rows} must be a multiple of trainer.micro_batch_size = {self.trainer.micro_batch_size} x trainer.num_ranks = {self.trainer.num_ranks} "
                "(each rank trains an equal share in whole micro-batches); change micro_batch_size or num_ranks"
            )
        if x.sampling.temperature < 1e-5 and self.algorithm.repeat_times > 1 and not x.partial.enabled:
            raise ValueError(
                f"explorer.sampling.temperature = {x.sampling.temperature}: greedy sampling gives algorithm.repeat_times = {self.algorithm.repeat_times} "
                "identical rollouts per task (vLLM refuses n > 1 when greedy, and GRPO learns nothing from them); use a temperature > 0, e.g. 1.0"
            )
        if self.explorer.sampling.max_tokens >= self.model.max_model_len:
            raise ValueError(f"explorer.sampling.max_tokens = {self.explorer.sampling.max_tokens} leaves no room for the prompt within model.max_model_len = {self.model.max_model_len}")
        if x.partial.enabled and x.partial.max_response_tokens >= self.model.max_model_len:
            raise ValueError(f"explorer.partial.max_response_tokens = {x.partial.max_response_tokens} leaves no room for the prompt within model.max_model_len = {self.model.max_model_len}")
        return self

    # ---- derived values (the one resolve step)

    def resolved(self, now: _dt.datetime | None = None) -> "RFTConfig":
        """Return a copy with every derived value filled in; the copy is what a run saves and uses."""
        out = self.model_copy(deep=True)
        if out.name is None:
            stamp = (now or _dt.datetime.now(_dt.timezone.utc)).strftime("%Y%m%d-%H%M%S")
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


# --------------------------------------------------------------------------- warnings and estimates


def config_warnings(cfg: RFTConfig) -> list[str]:
    """What a valid config does that its author likely did not mean; `rft validate` and `rft run` print them (nothing is refused)."""
    from rl_engine.schedule import rendezvous_syncs

    s, total = cfg.synchronizer, cfg.trainer.total_steps
    out = []
    if s.mode in RENDEZVOUS_MODES and not rendezvous_syncs(total, s.sync_interval, s.sync_offset):
        # The explorer syncs after step e = sync_offset + j * sync_interval < total_steps (rl_engine.schedule).
        fix = f"set synchronizer.sync_interval <= {total - 1 - s.sync_offset}" if total - 1 - s.sync_offset >= 1 else "lower synchronizer.sync_offset"
        out.append(
            f"synchronizer.sync_interval = {s.sync_interval} (sync_offset {s.sync_offset}) with trainer.total_steps = {total}: no weight sync happens in this run, "
            f"every rollout is generated by the initial weights (version 0); {fix} or raise trainer.total_steps above {s.sync_interval + s.sync_offset}"
        )
    if s.mode not in RENDEZVOUS_MODES and s.sync_interval >= total:
        out.append(
            f"synchronizer.sync_interval = {s.sync_interval} with trainer.total_steps = {total}: the trainer publishes no weights before its last step, "
            f"so every rollout is generated by the initial weights (version 0); set synchronizer.sync_interval < {total} or raise trainer.total_steps"
        )
    return out


def step_volume(cfg: RFTConfig) -> str:
    """One line: how much one explorer step generates at most, and what one trainer step trains."""
    x, r = cfg.explorer, cfg.algorithm.repeat_times
    if x.partial.enabled:
        groups, tokens, why = x.partial.max_groups_in_flight or 2 * x.batch_size, x.partial.segment_max_tokens, "explorer.partial.segment_max_tokens"
    else:
        groups, tokens, why = x.batch_size, x.sampling.max_tokens, "explorer.sampling.max_tokens"
    each = " per explorer" if x.count > 1 else ""
    tbs, total = cfg.trainer.train_batch_size or x.batch_size * r, cfg.trainer.total_steps
    return (
        f"volume: up to {groups * r:,} generations ({groups:,} tasks x algorithm.repeat_times {r}) of up to {tokens:,} tokens ({why}) per explorer step{each}, "
        f"{groups * r * tokens:,} generated tokens at most; {tbs:,} experiences per trainer step, {tbs * total:,} over the run's {total:,} steps"
    )


# --------------------------------------------------------------------------- loading and errors


class ConfigError(UserError, ValueError):
    """A config that cannot be used; `str()` is the full user-facing message, one problem per line."""


def _format_errors(source: str, err: ValidationError) -> str:
    lines = [f"{source}: invalid configuration ({err.error_count()} problem{'s' if err.error_count() > 1 else ''})"]
    for e in err.errors():
        # Drop the union tag pydantic inserts after `reward` so the path reads like the YAML.
        parts = e["loc"]
        loc = ".".join(str(p) for i, p in enumerate(parts) if not (i and parts[i - 1] == "reward" and p in _REWARD_TAGS))
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key; remove it or check its spelling against `rft validate --schema`"
        if e["type"] == "finite_number":
            msg = "must be a finite number (not NaN or infinity); give a number within the field's bounds (`rft validate --schema`)"
        if e["type"] == "missing":
            lines.append(f"  {loc}: required field missing")
            continue
        if loc:
            lines.append(f"  {loc} = {e.get('input')!r}: {msg}")
        else:
            lines.append(f"  {msg}")
    return "\n".join(lines)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (['a','b','c'], value parsed as YAML); raises ConfigError on bad syntax."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE with a dotted key, e.g. --set synchronizer.sync_interval=2")
    key, _, raw = text.partition("=")
    path = key.strip().split(".")
    if not all(path):
        raise ConfigError(f"--set {text!r}: empty component in key {key!r}")
    try:
        value = yaml.load(raw, Loader=_UniqueKeyLoader) if raw.strip() else None
    except _DuplicateKey as e:
        raise ConfigError(f"--set {text!r}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {text!r}: value is not valid YAML ({e})") from None
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=c` overrides to a raw config dict (in place) and return it."""
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"--set {text!r}: {part!r} is a value ({child!r}), not a section")
            node = child
        node[path[-1]] = value
    return data


class _DuplicateKey(yaml.YAMLError):
    """A key given twice in one mapping; `str()` names it and both lines."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, refusing a key given twice in one mapping (at any depth): plain YAML
    keeps the last, so a second `trainer:` section would silently replace the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` merges; keys given beside it override, as YAML means
            key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:
                continue  # an unhashable key: the base loader names it
            if first is not None:
                raise _DuplicateKey(
                    f"line {line}: key {key!r} given twice in one section (first at line {first}); "
                    "YAML would keep only the last one, so merge the two into one or delete one"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: bytes | str, source: str) -> Any:
    """YAML text (a config file's bytes) -> its data; ConfigError naming `source` when it is not
    UTF-8, not YAML, or gives a key twice in one mapping."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            line = text.count(b"\n", 0, e.start) + 1
            column = e.start - (text.rfind(b"\n", 0, e.start) + 1) + 1
            raise ConfigError(f"{source}: not UTF-8 text (byte 0x{text[e.start]:02x} at line {line}, column {column}); save the file as UTF-8") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except _DuplicateKey as e:
        raise ConfigError(f"{source}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from None


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Read a YAML mapping, with errors that name the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{path}: config file not found")
    data = parse_yaml(p.read_bytes(), str(path))
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections (model, taskset, ...), got {type(data).__name__}")
    return data


def validate_config(data: dict[str, Any], source: str = "<config>") -> RFTConfig:
    """Validate a raw dict into an RFTConfig; raises ConfigError naming source, field, value and rule."""
    try:
        return RFTConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(source, e)) from None


def load_config(path: str | os.PathLike, overrides: list[str] | None = None) -> RFTConfig:
    """Load a YAML file, apply `--set` overrides, validate."""
    data = apply_overrides(read_yaml(path), overrides or [])
    return validate_config(data, str(path))


def to_yaml(cfg: BaseModel) -> str:
    """YAML text of a config, in field order (what `config.yaml` of a run holds)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


if __name__ == "__main__":
    import sys

    try:
        print(to_yaml(load_config(sys.argv[1], sys.argv[2:]).resolved()))
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        sys.exit(2)
