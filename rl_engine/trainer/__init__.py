"""The trainer side: the `Trainer` protocol and its factory (DeepSpeed is the one implementation).

    from rl_engine.trainer import build_trainer
    trainer = build_trainer(cfg)             # cfg: RFTConfig (train_batch_size resolved or derivable)
    ...
    trainer.close()                          # with several ranks: the others exit
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rl_engine.trainer.protocol import Trainer

if TYPE_CHECKING:
    from rl_engine.config import RFTConfig


def build_trainer(cfg: "RFTConfig") -> Trainer:
    """The trainer for `cfg`: a DeepSpeed engine around the HF model at cfg.model.path. In rank 0
    of several (torchrun set WORLD_SIZE), one that leads the other ranks (rl_engine.trainer.ranks)."""
    from rl_engine.trainer.deepspeed_trainer import DeepSpeedTrainer
    from rl_engine.trainer.ranks import LeaderTrainer

    local = DeepSpeedTrainer(cfg)
    if local.world == 1:
        return local
    if local.rank != 0:
        raise RuntimeError(f"build_trainer on trainer rank {local.rank}: ranks other than 0 follow rank 0 (rl_engine.trainer.ranks.follow)")
    return LeaderTrainer(local)


__all__ = ["Trainer", "build_trainer"]
