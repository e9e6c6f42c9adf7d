"""Run by torchrun in test_ranks.py: for each ZeRO stage, two GRPO steps of a fresh trainer on the
fixed batch, on however many ranks torchrun started, with state saved after the first; then a
fresh trainer resumes from that state and takes the second step again. Rank 0 writes the
updated weights (both ways) and the three steps' metrics to OUT/zero=<stage>/.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/rl_engine/trainer/ranks_script.py MODEL_DIR 0,2 OUT
"""

from __future__ import annotations

import json
import os
import sys

import torch
from safetensors.torch import save_file
from trainer_helpers import grpo_case, make_cfg


def main(model_dir: str, zero_stage: int, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    from rl_engine.trainer import build_trainer, trainer_settings
    from rl_engine.trainer.deepspeed_trainer import DeepSpeedTrainer
    from rl_engine.trainer.ranks import follow

    algo, batch_args = grpo_case()
    cfg = make_cfg(model_dir, algorithm=algo, trainer={"micro_batch_size": 1, "zero_stage": zero_stage})
    if int(os.environ.get("RANK", "0")) != 0:
        follow(DeepSpeedTrainer(trainer_settings(cfg)))  # the two steps
        follow(DeepSpeedTrainer(trainer_settings(cfg)))  # the resumed second step
        return
    tr = build_trainer(trainer_settings(cfg))
    batch = batch_args(tr)
    metrics = [tr.train_step(batch)]
    tr.save_state(os.path.join(out, "state"))
    metrics.append(tr.train_step(batch))
    _save(tr, os.path.join(out, "weights.safetensors"))
    tr.close()
    resumed = build_trainer(trainer_settings(cfg))
    resumed.load_state(os.path.join(out, "state"))
    metrics.append(resumed.train_step(batch))
    _save(resumed, os.path.join(out, "weights-resumed.safetensors"))
    resumed.close()
    with open(os.path.join(out, "metrics.json"), "w") as f:
        json.dump(metrics, f)


def _save(trainer, path: str) -> None:
    save_file({n: t.detach().cpu().contiguous() for n, t in trainer.named_weights()}, path)


if __name__ == "__main__":
    torch.set_num_threads(1)
    for stage in sys.argv[2].split(","):
        main(sys.argv[1], int(stage), os.path.join(sys.argv[3], f"zero={stage}"))
