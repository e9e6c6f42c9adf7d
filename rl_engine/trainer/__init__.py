"""The trainer side: the `Trainer` protocol (rl_engine.api), its settings and its factory (DeepSpeed is the one implementation).

from rl_engine.trainer import build_trainer, trainer_settings
trainer = build_trainer(trainer_settings(cfg))   # cfg: a run's RFTConfig (train_batch_size resolved or derivable)
...
trainer.close()                                  # with several ranks: the others exit
"""

from __future__ import annotations

from rl_engine.api import Trainer
from rl_engine.trainer.settings import TrainerSettings, trainer_settings


def build_trainer(settings: TrainerSettings) -> Trainer:
    """The trainer of `settings`: a DeepSpeed engine around the HF model at settings.model_path. In
    rank 0 of several (torchrun set WORLD_SIZE), one that leads the other ranks (rl_engine.trainer.ranks)."""
    from rl_engine.trainer.deepspeed_trainer import DeepSpeedTrainer
    from rl_engine.trainer.ranks import LeaderTrainer

    local = DeepSpeedTrainer(settings)
    if local.world == 1:
        return local
    if local.rank != 0:
        raise RuntimeError(
            f"build_trainer on trainer rank {local.rank}: ranks other than 0 follow rank 0 (rl_engine.trainer.ranks.follow)"
        )
    return LeaderTrainer(local)


__all__ = ["Trainer", "TrainerSettings", "build_trainer", "trainer_settings"]
