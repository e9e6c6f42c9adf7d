"""From a trainer batch's rewards to what the loss needs: which rows are trained, and their advantages.

One function, run on the whole batch before it is split over micro-batches or ranks (a batch
baseline, batch std and dynamic sampling all look at more than one row):

    prep = prepare_rows(rewards, group_index, response_len, truncated, cfg, max_response_tokens)
    mask = loss_mask * prep.trained_rows[:, None]   # [B, L]
    ... policy_loss(..., advantages=prep.advantages, ...)

Order: overlong shaping changes rewards; dynamic sampling drops groups whose shaped rewards are all
equal (no advantage, so no gradient, but they would dilute the normalisers); the estimator runs on
the kept groups; truncated responses are masked last, when asked (they still shape their group's
baseline: they were sampled from the same policy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rl_engine.algorithms.advantages import informative_rows, overlong_penalty
from rl_engine.config import AlgorithmConfig
from rl_engine.errors import UserError
from rl_engine.registry import ESTIMATORS


@dataclass
class PreparedRows:
    """Per-row inputs of the loss, and what was left out (counts over the batch)."""

    advantages: Tensor  # [B] float32; 0 on rows not trained
    trained_rows: Tensor  # [B] float32, 1 = the row's tokens are trained
    filtered: int  # rows of zero-variance groups dynamic sampling left out
    truncated_masked: int  # rows left out as truncated (overlong.mask_truncated)
    overlong_penalty: float  # mean penalty the overlong shaping added to the rewards (<= 0)


def prepare_rows(
    rewards: Tensor,
    group_index: Tensor,
    response_len: Tensor,
    truncated: Tensor,
    cfg: AlgorithmConfig,
    max_response_tokens: int | None,
) -> PreparedRows:
    """rewards [B] float, group_index [B] long, response_len [B] long, truncated [B] (1 = cut by
    the token budget), cfg the algorithm, max_response_tokens the response budget (needed by
    overlong shaping)."""
    r = rewards.float().cpu()
    g = group_index.cpu()
    penalty = torch.zeros_like(r)
    if cfg.overlong.buffer_fraction is not None:
        if max_response_tokens is None:
            raise ValueError("algorithm.overlong.buffer_fraction needs the response token budget (max_response_tokens)")
        buffer = max(1, round(cfg.overlong.buffer_fraction * max_response_tokens))
        penalty = overlong_penalty(response_len.cpu(), max_response_tokens, buffer, cfg.overlong.penalty)  # [B]
    shaped = r + penalty  # [B]
    keep = informative_rows(shaped, g) if cfg.dynamic_sampling else torch.ones_like(r, dtype=torch.bool)  # [B]
    adv = torch.zeros_like(r)
    if keep.any():
        got = ESTIMATORS.build(cfg.advantage)(shaped[keep], g[keep])  # [K]
        if not isinstance(got, torch.Tensor) or got.shape != shaped[keep].shape:
            raise UserError(
                f"algorithm.advantage {cfg.advantage.type!r} returned {getattr(got, 'shape', type(got).__name__)}; "
                f"an estimator returns one advantage per experience, a tensor of shape {tuple(shaped[keep].shape)}"
            )
        adv[keep] = got.to(adv.dtype)
    trained = keep.clone()
    if cfg.overlong.mask_truncated:
        trained &= ~truncated.cpu().bool()
    return PreparedRows(
        advantages=adv * trained,
        trained_rows=trained.float(),
        filtered=int((~keep).sum()),
        truncated_masked=int((keep & ~trained).sum()),
        overlong_penalty=float(penalty.mean()) if penalty.numel() else 0.0,
    )


def prepare_batch_rows(batch: dict[str, Tensor], cfg: AlgorithmConfig, max_response_tokens: int | None) -> PreparedRows:
    """`prepare_rows` of a trainer batch (`ExperienceBatch.to_tensors`' keys)."""
    return prepare_rows(
        batch["rewards"], batch["group_index"], batch["response_len"], batch["truncated"], cfg, max_response_tokens
    )


def row_metrics(prep: PreparedRows, cfg: AlgorithmConfig) -> dict[str, float]:
    """The step metrics of the knobs that are on: filtered_experiences, truncated_masked, overlong_penalty."""
    out = {}
    if cfg.dynamic_sampling:
        out["filtered_experiences"] = float(prep.filtered)
    if cfg.overlong.mask_truncated:
        out["truncated_masked"] = float(prep.truncated_masked)
    if cfg.overlong.buffer_fraction is not None:
        out["overlong_penalty"] = prep.overlong_penalty
    return out


def token_sum_divisor(cfg: AlgorithmConfig, max_response_tokens: int | None) -> int:
    """seq-mean-token-sum's divisor, resolved: `max_tokens` is the response token budget."""
    if cfg.token_sum_divisor is None:
        return 1
    if cfg.token_sum_divisor == "max_tokens":
        if max_response_tokens is None:
            raise ValueError(
                "algorithm.token_sum_divisor: max_tokens needs the response token budget (max_response_tokens)"
            )
        return max_response_tokens
    return cfg.token_sum_divisor
