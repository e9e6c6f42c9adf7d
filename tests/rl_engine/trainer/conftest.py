"""Fixtures of the trainer tests: one GRPO trainer shared by the session.

DeepSpeed's first init in a process loads a JIT-built comm op (seconds); later inits are fast,
but tests that do not need fresh weights share this one trainer.
"""

from __future__ import annotations

import os

import pytest
from trainer_helpers import make_cfg

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def shared_trainer(tiny_model_dir):
    """One GRPO trainer for tests that only look at relative changes or at its current weights."""
    from rl_engine.trainer import build_trainer, trainer_settings

    return build_trainer(trainer_settings(make_cfg(tiny_model_dir)))
