"""The DeepSpeed trainer: batch sizes, optimizer, checkpoints, ranks and nodes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rl_engine.config.base import _Model


class TrainerConfig(_Model):
    """DeepSpeed trainer."""

    total_steps: int = Field(
        default=10, ge=1, description="Trainer steps of the run; the policy reaches version total_steps."
    )
    train_batch_size: int | None = Field(
        default=None,
        ge=1,
        description="Experiences per trainer step; null resolves to explorer.batch_size x algorithm.repeat_times (one explorer step).",
    )
    micro_batch_size: int = Field(
        default=8,
        ge=1,
        description="Experiences per forward/backward pass (gradient accumulation makes up the rest); the batch's rows are sorted by length before they are cut, and each pass runs only up to its longest row.",
    )
    share_prompts: bool = Field(
        default=True,
        description="Run a group's shared prompt once per micro-batch, each row only its own tokens after it (attending to the prompt's cached keys "
        "and values), and keep a group's rows in the same micro-batches where that runs fewer positions: the same logprobs and gradients as whole rows, to rounding. "
        "Applies to the policy loss and the logprob passes (a recomputed proximal policy, the KL reference) of models whose logits are lm_head of the last hidden state (llama, qwen2, qwen3, mistral) and full attention, and not to ZeRO-3 on several ranks (whose ranks must run the same forwards); false: whole rows.",
    )
    lr: float = Field(default=1e-5, gt=0.0, lt=1.0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(default=0.0, ge=0.0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas.")
    warmup_steps: int = Field(
        default=0,
        ge=0,
        description="Linear LR warmup over this many trainer steps (torch LambdaLR; DeepSpeed's WarmupLR trains its first steps at lr 0).",
    )
    grad_clip: float = Field(default=1.0, gt=0.0, description="Gradient norm clip.")
    zero_stage: Literal[0, 1, 2, 3] = Field(default=0, description="DeepSpeed ZeRO stage (0 on CPU).")
    checkpoint_interval: int = Field(
        default=5,
        ge=1,
        description="Save resumable trainer state (with the buffer cursor) every this many trainer steps.",
    )
    keep_last_states: int | None = Field(
        default=3,
        ge=1,
        description="Keep the newest this many committed trainer states (trainer_state/step=*), deleting older ones after each save; the newest is always kept (a resume loads it); null keeps all.",
    )
    num_threads: int | None = Field(
        default=None, ge=1, description="torch intra-op threads of the trainer; null keeps torch's default (per rank)."
    )
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
    def _nodes(self) -> TrainerConfig:
        if self.num_ranks % self.nodes:
            raise ValueError(
                f"trainer.num_ranks = {self.num_ranks} does not split over trainer.nodes = {self.nodes}; use a multiple of nodes"
            )
        if self.nodes > 1 and self.rendezvous is None:
            raise ValueError(
                f"trainer.nodes = {self.nodes} needs trainer.rendezvous = 'host:port' (node 0's address, a port free there) where the nodes' ranks meet"
            )
        return self
