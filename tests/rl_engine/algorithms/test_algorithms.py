"""Unit tests of the algorithm functions against values computed by hand (in the comments).

.venv/bin/python -m pytest tests/rl_engine/algorithms -q
"""

from __future__ import annotations

import math

import pytest
import torch

from rl_engine.algorithms import (
    aggregate,
    group_advantages,
    kl_token,
    policy_loss,
    ppo_clip_token_loss,
    sft_loss,
    token_entropy,
    token_logprobs,
    version_mask,
)
from rl_engine.config import AlgorithmConfig, KLConfig

LN = math.log


def close(a, b, tol=1e-5):
    torch.testing.assert_close(
        torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol, rtol=tol
    )


# ----------------------------------------------------------------------------- advantages


def test_group_advantages_mean_std():
    # group 7: rewards 1, 0 -> mean .5, unbiased std sqrt((.25 + .25) / 1) = .70711 -> +-.70711
    # group 3: rewards 0, 1, 2 -> mean 1, std sqrt((1 + 0 + 1) / 2) = 1 -> -1, 0, 1
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0]), torch.tensor([7, 7, 3, 3, 3]))
    close(adv, [0.70711, -0.70711, -1.0, 0.0, 1.0])


def test_group_advantages_no_std():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0]), torch.tensor([7, 7, 3, 3, 3]), "dr_grpo", "none")
    close(adv, [0.5, -0.5, -1.0, 0.0, 1.0])


def test_group_advantages_degenerate_groups():
    # group 0: all equal (std 0) -> 0, not NaN/inf; group 1: a single member -> 0
    adv = group_advantages(torch.tensor([0.3, 0.3, 0.3, 5.0]), torch.tensor([0, 0, 0, 1]))
    assert torch.isfinite(adv).all()
    close(adv, [0.0, 0.0, 0.0, 0.0])


def test_group_advantages_shape_check():
    with pytest.raises(ValueError, match="must both be"):
        group_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))


# ----------------------------------------------------------------------------- logprobs, entropy


def test_token_logprobs_alignment_and_temperature():
    # V = 2; every position predicts p = softmax([0, ln 3]) = [1/4, 3/4]
    logits = torch.tensor([[[0.0, LN(3)]] * 3])  # [1, 3, 2]
    ids = torch.tensor([[0, 1, 0]])
    # position 0: no prediction; position 1: token 1 from logits[0] -> ln 3/4; position 2: token 0 -> ln 1/4
    close(token_logprobs(logits, ids), [[0.0, LN(0.75), LN(0.25)]])
    # temperature 2: softmax([0, ln3 / 2]) = [1, sqrt3] / (1 + sqrt3)
    s3 = math.sqrt(3)
    close(token_logprobs(logits, ids, temperature=2.0), [[0.0, LN(s3 / (1 + s3)), LN(1 / (1 + s3))]])


def test_token_entropy():
    logits = torch.zeros(1, 3, 4)  # uniform over 4 -> ln 4 at predicted positions
    close(token_entropy(logits), [[0.0, LN(4), LN(4)]])


# ----------------------------------------------------------------------------- aggregation


VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_aggregate_token_mean():
    close(aggregate(VALUES, MASK, "token-mean"), (1 + 2 + 3 + 4) / 4)
    close(aggregate(VALUES, MASK, "token-mean", num_tokens=8), 10 / 8)


def test_aggregate_seq_mean():
    # row means 2 and 4; the row with no tokens does not count -> (2 + 4) / 2
    close(aggregate(VALUES, MASK, "seq-mean-token-mean"), 3.0)
    close(aggregate(VALUES, MASK, "seq-mean-token-mean", num_seqs=4), 6 / 4)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_aggregate_micro_batches_sum_to_whole(mode):
    whole = aggregate(VALUES, MASK, mode)
    n_tok, n_seq = MASK.sum().item(), 2
    parts = aggregate(VALUES[:1], MASK[:1], mode, n_tok, n_seq) + aggregate(VALUES[1:], MASK[1:], mode, n_tok, n_seq)
    close(parts, whole)


def test_aggregate_empty_mask_is_zero_not_nan():
    close(aggregate(VALUES, torch.zeros_like(MASK), "token-mean"), 0.0)
    close(aggregate(VALUES, torch.zeros_like(MASK), "seq-mean-token-mean"), 0.0)


def test_aggregate_unknown_mode():
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate(VALUES, MASK, "sum")


# ----------------------------------------------------------------------------- PPO clip


def test_ppo_clip_token_loss_cases():
    # columns: ratio e^.5 = 1.6487, ratio .5, ratio 1.25; eps_low .2, eps_high .28
    old = torch.zeros(2, 3)
    new = torch.tensor([[0.5, LN(0.5), LN(1.25)]] * 2)
    adv = torch.tensor([1.0, -1.0])
    loss, clipped = ppo_clip_token_loss(new, old, adv, torch.ones_like(new), 0.2, 0.28)
    # A = +1: max(-1.6487, -1.28) = -1.28 (clipped); max(-.5, -.8) = -.5; max(-1.25, -1.25) = -1.25
    # A = -1: max(1.6487, 1.28) = 1.6487; max(.5, .8) = .8 (clipped); max(1.25, 1.25) = 1.25
    close(loss, [[-1.28, -0.5, -1.25], [math.exp(0.5), 0.8, 1.25]])
    assert clipped.tolist() == [[True, False, False], [False, True, False]]


def test_ppo_clip_gradient_is_zero_where_clipped():
    new = torch.tensor([[0.5, LN(0.5)]], requires_grad=True)
    loss, _ = ppo_clip_token_loss(new, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), 0.2, 0.2)
    loss.sum().backward()
    # d(-A r)/d logp = -A r: clipped token 0 -> 0, token 1 -> -.5
    close(new.grad, [[0.0, -0.5]])


# ----------------------------------------------------------------------------- KL, version mask, SFT


def test_kl_estimators():
    # p = .5, q = .25: k1 = ln 2 = .6931; k3 = q/p - 1 - ln(q/p) = .5 - 1 + ln 2 = .1931
    lp, ref = torch.tensor([LN(0.5)]), torch.tensor([LN(0.25)])
    close(kl_token(lp, ref, "k1"), [LN(2)])
    close(kl_token(lp, ref, "k3"), [0.5 - 1 + LN(2)])
    close(kl_token(lp, lp, "k3"), [0.0])


def test_version_mask():
    versions = torch.tensor([[-1, 3, 4, 5]])
    # trainer at version 5, gap 1: 5-3 = 2 > 1 masked; 4 and 5 kept; -1 (prompt) is outside loss_mask anyway
    assert version_mask(versions, 5, 1).tolist() == [[0.0, 0.0, 1.0, 1.0]]
    assert version_mask(versions, 5, None).tolist() == [[1.0, 1.0, 1.0, 1.0]]
    assert version_mask(versions, 5, 0).tolist() == [[0.0, 0.0, 0.0, 1.0]]


def test_sft_loss():
    lp = torch.tensor([[0.0, LN(0.5), LN(0.25)]])
    # mean NLL of the two masked tokens: (ln 2 + ln 4) / 2 = 1.5 ln 2
    close(sft_loss(lp, torch.tensor([[0.0, 1.0, 1.0]])), 1.5 * LN(2))


# ----------------------------------------------------------------------------- policy loss


def test_policy_loss_with_kl_token_mean():
    cfg = AlgorithmConfig(
        loss={"type": "ppo_clip", "clip_eps_low": 0.2, "clip_eps_high": 0.2}, kl=KLConfig(coef=0.1, estimator="k1")
    )
    new = torch.tensor([[0.0, LN(0.5), LN(0.5)], [0.0, LN(0.25), 0.0]])
    old = torch.tensor([[0.0, LN(0.5), LN(0.25)], [0.0, LN(0.25), 0.0]])
    ref = torch.tensor([[0.0, LN(0.25), LN(0.25)], [0.0, LN(0.25), 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    out = policy_loss(new, old, torch.tensor([1.0, -2.0]), mask, cfg, ref_logprobs=ref)
    # ratios: 1, 2 (clipped to 1.2 for A = 1 -> -1.2), 1; token losses -1, -1.2, 2 -> pg = -.2 / 3
    # k1: ln 2, ln 2, 0 -> kl = 2 ln 2 / 3; loss = pg + .1 kl
    close(out.pg_loss, -0.2 / 3)
    close(out.kl, 2 * LN(2) / 3)
    close(out.loss, -0.2 / 3 + 0.1 * 2 * LN(2) / 3)
    close(out.clipped_tokens, 1.0)


def test_policy_loss_seq_mean_no_kl():
    cfg = AlgorithmConfig(aggregation="seq-mean-token-mean")
    new = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    out = policy_loss(new, new, torch.tensor([1.0, 3.0]), mask, cfg)
    # ratio 1 everywhere: token loss -A; per sequence -1 and -3 -> mean -2
    close(out.loss, -2.0)
    assert out.kl is None


def test_policy_loss_kl_needs_reference():
    cfg = AlgorithmConfig(kl=KLConfig())
    with pytest.raises(ValueError, match="reference"):
        policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), cfg)
