"""The algorithm: GRPO advantages, the clipped policy-gradient loss, the optional KL penalty."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rl_engine.config.base import _Model


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
