"""Placement: where the roles run (tasks of one flow run, or a deployment's flow run each)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from rl_engine.config.base import _Model, find_secret


class DeviceSplit(_Model):
    """Which of this machine's GPUs each role gets under placement `local` (visible device indices:
    0 is the first device this process sees, after any CUDA_VISIBLE_DEVICES of its own)."""

    trainer: list[int] = Field(
        min_length=1,
        description="The trainer's ranks on this machine, one device each: rank r trains on trainer[r] (trainer.num_ranks / trainer.nodes entries).",
    )
    explorers: list[list[int]] = Field(
        min_length=1,
        description="Each explorer's vLLM engine: explorers[i] are explorer i's devices (explorer.count lists of explorer.engine.tensor_parallel_size devices).",
    )

    @field_validator("trainer", "explorers")
    @classmethod
    def _indices(cls, v: list[Any]) -> list[Any]:
        flat = [d for x in v for d in (x if isinstance(x, list) else [x])]
        if any(d < 0 for d in flat):
            raise ValueError("device indices start at 0 (the first GPU this machine shows)")
        return v


class LocalPlacement(_Model):
    """Every role (explorers, trainer) as a concurrent task of the mode's flow run, in one process."""

    type: Literal["local"] = Field(default="local", description="Roles run as tasks of the mode's flow run.")
    devices: DeviceSplit | None = Field(
        default=None,
        description="GPUs per role on this machine (rl_engine.run.devices); null: the trainer's ranks take the first devices, the explorers' engines the rest "
        "(explorer.engine.tensor_parallel_size each). Ignored where no GPU is visible (CPU: every role on the CPU).",
    )
    heartbeat_s: float = Field(
        default=5.0, gt=0.0, description="Seconds between a role's heartbeats on the run's board."
    )
    heartbeat_timeout_s: float = Field(
        default=60.0, gt=0.0, description="A role silent this long is taken for dead and the run stops."
    )


class DeploymentsPlacement(_Model):
    """Each role as its own flow run of its Prefect deployment: its own process, on the pool that serves it."""

    type: Literal["deployments"] = Field(
        description="Roles run as flow runs of their deployments (`prefect deploy --all` creates them)."
    )
    explorer_deployment: str = Field(
        default="rft-explorer/default",
        description="Deployment (`flow-name/deployment-name`) that runs an explorer role.",
    )
    trainer_deployment: str = Field(
        default="rft-trainer/default",
        description="Deployment (`flow-name/deployment-name`) that runs the trainer role.",
    )
    reward_deployment: str = Field(
        default="rft-reward/default",
        description="Deployment (`flow-name/deployment-name`) that runs the reward role: the run's reward service, started when `taskset.reward.type` is `model`.",
    )
    job_variables: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Work-pool job variables per role: key `trainer`, `explorer` (every explorer), `explorer-<i>` or `reward` (the reward role), e.g. {explorer-1: {env: {CUDA_VISIBLE_DEVICES: '1'}}}.",
    )
    start_timeout_s: float = Field(
        default=600.0, gt=0.0, description="Longest a role's flow run may wait for a worker before the run fails."
    )
    heartbeat_s: float = Field(
        default=5.0, gt=0.0, description="Seconds between a role's heartbeats on the run's board."
    )
    heartbeat_timeout_s: float = Field(
        default=60.0, gt=0.0, description="A role silent this long is taken for dead and the run stops."
    )

    @field_validator("job_variables")
    @classmethod
    def _roles(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for key in v:
            if key not in ("trainer", "explorer", "reward") and not (key.startswith("explorer-") and key[9:].isdigit()):
                raise ValueError(f"job_variables key {key!r}: use `trainer`, `explorer`, `explorer-<i>` or `reward`")
        found = find_secret(v)
        if found:
            raise ValueError(
                f"job_variables.{found}: credentials must not be in the config: it is saved with the run (config.yaml) and shown as the flow run's "
                "parameters in the Prefect UI. Give them to the worker instead: set them in the environment of every worker that runs a role "
                "(`AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... prefect worker start ...`), and keep only non-secret variables here"
            )
        return v


PlacementConfig = Annotated[LocalPlacement | DeploymentsPlacement, Field(discriminator="type")]
