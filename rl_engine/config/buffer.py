"""The experience buffer and the storage (any fsspec URL) a run's files live on."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rl_engine.config.base import _Model, find_secret


class StorageConfig(_Model):
    """Where a run's files live: any fsspec URL. Credentials never go here."""

    url: str = Field(
        default="runs", description="Root of all runs: a local directory, `s3://bucket/prefix` or `memory://...`."
    )
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
        found = find_secret(v)
        if found:
            raise ValueError(
                f"storage options must not hold credentials ({found!r}); they would be saved with the run. "
                "Set them in the environment instead (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or FSSPEC_S3_KEY / FSSPEC_S3_SECRET)"
            )
        return v

    @model_validator(mode="after")
    def _one_outage_limit(self) -> StorageConfig:
        given = self.options.get("outage_timeout_s", self.outage_timeout_s)
        if given != self.outage_timeout_s:
            raise ValueError(
                f"options.outage_timeout_s = {given!r} disagrees with outage_timeout_s = {self.outage_timeout_s!r}; set only buffer.storage.outage_timeout_s"
            )
        return self

    def fs_options(self) -> dict[str, Any]:
        """The options every component opens this storage with (`rl_engine.storage.open_storage`): fsspec's plus the outage limit."""
        return {**self.options, "outage_timeout_s": self.outage_timeout_s}


class BufferConfig(_Model):
    """The experience buffer on the run's storage."""

    storage: StorageConfig = Field(default_factory=StorageConfig, description="Storage root and fsspec options.")
    whole_groups: bool = Field(default=True, description="Trainer batches contain only complete GRPO groups.")
    read_timeout_s: float = Field(
        default=600.0, gt=0.0, description="How long the trainer waits for enough committed experiences before failing."
    )
    poll_interval_s: float | None = Field(
        default=None,
        gt=0.0,
        le=60.0,
        description="How often a waiting reader (and the control board) looks for news; null: 5 ms on local disk, 100 ms on object stores. "
        "A write by a role of the same process (placement local) wakes it at once.",
    )
    commit_window_s: float = Field(
        default=60.0,
        gt=0.0,
        description="A reader's poll lists only commit records stamped within this many seconds of its clock, so its cost stays flat as the run grows; "
        "a record visible later than that after its stamp (a stalled commit, clocks apart between machines) waits for the next full listing.",
    )
    full_listing_interval_s: float = Field(
        default=600.0,
        gt=0.0,
        description="A reader lists every commit record when it starts and then this often, finding records later than commit_window_s.",
    )
    on_corrupt: Literal["fail", "skip"] = Field(
        default="fail",
        description="What a reader does with a committed file it cannot read: stop with its path, or report and skip it.",
    )
    verify_checksums: bool = Field(
        default=True,
        description="Check each file's checksum (XXH3-64; CRC-32 in records written before) against its commit record before use; a file that "
        "matches holds the bytes of a batch validated when it was built, so its rows are not checked again. Off skips the checksum but then "
        "checks the rows (slower) and lets a bit flip inside a committed file through; size, Arrow structure and schema are checked either way.",
    )
