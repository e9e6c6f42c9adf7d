"""`TrainerSettings` from a run's config: the trainer gets the config's values, flat (fast).

.venv/bin/python -m pytest tests/rl_engine/trainer/test_trainer_settings.py -q
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from trainer_helpers import make_cfg

from rl_engine.trainer import TrainerSettings, trainer_settings


def test_settings_carry_the_config_values(tiny_model_dir):
    cfg = make_cfg(
        tiny_model_dir,
        algorithm={"loss": {"type": "ppo_clip", "clip_eps_low": 0.1, "clip_eps_high": 0.28}, "kl": {"coef": 0.05}},
        explorer={"batch_size": 3, "sampling": {"temperature": 0.7, "max_tokens": 9}},
        trainer={
            "micro_batch_size": 3,
            "lr": 2e-4,
            "warmup_steps": 5,
            "zero_stage": 2,
            "betas": [0.8, 0.99],
            "weight_decay": 0.1,
            "grad_clip": 0.5,
        },
        model={"dtype": "bfloat16"},
    )
    cfg.seed = 7
    s = trainer_settings(cfg)
    assert (s.model_path, s.tokenizer_path, s.dtype, s.seed) == (tiny_model_dir, None, "bfloat16", 7)
    assert (
        s.lr,
        s.micro_batch_size,
        s.warmup_steps,
        s.zero_stage,
        s.betas,
        s.weight_decay,
        s.grad_clip,
        s.num_threads,
    ) == (2e-4, 3, 5, 2, (0.8, 0.99), 0.1, 0.5, 1)
    assert s.train_batch_size == 6  # null in the config: explorer.batch_size 3 x algorithm.repeat_times 2
    assert (s.algorithm.loss.clip_eps_low, s.algorithm.loss.clip_eps_high, s.algorithm.kl.coef) == (0.1, 0.28, 0.05)
    assert s.max_response_tokens == 9  # the explorer's budget: overlong shaping and Dr.GRPO's divisor read it
    assert s.temperature == 0.7


def test_explicit_batch_size_and_greedy_temperature(tiny_model_dir):
    cfg = make_cfg(tiny_model_dir)
    # Set after validation: the run checks tie these to the explorer (a decoupled run may differ; greedy needs partial rollouts).
    cfg.trainer.train_batch_size, cfg.explorer.sampling.temperature = 8, 0.0
    s = trainer_settings(cfg)
    assert s.train_batch_size == 8
    assert s.temperature == 1.0  # greedy sampling: logprobs of the unscaled policy


def test_settings_are_frozen_and_refuse_unknown_fields(tiny_model_dir):
    s = trainer_settings(make_cfg(tiny_model_dir))
    with pytest.raises(ValidationError, match="frozen"):
        s.lr = 1.0
    with pytest.raises(ValidationError, match="learning_rate"):
        TrainerSettings(
            model_path=tiny_model_dir, seed=0, train_batch_size=4, micro_batch_size=2, lr=1e-3, learning_rate=1e-3
        )
