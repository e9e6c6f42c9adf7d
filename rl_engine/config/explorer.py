"""The explorer: how many, how big a step, how its vLLM engine samples, partial rollouts."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from rl_engine.config.base import _Model


class SamplingConfig(_Model):
    """vLLM sampling parameters of a rollout."""

    temperature: float = Field(
        default=1.0,
        ge=0.0,
        le=2.0,
        description="Sampling temperature, 0..2 as vLLM accepts; 1.0 samples the policy itself (what the loss assumes).",
    )
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(default=-1, ge=-1, description="Top-k sampling; -1 disables.")
    max_tokens: int = Field(
        default=64,
        ge=1,
        description="Response token budget of one generation (one segment when partial rollouts are on).",
    )
    stop: list[str] = Field(default_factory=list, description="Stop strings (EOS always stops); none may be empty.")

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError("an empty stop string would stop every generation at once (vLLM refuses it); remove it")
        return v


class EngineConfig(_Model):
    """How the vLLM engine of an explorer is started."""

    enforce_eager: bool = Field(
        default=True, description="Disable CUDA graphs / compilation (required on the CPU build)."
    )
    kv_cache_space_gib: float = Field(
        default=1.0,
        gt=0.0,
        le=1024,
        description="CPU KV cache size in GiB (sets VLLM_CPU_KVCACHE_SPACE); ignored on GPU.",
    )
    gpu_memory_utilization: float = Field(
        default=0.5, gt=0.0, le=1.0, description="Fraction of GPU memory vLLM may use; ignored on CPU."
    )
    tensor_parallel_size: int = Field(default=1, ge=1, description="vLLM tensor parallel size.")
    num_threads: Annotated[int, Field(ge=1)] | Literal["all"] | None = Field(
        default=None,
        description="CPU threads for the engine (VLLM_CPU_OMP_THREADS_BIND): a number, `all` (every core the process starting the engine may run on: "
        "for a synchronous run on CPU, whose engine and trainer take turns), or null to let vLLM decide (on 2 cores: one for the engine, one for its scheduler).",
    )
    servers: list[str] = Field(
        default_factory=list,
        description="Engine servers to use instead of starting engines: explorer i uses servers[i] (one per explorer), e.g. "
        '["http://127.0.0.1:8100"] from `rft engine serve CONFIG --port 8100`, which keeps an engine up between runs. Empty: each explorer starts its own.',
    )

    @field_validator("num_threads", mode="before")
    @classmethod
    def _threads(cls, v: object) -> object:
        if v is None or v == "all" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            return v
        raise ValueError(
            f"{v!r} is no thread count: give a number >= 1, `all` (every core of the process that starts the engine) or null (vLLM decides)"
        )

    @field_validator("servers")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        for url in v:
            if not url.startswith(("http://", "https://")):
                raise ValueError(
                    f"{url!r} is no http(s) URL; give the address `rft engine serve` printed, e.g. http://127.0.0.1:8100"
                )
        return v


class PartialRolloutConfig(_Model):
    """Cut long generations by a token budget and resume them in a later explorer step."""

    enabled: bool = Field(default=False, description="Turn partial rollouts on.")
    segment_max_tokens: int = Field(
        default=32, ge=1, description="Token budget of one segment within one explorer step."
    )
    max_response_tokens: int = Field(
        default=128, ge=1, description="Total response budget; a trajectory reaching it is complete, marked truncated."
    )
    max_groups_in_flight: int | None = Field(
        default=None,
        ge=1,
        description="GRPO groups an explorer holds unfinished or unwritten: each step starts new tasks up to it, so it bounds work in flight and how many versions a group can span; null = 2 x explorer.batch_size.",
    )
    repeat_ngram: int = Field(
        default=4,
        ge=1,
        description="Longest repeating pattern, in tokens, the repetition detector looks for (patterns of 1..n tokens).",
    )
    repeat_threshold: int = Field(
        default=8,
        ge=2,
        description="Stop a generation early (finish reason `repeat`) once its last pattern occurred this many times in a row, across segment boundaries.",
    )
    repeat_penalty: float = Field(
        default=0.0, le=0.0, description="Reward added to trajectories stopped for repetition (<= 0)."
    )

    @model_validator(mode="after")
    def _budgets(self) -> PartialRolloutConfig:
        if self.enabled and self.segment_max_tokens >= self.max_response_tokens:
            raise ValueError(
                f"explorer.partial.segment_max_tokens = {self.segment_max_tokens} must be below "
                f"explorer.partial.max_response_tokens = {self.max_response_tokens}, or nothing is ever cut"
            )
        return self


class ExplorerConfig(_Model):
    """Rollout side: how many explorers, how big a step, how the engine samples."""

    count: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Number of explorers (engines) writing to the buffer; > 1 only in multi_explorer mode.",
    )
    batch_size: int = Field(
        default=4, ge=1, description="Tasks per explorer step (each repeated algorithm.repeat_times times)."
    )
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Sampling parameters.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="vLLM engine settings.")
    partial: PartialRolloutConfig = Field(default_factory=PartialRolloutConfig, description="Partial rollout settings.")
