"""Builders shared by the trainer tests (configs on the tiny model, batches in the trainer layout)."""

from __future__ import annotations

from typing import Any

import torch


def make_cfg(model_dir: str, **sections: dict[str, Any]):
    """An RFTConfig for trainer tests: 2 tasks x 2 rollouts = batch 4, micro-batch 2, 1 thread."""
    from rl_engine.config import RFTConfig

    data: dict[str, Any] = {
        "model": {"path": model_dir},
        "taskset": {"path": "unused.jsonl"},
        "explorer": {"batch_size": 2},
        "algorithm": {"repeat_times": 2},
        "trainer": {"micro_batch_size": 2, "lr": 1e-3, "num_threads": 1},
    }
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return RFTConfig.model_validate(data)


def make_batch(
    trainer=None,
    seed: int = 0,
    rows: int = 4,
    prompt_len: int = 4,
    response_lens=(5, 3, 5, 3),
    vocab: tuple[int, int] = (3, 200),
) -> dict[str, torch.Tensor]:
    """A right-padded batch in the `ExperienceBatch.to_tensors` layout; groups (0, 0, 1, 1).

    Behavior logprobs are the trainer's own (ratio 1 at the first step) when `trainer` is given,
    else 0.
    """
    g = torch.Generator().manual_seed(seed)
    length = prompt_len + max(response_lens)
    ids = torch.randint(vocab[0], vocab[1], (rows, length), generator=g)  # [B, L]
    am = torch.zeros(rows, length, dtype=torch.long)
    lm = torch.zeros(rows, length)
    for b, n in enumerate(response_lens):
        am[b, : prompt_len + n] = 1
        lm[b, prompt_len : prompt_len + n] = 1
        ids[b, prompt_len + n :] = 0  # pad id of the tiny tokenizer
    batch = {
        "input_ids": ids,
        "attention_mask": am,
        "loss_mask": lm,
        "behavior_logprobs": torch.zeros(rows, length),
        "versions": torch.where(lm > 0, 0, -1).long(),
        "rewards": torch.tensor([1.0, 0.0, 1.0, 0.0])[:rows],
        "group_index": torch.tensor([0, 0, 1, 1])[:rows],
        "response_start": torch.full((rows,), prompt_len, dtype=torch.long),
        "response_len": torch.tensor(response_lens[:rows], dtype=torch.long),
        "truncated": torch.zeros(rows, dtype=torch.long),
    }
    if trainer is not None:
        batch["behavior_logprobs"] = trainer.compute_logprobs(batch).cpu() * lm
    return batch


def grpo_case():
    """(algorithm section, batch builder) of a GRPO step where every loss term and metric is
    non-trivial: KL on, ratios > 1 (some clipped), groups of unequal token counts (8 and 3)."""
    algo = {"aggregation": "token-mean", "kl": {"coef": 0.1, "estimator": "k3"}}

    def build(trainer) -> dict[str, torch.Tensor]:
        batch = make_batch(trainer, response_lens=(5, 3, 2, 1))
        noise = torch.randn(batch["loss_mask"].shape, generator=torch.Generator().manual_seed(5))
        batch["behavior_logprobs"] -= 0.3 * noise.abs() * batch["loss_mask"]
        return batch

    return algo, build
