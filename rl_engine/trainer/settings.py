"""What the DeepSpeed trainer takes: `TrainerSettings`, the values it needs and nothing else.

Components take values, not the config tree: a run builds the settings from its resolved config
with `trainer_settings(cfg)` (the trainer role, the loop, every trainer rank, the same way);
warm start, which has no RL run, builds them from its own arguments.

    from rl_engine.trainer import build_trainer, trainer_settings
    trainer = build_trainer(trainer_settings(cfg))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from rl_engine.config import AlgorithmConfig, LoRAConfig, ModelConfig, TrainerConfig

if TYPE_CHECKING:
    from rl_engine.config import RFTConfig


def _default(model: type[BaseModel], field: str) -> object:
    """The config's default of `field`: warm start and bench.train leave these out, a run sets them all."""
    return model.model_fields[field].default


class TrainerSettings(BaseModel):
    """The DeepSpeed trainer's inputs (defaults are `TrainerConfig`'s and `ModelConfig`'s)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    model_path: str = Field(
        description="Local Hugging Face model directory (config.json, weights) the policy starts from."
    )
    tokenizer_path: str | None = Field(default=None, description="Tokenizer directory; null: model_path.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default=_default(ModelConfig, "dtype"), description="Parameter dtype of the model (and of the KL reference)."
    )
    seed: int = Field(ge=0, description="torch seed set before the model is built.")
    train_batch_size: int = Field(ge=1, description="Experiences per step over all ranks (one optimizer update).")
    micro_batch_size: int = Field(
        ge=1, description="Experiences per forward/backward pass on one rank; gradient accumulation makes up the rest."
    )
    share_prompts: bool = Field(
        default=_default(TrainerConfig, "share_prompts"),
        description="Run each group's shared prompt once per micro-batch (rl_engine.trainer.prefix) where the model allows it.",
    )
    lr: float = Field(gt=0.0, lt=1.0, description="Peak learning rate (AdamW).")
    betas: tuple[float, float] = Field(default=_default(TrainerConfig, "betas"), description="AdamW betas.")
    weight_decay: float = Field(
        default=_default(TrainerConfig, "weight_decay"), ge=0.0, description="AdamW weight decay."
    )
    warmup_steps: int = Field(
        default=_default(TrainerConfig, "warmup_steps"),
        ge=0,
        description="Linear LR warmup over this many steps; 0: full lr from step 1.",
    )
    grad_clip: float = Field(default=_default(TrainerConfig, "grad_clip"), gt=0.0, description="Gradient norm clip.")
    zero_stage: Literal[0, 1, 2, 3] = Field(
        default=_default(TrainerConfig, "zero_stage"), description="DeepSpeed ZeRO stage."
    )
    num_threads: int | None = Field(
        default=_default(TrainerConfig, "num_threads"),
        ge=1,
        description="torch intra-op threads of this process; null keeps torch's default.",
    )
    temperature: float = Field(
        default=1.0,
        gt=0.0,
        description="Logits are divided by this before logprobs and entropy: the explorer's sampling temperature (1.0 when it samples greedily).",
    )
    max_response_tokens: int | None = Field(
        default=None,
        ge=1,
        description="The explorer's response token budget (overlong shaping and Dr.GRPO's divisor read it); null: no RL run.",
    )
    algorithm: AlgorithmConfig = Field(
        default_factory=AlgorithmConfig,
        description="The RL loss and advantages (train_step); SFT (sft_step) uses none of it.",
    )
    lora: LoRAConfig | None = Field(
        default=None,
        description="LoRA adapters on the model (rl_engine.trainer.lora; ZeRO-3 refused); null: every weight trains.",
    )
    local_device: int = Field(
        default=0,
        ge=0,
        description="CUDA device index of a trainer that is the only rank of its process's world (no launcher); a launcher's LOCAL_RANK wins (rl_engine.trainer.dist).",
    )


def trainer_settings(cfg: RFTConfig, local_device: int = 0) -> TrainerSettings:
    """The settings of a run's trainer, from its config (train_batch_size from the resolve step
    when the config leaves it null) and, for a trainer alone in its process, its device from the
    run's device plan."""
    t, m = cfg.trainer, cfg.model
    temperature = cfg.explorer.sampling.temperature
    return TrainerSettings(
        model_path=m.path,
        tokenizer_path=m.tokenizer_path,
        dtype=m.dtype,
        seed=cfg.seed,
        train_batch_size=t.train_batch_size or cfg.resolved().trainer.train_batch_size,
        micro_batch_size=t.micro_batch_size,
        share_prompts=t.share_prompts,
        lr=t.lr,
        betas=t.betas,
        weight_decay=t.weight_decay,
        warmup_steps=t.warmup_steps,
        grad_clip=t.grad_clip,
        zero_stage=t.zero_stage,
        num_threads=t.num_threads,
        temperature=temperature if temperature > 0 else 1.0,  # greedy sampling: the logprobs of the unscaled policy
        max_response_tokens=cfg.explorer.partial.max_response_tokens
        if cfg.explorer.partial.enabled
        else cfg.explorer.sampling.max_tokens,
        algorithm=cfg.algorithm,
        lora=m.lora,
        local_device=local_device,
    )
