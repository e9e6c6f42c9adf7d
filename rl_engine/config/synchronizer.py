"""The synchronizer: when and how weights flow from the trainer to the explorers."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rl_engine.config.base import _Model


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
