"""The trainer side: the `Trainer` protocol and its factory (DeepSpeed is the one implementation).

    from rl_engine.trainer import build_trainer
    trainer = build_trainer(cfg)             # cfg: RFTConfig (train_batch_size resolved or derivable)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rl_engine.trainer.protocol import Trainer

if TYPE_CHECKING:
    from rl_engine.config import RFTConfig


def build_trainer(cfg: "RFTConfig") -> Trainer:
    """The trainer for `cfg`: a DeepSpeed engine around the HF model at cfg.model.path."""
    from rl_engine.trainer.deepspeed_trainer import DeepSpeedTrainer

    return DeepSpeedTrainer(cfg)


__all__ = ["Trainer", "build_trainer"]
