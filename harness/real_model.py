"""A real model (SmolLM2-135M-Instruct) through the explorer's and the trainer's paths: chat
prompts, rows built as the explorer builds them, and the vLLM-vs-trainer logprob gap.

Shared by tests (tests/rl_engine/sync/test_real_model.py) and benchmarks; never imports tests/.

    cfg = real_config(model_dir, dtype="bfloat16")
    engine, trainer = build_rollout_engine(cfg), build_trainer(real_trainer_settings(cfg))
    prompts = chat_prompts(engine.tokenizer, QUESTIONS[:4], cfg.model.max_model_len)
    groups = engine.generate(prompts, n=2, sampling=SamplingConfig(max_tokens=32, temperature=1.0), seed=1)
    gaps(trainer, groups)            # {"mean": ..., "max": ..., "tokens": ...}
    logprob_gap(model_dir, "bfloat16")   # all of the above in one call, engine closed after
"""

from __future__ import annotations

import uuid
from typing import Any

import torch

from rl_engine.config import RFTConfig, SamplingConfig
from rl_engine.experience import ExperienceBatch
from rl_engine.rewards import Task, encode_task
from rl_engine.roles.groups import Group, experience_row, one_step_generation

QUESTIONS = [
    "What is 2+2?",
    "Name a prime number larger than 10.",
    "Write one sentence about the sea.",
    "What is the capital of France?",
    "Give me a synonym of 'quick'.",
    "How many legs does a spider have?",
    "Say hello in Spanish.",
    "What colour is the sky on a clear day?",
]
MAX_MODEL_LEN = 256


def real_config(
    model_dir: str,
    dtype: str = "float32",
    max_model_len: int = MAX_MODEL_LEN,
    kv_cache_space_gib: float = 0.25,
    **sections: Any,
) -> RFTConfig:
    """A small valid RFTConfig around a real model: short context, small CPU KV cache."""
    data: dict[str, Any] = {
        "model": {"path": model_dir, "dtype": dtype, "max_model_len": max_model_len},
        "taskset": {"path": "unused.jsonl"},
        "explorer": {
            "engine": {"kv_cache_space_gib": kv_cache_space_gib},
            "sampling": {"max_tokens": 32, "temperature": 1.0},
        },
    }
    for name, values in sections.items():
        data[name] = (
            {**data[name], **values} if isinstance(values, dict) and isinstance(data.get(name), dict) else values
        )
    return RFTConfig.model_validate(data)


def real_trainer_settings(cfg: RFTConfig, train_batch_size: int = 2, lr: float = 1e-4) -> Any:
    """Trainer settings of `cfg`'s model and dtype: `train_batch_size` rows a step, one micro-batch."""
    from rl_engine.trainer import TrainerSettings

    return TrainerSettings(
        model_path=cfg.model.path,
        dtype=cfg.model.dtype,
        seed=cfg.seed,
        train_batch_size=train_batch_size,
        micro_batch_size=train_batch_size,
        lr=lr,
        warmup_steps=0,
        temperature=cfg.explorer.sampling.temperature or 1.0,
    )


def chat_prompts(tokenizer: Any, questions: list[str], max_model_len: int = MAX_MODEL_LEN) -> list[list[int]]:
    """Token ids of each question as the explorer makes them (chat template, no added special tokens)."""
    return [encode_task(tokenizer, None, Task(f"q#{i}", q, None), max_model_len)[1] for i, q in enumerate(questions)]


def experience_rows(groups: list[list[Any]], rewards: list[float] | None = None) -> ExperienceBatch:
    """Rollout groups as the explorer's rows (roles.groups), rewards 1, 0, 1, 0, ... within a group unless given."""
    rows = []
    k = 0
    for i, rollouts in enumerate(groups):
        g = Group(
            f"0-d{i + 1}-q#{i}",
            Task(f"q#{i}", "", None),
            "",
            [one_step_generation(uuid.uuid4().hex, 1, r) for r in rollouts],
        )
        for j, m in enumerate(g.members):
            reward = rewards[k] if rewards is not None else float(j % 2 == 0)
            rows.append(experience_row(g, m, 0, 1, reward, {}, "", 0.0))
            k += 1
    return ExperienceBatch.from_experiences(rows)


def token_gaps(trainer: Any, batch: ExperienceBatch) -> torch.Tensor:
    """|trainer logprob - behavior logprob| of every trained response token of `batch`, flat [T]."""
    t = batch.to_tensors(trainer.pad_token_id)
    mine = trainer.compute_logprobs(t).cpu()  # [B, L]
    mask = t["loss_mask"] > 0
    return (mine - t["behavior_logprobs"])[mask].abs()


def gaps(trainer: Any, groups: list[list[Any]]) -> dict[str, float]:
    """Mean and max |vLLM - trainer| logprob over every response token of `groups`, and their count."""
    d = token_gaps(trainer, experience_rows(groups)).double()
    return {"mean": float(d.mean()) if len(d) else 0.0, "max": float(d.max()) if len(d) else 0.0, "tokens": len(d)}


def logprob_gap(model_dir: str, dtype: str, n_prompts: int = 8, max_tokens: int = 32, seed: int = 1) -> dict[str, Any]:
    """Start an engine and a trainer on `model_dir` in `dtype` (model.dtype: both sides), sample one
    response to each of `n_prompts` chat prompts at temperature 1, and compare per-token logprobs.
    Returns {"dtype", "mean", "max", "tokens"} (abs differences over response tokens). The engine
    is closed before returning; takes about a minute on two CPU cores."""
    from rl_engine.rollout.engine import build_rollout_engine
    from rl_engine.trainer import build_trainer

    if n_prompts > len(QUESTIONS):
        raise ValueError(f"n_prompts = {n_prompts}: at most {len(QUESTIONS)} questions")
    cfg = real_config(model_dir, dtype=dtype)
    engine = build_rollout_engine(cfg)
    try:
        trainer = build_trainer(real_trainer_settings(cfg))
        prompts = chat_prompts(engine.tokenizer, QUESTIONS[:n_prompts], cfg.model.max_model_len)
        groups = engine.generate(prompts, 1, SamplingConfig(max_tokens=max_tokens, temperature=1.0), seed=seed)
        return {"dtype": dtype, **gaps(trainer, groups)}
    finally:
        engine.close()
