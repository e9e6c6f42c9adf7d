"""rl_engine.run.preflight.check_devices: what the visible GPUs cannot hold is refused before any
engine starts, naming the field and what to use instead.

    .venv/bin/python -m pytest tests/rl_engine/test_preflight_devices.py
"""

from __future__ import annotations

import pytest

from rl_engine.config import RFTConfig
from rl_engine.errors import UserError
from rl_engine.run.preflight import check_devices


def _cfg(model: str, sync_method: str = "collective", num_ranks: int = 1, placement: str = "local") -> RFTConfig:
    return RFTConfig.model_validate(
        {
            "model": {"path": model},
            "taskset": {"path": "t.jsonl"},
            "explorer": {"batch_size": 4},
            "trainer": {"micro_batch_size": 2, "num_ranks": num_ranks},
            "synchronizer": {"sync_method": sync_method},
            "placement": {"type": placement},
        }
    )


def test_collective_sync_on_one_gpu_is_refused_with_checkpoint_as_the_fix(tiny_model_dir):
    with pytest.raises(UserError, match=r"sync_method = collective on a single GPU.*NCCL refuses.*use sync_method: checkpoint"):
        check_devices(_cfg(tiny_model_dir), gpus=1)
    check_devices(_cfg(tiny_model_dir, "checkpoint"), gpus=1)  # colocated: weights go through storage


def test_more_trainer_ranks_than_gpus_is_refused(tiny_model_dir):
    with pytest.raises(UserError, match=r"trainer.num_ranks = 4 but this machine shows 2 GPU"):
        check_devices(_cfg(tiny_model_dir, num_ranks=4), gpus=2)


def test_what_fits_passes(tiny_model_dir):
    check_devices(_cfg(tiny_model_dir, num_ranks=2), gpus=0)  # CPU: gloo, any number of ranks
    check_devices(_cfg(tiny_model_dir, num_ranks=2), gpus=2)
    check_devices(_cfg(tiny_model_dir, placement="deployments"), gpus=1)  # each role's devices come from its job variables
