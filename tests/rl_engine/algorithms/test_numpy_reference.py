"""GRPO as an independent numpy implementation, compared with `group_advantages` + `policy_loss`.

The reference is written from the formulas, not from the torch code: group mean and unbiased std
(ddof=1) advantages, token-level PPO-clip with an asymmetric clip, Schulman's k3 KL to a reference,
token-mean or seq-mean-token-mean aggregation, and the gradients of all of it in closed form.

    .venv/bin/python -m pytest tests/rl_engine/algorithms/test_numpy_reference.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rl_engine.algorithms import group_advantages, policy_loss
from rl_engine.config import AlgorithmConfig

B, L, EPS_LOW, EPS_HIGH, KL_COEF = 6, 7, 0.2, 0.28, 0.1
STD_EPS = 1e-6  # group_advantages' eps added to the std
SEEDS = [4, 13]  # batches in which the clip binds on both sides (checked below)


def _batch(seed: int = SEEDS[0]):
    """A random batch: 2 groups of 3, each row a prompt then a response of 1.. tokens (padding after)."""
    rng = np.random.default_rng(seed)
    group_index = np.array([3, 3, 3, 8, 8, 8])
    rewards = rng.uniform(0.0, 1.0, size=B)
    mask = np.zeros((B, L))
    for b in range(B):
        start = rng.integers(1, 4)  # prompt length (position 0 never has a logprob)
        end = rng.integers(start + 1, L + 1)  # at least one response token
        mask[b, start:end] = 1.0
    mask[0, :] = 0.0
    mask[0, 3] = 1.0  # a single-token response
    old = rng.uniform(-3.0, -0.1, size=(B, L))
    new = old + rng.normal(0.0, 0.35, size=(B, L))  # ratios spread around 1: some clip on each side
    ref = new + rng.normal(0.0, 0.3, size=(B, L))
    return rewards, group_index, mask, old, new, ref


def _np_advantages(rewards, group_index):
    adv = np.zeros_like(rewards)
    for g in np.unique(group_index):
        idx = group_index == g
        r = rewards[idx]
        adv[idx] = (r - r.mean()) / (r.std(ddof=1) + STD_EPS)
    return adv


def _np_grpo(adv, mask, old, new, ref, aggregation):
    """(loss, pg, kl, clipped tokens, d loss / d new) of the reference."""
    a = adv[:, None]  # [B, 1]
    ratio = np.exp(new - old)
    surr1 = -a * ratio
    surr2 = -a * np.clip(ratio, 1.0 - EPS_LOW, 1.0 + EPS_HIGH)
    pg_tok = np.maximum(surr1, surr2)
    clipped = surr2 > surr1  # the clip is active: the token has no gradient
    d_pg = np.where(clipped, 0.0, -a * ratio)  # d(-A r)/d log pi = -A r
    q_over_p = np.exp(ref - new)
    kl_tok = q_over_p - 1.0 - np.log(q_over_p)  # k3
    d_kl = 1.0 - q_over_p  # d/d log pi of exp(ref - new) - 1 - (ref - new)
    if aggregation == "token-mean":
        w = mask / mask.sum()  # [B, L]: every token weighs the same
    else:
        rows = mask.sum(1, keepdims=True)
        w = mask / rows / np.count_nonzero(rows)  # every sequence weighs the same
    pg, kl = (pg_tok * w).sum(), (kl_tok * w).sum()
    return pg + KL_COEF * kl, pg, kl, (clipped * mask).sum(), w * (d_pg + KL_COEF * d_kl)


@pytest.mark.parametrize("seed", SEEDS)
def test_batch_exercises_both_clips(seed):
    rewards, group_index, mask, old, new, _ = _batch(seed)
    adv = _np_advantages(rewards, group_index)[:, None]
    ratio, m = np.exp(new - old), mask > 0
    assert ((ratio > 1 + EPS_HIGH) & (adv > 0) & m).any() and (
        (ratio < 1 - EPS_LOW) & (adv < 0) & m
    ).any()  # the clip binds
    assert ((ratio > 1 + EPS_HIGH) & (adv < 0) & m).any() and (
        (ratio < 1 - EPS_LOW) & (adv > 0) & m
    ).any()  # beyond it, not binding


def test_group_advantages_match_numpy():
    rewards, group_index, *_ = _batch()
    got = group_advantages(torch.tensor(rewards, dtype=torch.float32), torch.tensor(group_index), "grpo", "group")
    np.testing.assert_allclose(
        got.numpy(), _np_advantages(rewards.astype(np.float32).astype(np.float64), group_index), atol=1e-6, rtol=1e-6
    )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_grpo_loss_matches_numpy(aggregation, seed):
    rewards, group_index, mask, old, new, ref = _batch(seed)
    cfg = AlgorithmConfig(
        preset="grpo",
        loss={"type": "ppo_clip", "clip_eps_low": EPS_LOW, "clip_eps_high": EPS_HIGH},
        kl={"coef": KL_COEF, "estimator": "k3"},
        aggregation=aggregation,
    )
    adv = group_advantages(
        torch.tensor(rewards), torch.tensor(group_index), cfg.advantage.type, cfg.advantage.std
    )  # [B]
    lp = torch.tensor(new, requires_grad=True)  # float64: the comparison is about the formulas, not rounding
    out = policy_loss(lp, torch.tensor(old), adv, torch.tensor(mask), cfg, ref_logprobs=torch.tensor(ref))
    out.loss.backward()

    loss, pg, kl, clipped, grad = _np_grpo(_np_advantages(rewards, group_index), mask, old, new, ref, aggregation)
    tol = {"atol": 1e-6, "rtol": 1e-6}
    np.testing.assert_allclose(out.loss.item(), loss, **tol)
    np.testing.assert_allclose(out.pg_loss.item(), pg, **tol)
    np.testing.assert_allclose(out.kl.item(), kl, **tol)
    assert out.clipped_tokens.item() == clipped > 0
    np.testing.assert_allclose(lp.grad.numpy(), grad, **tol)


def test_grpo_loss_matches_numpy_in_float32():
    # the trainer's dtype: float32 logprobs, the same numbers to float32 precision
    rewards, group_index, mask, old, new, ref = _batch()
    cfg = AlgorithmConfig(
        preset="grpo",
        loss={"type": "ppo_clip", "clip_eps_low": EPS_LOW, "clip_eps_high": EPS_HIGH},
        kl={"coef": KL_COEF, "estimator": "k3"},
    )
    f32 = [x.astype(np.float32).astype(np.float64) for x in (rewards, old, new, ref)]
    adv = group_advantages(torch.tensor(f32[0], dtype=torch.float32), torch.tensor(group_index))
    out = policy_loss(
        *(torch.tensor(x, dtype=torch.float32) for x in (f32[2], f32[1])),
        adv,
        torch.tensor(mask, dtype=torch.float32),
        cfg,
        ref_logprobs=torch.tensor(f32[3], dtype=torch.float32),
    )
    loss, *_ = _np_grpo(_np_advantages(f32[0], group_index), mask, f32[1], f32[2], f32[3], "token-mean")
    np.testing.assert_allclose(out.loss.item(), loss, atol=1e-5, rtol=1e-5)
