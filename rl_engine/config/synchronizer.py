"""The synchronizer: when and how weights flow from the trainer to the explorers.

Two variants, told apart by `mode` (docs/concepts/modes.md):
- `RendezvousSync` (synchronous, one_step_off_policy): explorer and trainer meet on a fixed
  schedule, `sync_interval` k and `sync_offset` m (rl_engine.schedule);
- `DecoupledSync` (fully_async, multi_explorer): the trainer publishes every k steps, the explorers
  pick up the newest weights; `max_staleness` (admission control) or `max_backlog_steps` bounds how
  far ahead they run.
A field of the other variant is refused by its type; `misplaced` says why and what to do instead.
The fields both variants share (sync_method, keep_last_checkpoints, delta, collective, wait_timeout_s)
are declared in each, from one annotated type apiece, so both show every field in the schema.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from rl_engine.config.base import _Model

RENDEZVOUS_MODES = ("synchronous", "one_step_off_policy")
DECOUPLED_MODES = ("fully_async", "multi_explorer")
Mode = Literal["synchronous", "one_step_off_policy", "fully_async", "multi_explorer"]


class CollectiveConfig(_Model):
    """The extra process group between trainer rank 0 and the explorers' inference workers."""

    host: str = Field(
        default="127.0.0.1", description="TCP rendezvous host of the weight-sync group (trainer rank 0's address)."
    )
    port: int | None = Field(
        default=None,
        ge=1024,
        le=65535,
        description="TCP rendezvous port of the weight-sync group; null: the trainer picks a free one and publishes it on the run's board.",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(default="auto", description="auto: nccl on CUDA, gloo on CPU.")
    bucket_mb: float = Field(
        default=64.0, gt=0.0, description="Parameters are broadcast in buckets of about this many MiB."
    )
    timeout_s: float = Field(default=300.0, gt=0.0, description="Timeout of a group join and of one sync.")
    shared_memory: bool = Field(
        default=True,
        description="gloo: when every inference worker runs on the trainer's host, the weights go through a shared-memory file in "
        "/dev/shm (one copy by the trainer, none by the receivers) and the group carries only bucket headers; a group with a "
        "worker elsewhere streams them. false: always stream.",
    )


class DeltaConfig(_Model):
    """Delta checkpoint sync (rl_engine.sync.delta): publish what changed since the previous version."""

    enabled: bool = Field(
        default=False,
        description="Checkpoint sync: publish each version as an exact sparse delta against the previous published one (changed elements, "
        "bit for bit, in the model's dtype), with a full checkpoint every full_every versions and whenever a delta would exceed half of one; "
        "explorers apply the chain. Pays off when few elements change per version (bfloat16 with a small lr); in float32 one Adam step moves every element.",
    )
    full_every: int = Field(
        default=10,
        ge=1,
        description="A full checkpoint every this many published versions (1: every version full); also the longest chain an explorer applies.",
    )


SyncMethod = Annotated[
    Literal["collective", "checkpoint"],
    Field(description="Broadcast over a process group, or committed checkpoints on storage."),
]
KeepLastCheckpoints = Annotated[
    int | None,
    Field(
        ge=0,
        description="Checkpoint sync: keep the newest this many committed checkpoints/version=*, deleting older ones after each publish, "
        "but never one an explorer may still load (the version just published; in the decoupled modes any newer than an explorer holds); 0 keeps only those; null keeps all.",
    ),
]
Delta = Annotated[
    DeltaConfig, Field(default_factory=DeltaConfig, description="Delta checkpoint sync (sync_method checkpoint only).")
]
Collective = Annotated[CollectiveConfig, Field(description="Settings of the collective method.")]
WaitTimeout = Annotated[float, Field(gt=0.0, description="Longest a side waits at a rendezvous before failing.")]


def _check_delta(sync_method: str, delta: DeltaConfig) -> None:
    if delta.enabled and sync_method != "checkpoint":
        raise ValueError(
            f"synchronizer.delta.enabled with sync_method {sync_method!r}: deltas are a checkpoint-sync format; set sync_method: checkpoint or delta.enabled: false"
        )


class RendezvousSync(_Model):
    """Rendezvous modes: the explorer syncs after explorer step e iff e > sync_offset and (e - sync_offset) % sync_interval == 0."""

    mode: Literal["synchronous", "one_step_off_policy"] = Field(
        default="synchronous",
        description="synchronous: rollout, train, sync (sync_offset 0); one_step_off_policy: the explorer runs sync_offset >= 1 steps ahead.",
    )
    sync_interval: int = Field(default=1, ge=1, description="k: rendezvous every k explorer steps.")
    sync_offset: int = Field(
        default=0,
        ge=0,
        description="m: the explorer runs m steps ahead before its first sync (0 in mode synchronous; one_step_off_policy: 1 when not given).",
    )
    sync_method: SyncMethod = "collective"
    keep_last_checkpoints: KeepLastCheckpoints = 3
    delta: Delta
    collective: Collective = Field(default_factory=CollectiveConfig)
    wait_timeout_s: WaitTimeout = 600.0

    @model_validator(mode="before")
    @classmethod
    def _one_step_ahead(cls, data: Any) -> Any:
        # one_step_off_policy without a sync_offset runs one step ahead, as its name says (a
        # `set synchronizer.mode=one_step_off_policy` alone then validates; 0 is synchronous's).
        if isinstance(data, dict) and data.get("mode") == "one_step_off_policy" and "sync_offset" not in data:
            return {**data, "sync_offset": 1}
        return data

    @model_validator(mode="after")
    def _offset_fits_mode(self) -> RendezvousSync:
        if self.mode == "synchronous" and self.sync_offset != 0:
            raise ValueError(
                f"synchronizer.sync_offset = {self.sync_offset}: mode 'synchronous' has sync_offset 0; use mode 'one_step_off_policy' to let the explorer run ahead"
            )
        if self.mode == "one_step_off_policy" and self.sync_offset < 1:
            raise ValueError(
                "synchronizer.sync_offset = 0: mode 'one_step_off_policy' needs sync_offset >= 1 (1 for one step ahead)"
            )
        _check_delta(self.sync_method, self.delta)
        return self


class DecoupledSync(_Model):
    """Decoupled modes: the trainer publishes every sync_interval steps, explorers load the newest weights between their steps."""

    mode: Literal["fully_async", "multi_explorer"] = Field(
        description="fully_async: one explorer; multi_explorer: explorer.count >= 2 explorers write to one buffer."
    )
    sync_interval: int = Field(default=1, ge=1, description="k: the trainer publishes weights every k trainer steps.")
    max_staleness: int | None = Field(
        default=None,
        ge=0,
        description="Bound on (trainer version at training - generating version), enforced as admission control: explorers wait for newer weights before generating what would be too stale; null for no bound.",
    )
    max_backlog_steps: int | None = Field(
        default=8,
        ge=1,
        description="Without max_staleness: explorers pause while this many explorer steps are written but not yet trained; null: no cap.",
    )
    sync_method: SyncMethod = "collective"
    keep_last_checkpoints: KeepLastCheckpoints = 3
    delta: Delta
    collective: Collective = Field(default_factory=CollectiveConfig)
    wait_timeout_s: WaitTimeout = 600.0

    @model_validator(mode="after")
    def _staleness_covers_interval(self) -> DecoupledSync:
        if self.max_staleness is not None and self.max_staleness < self.sync_interval - 1:
            raise ValueError(
                f"synchronizer.max_staleness = {self.max_staleness}: weights are published every sync_interval = {self.sync_interval} trainer steps, "
                f"so explorers are up to {self.sync_interval - 1} versions behind by design; set max_staleness >= {self.sync_interval - 1}"
            )
        _check_delta(self.sync_method, self.delta)
        return self


def _variant(value: Any) -> Hashable | None:
    """The union member a synchronizer section validates as: by its mode (none given: synchronous); None for an unknown mode."""
    mode = value.get("mode", "synchronous") if isinstance(value, dict) else getattr(value, "mode", None)
    return "rendezvous" if mode in RENDEZVOUS_MODES else "decoupled" if mode in DECOUPLED_MODES else None


UNKNOWN_MODE = "unknown_mode"  # the error type of a synchronizer whose mode is none of the four

SynchronizerConfig = Annotated[
    Annotated[RendezvousSync, Tag("rendezvous")] | Annotated[DecoupledSync, Tag("decoupled")],
    Discriminator(
        _variant,
        custom_error_type=UNKNOWN_MODE,
        custom_error_message="use one of synchronous, one_step_off_policy (rendezvous modes), fully_async, multi_explorer (decoupled modes)",
    ),
]
SYNC_TAGS = ("rendezvous", "decoupled")

# A field only one variant has -> (the modes that have it, why the others do not, what to do instead)
_VARIANT_FIELDS = {
    "sync_offset": (
        RENDEZVOUS_MODES,
        "only the rendezvous modes run the explorer a fixed number of steps ahead",
        "remove it or use a rendezvous mode (synchronous, one_step_off_policy)",
    ),
    "max_staleness": (
        DECOUPLED_MODES,
        "the rendezvous modes fix staleness by sync_interval/sync_offset",
        "set it to null or use an async mode (fully_async, multi_explorer)",
    ),
    "max_backlog_steps": (
        DECOUPLED_MODES,
        "a rendezvous explorer never runs further ahead than sync_offset steps",
        "remove it or use an async mode (fully_async, multi_explorer)",
    ),
}


def misplaced(field: str, value: Any, mode: Any) -> str | None:
    """The message for `synchronizer.<field>` given in a mode whose variant has no such field; None when it is not such a field."""
    if field not in _VARIANT_FIELDS or mode in _VARIANT_FIELDS[field][0]:
        return None
    _, why, fix = _VARIANT_FIELDS[field]
    return f"synchronizer.{field} = {value!r}: mode {mode!r} has no {field} ({why}); {fix}"
