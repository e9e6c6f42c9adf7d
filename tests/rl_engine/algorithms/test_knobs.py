"""Unit tests of the algorithm knobs (issue 22) against values computed by hand (in the comments):
advantage estimators and std levels, dynamic sampling, overlong shaping, the policy losses (values
and gradients), aggregations, off-policy corrections, `prepare_rows`, and `AlgorithmConfig`'s presets.

    .venv/bin/python -m pytest tests/rl_engine/algorithms/test_knobs.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

from rl_engine.algorithms import (
    aggregate,
    cispo_token_loss,
    clipped_objective,
    group_advantages,
    gspo_token_loss,
    informative_rows,
    kimi_token_loss,
    offpolicy_weights,
    overlong_penalty,
    policy_loss,
    ppo_clip_token_loss,
    prepare_rows,
    token_sum_divisor,
)
from rl_engine.config import AlgorithmConfig

LN = math.log


def close(a, b, tol=1e-5):
    torch.testing.assert_close(
        torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol, rtol=tol
    )


# ----------------------------------------------------------------------------- advantages

# group 5: rewards 1, 0, 0 -> mean 1/3, centred 2/3, -1/3, -1/3, unbiased std sqrt((4/9 + 1/9 + 1/9) / 2) = .57735
# group 2: rewards 2, 0    -> mean 1, centred 1, -1, std sqrt(2) = 1.41421
# rloo centred: 1 - 0 = 1, 0 - (1 + 0) / 2 = -.5, -.5 | 2 - 0 = 2, 0 - 2 = -2
# reinforce_pp centred (batch mean 3/5): .4, -.6, -.6, 1.4, -.6
# batch std of centred: grpo sqrt((4/9 + 1/9 + 1/9 + 1 + 1) / 4) = .816497; rloo sqrt(9.5 / 4) = 1.541104;
#   reinforce_pp sqrt((.16 + .36 + .36 + 1.96 + .36) / 4) = sqrt(.8) = .894427
R5 = torch.tensor([1.0, 0.0, 0.0, 2.0, 0.0])
G5 = torch.tensor([5, 5, 5, 2, 2])
S3 = 1 / math.sqrt(3)  # .57735


@pytest.mark.parametrize(
    "estimator,std,expected",
    [
        ("grpo", "group", [(2 / 3) / S3, -(1 / 3) / S3, -(1 / 3) / S3, 1 / math.sqrt(2), -1 / math.sqrt(2)]),
        ("grpo", "batch", [0.816497, -0.408248, -0.408248, 1.224745, -1.224745]),
        ("grpo", "none", [2 / 3, -1 / 3, -1 / 3, 1.0, -1.0]),
        ("dr_grpo", "none", [2 / 3, -1 / 3, -1 / 3, 1.0, -1.0]),
        ("dr_grpo", "group", [1.154701, -0.577350, -0.577350, 0.707107, -0.707107]),
        ("rloo", "none", [1.0, -0.5, -0.5, 2.0, -2.0]),
        ("rloo", "group", [1 / S3, -0.5 / S3, -0.5 / S3, 2 / math.sqrt(2), -2 / math.sqrt(2)]),
        ("rloo", "batch", [1 / 1.541104, -0.5 / 1.541104, -0.5 / 1.541104, 2 / 1.541104, -2 / 1.541104]),
        ("reinforce_pp", "batch", [0.4 / 0.894427, -0.6 / 0.894427, -0.6 / 0.894427, 1.4 / 0.894427, -0.6 / 0.894427]),
        ("reinforce_pp", "none", [0.4, -0.6, -0.6, 1.4, -0.6]),
        ("reinforce_pp", "group", [0.4 / S3, -0.6 / S3, -0.6 / S3, 1.4 / math.sqrt(2), -0.6 / math.sqrt(2)]),
    ],
)
def test_estimators_and_std_levels(estimator, std, expected):
    adv = group_advantages(R5, G5, estimator, std)
    assert adv.dtype == torch.float32
    close(adv, expected)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
@pytest.mark.parametrize("std", ["group", "batch", "none"])
def test_zero_variance_and_single_member_groups_are_finite(estimator, std):
    # group 0: 1, 1 (std 0); group 1: 0, 1; group 2: a single member
    adv = group_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0, 4.0]), torch.tensor([0, 0, 1, 1, 2]), estimator, std)
    assert torch.isfinite(adv).all()
    if estimator != "reinforce_pp":  # group baselines: the zero-variance group and the lone member get 0
        close(adv[[0, 1, 4]], [0.0, 0.0, 0.0])
    if std == "group":  # no scale in a zero-variance group, whatever the baseline
        close(adv[[0, 1]], [0.0, 0.0])
    close(
        group_advantages(torch.full((4,), 0.7), torch.tensor([0, 0, 1, 1]), estimator, std), [0.0] * 4
    )  # an all-equal batch


def test_unknown_estimator_and_std():
    with pytest.raises(ValueError, match="estimator"):
        group_advantages(R5, G5, "ppo", "group")
    with pytest.raises(ValueError, match="std level"):
        group_advantages(R5, G5, "grpo", "row")


def test_informative_rows():
    # group 0: 1, 1 -> all equal; group 1: 0, 1 -> informative; group 2: one member -> never informative
    keep = informative_rows(torch.tensor([1.0, 1.0, 0.0, 1.0, 3.0]), torch.tensor([0, 0, 1, 1, 2]))
    assert keep.tolist() == [False, False, True, True, False]
    assert informative_rows(torch.zeros(0), torch.zeros(0, dtype=torch.long)).shape == (0,)


def test_overlong_penalty():
    # budget 10, buffer 4 -> the penalty starts at 6: lengths 3, 6, 7, 8, 10 are 0, 0, 1, 2, 4 over -> -.5 * over / 4
    close(overlong_penalty(torch.tensor([3, 6, 7, 8, 10]), 10, 4, 0.5), [0.0, 0.0, -0.125, -0.25, -0.5])


# ----------------------------------------------------------------------------- aggregation

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_aggregate_seq_mean_token_sum_with_divisor():
    # row sums 6 and 4, / divisor 4 -> 1.5 and 1; the empty row does not count -> 2.5 / 2; whole-batch 4 seqs -> 2.5 / 4
    close(aggregate(VALUES, MASK, "seq-mean-token-sum", token_sum_divisor=4.0), 1.25)
    close(aggregate(VALUES, MASK, "seq-mean-token-sum", num_seqs=4, token_sum_divisor=4.0), 0.625)


def test_seq_mean_token_sum_weighs_every_token_the_same_whatever_its_length():
    # Dr.GRPO: d loss / d value = mask / (divisor * seqs) = 1 / (8 * 2) on every token of both rows
    # (seq-mean-token-mean would give 1 / (3 * 2) and 1 / (1 * 2))
    v = VALUES.clone().requires_grad_()
    aggregate(v, MASK, "seq-mean-token-sum", token_sum_divisor=8.0).backward()
    close(v.grad, MASK / 16)
    v.grad = None
    aggregate(v, MASK, "seq-mean-token-mean").backward()
    close(v.grad, [[1 / 6, 1 / 6, 1 / 6], [1 / 2, 0, 0], [0, 0, 0]])


def test_single_token_responses_every_aggregation_agrees():
    # one token per response: token mean = mean of sequence means = mean of sums (divisor 1) = (1 + 4 + 7) / 3
    mask = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    vals = torch.tensor([[9.0, 1.0, 9.0], [4.0, 9.0, 9.0], [9.0, 9.0, 7.0]])
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        close(aggregate(vals, mask, mode), 4.0)


def _batch():
    lp = torch.tensor(
        [[0.0, -1.0, -0.5, -2.0], [0.0, -0.3, -0.9, -0.1], [0.0, -1.5, -0.2, -0.7], [0.0, -0.4, -0.6, -0.8]]
    )
    old = lp + torch.tensor(
        [[0.0, 0.1, -0.4, 0.3], [0.0, -0.05, 0.5, 0.0], [0.0, 0.2, 0.2, -0.3], [0.0, 0.0, 0.1, 0.1]]
    )
    ref = lp + 0.25
    mask = torch.tensor(
        [[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]]
    )  # row 2: filtered
    return lp, old, ref, mask, torch.tensor([1.0, -0.5, 2.0, -1.5])


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize(
    "loss",
    [
        {"type": "ppo_clip"},
        {"type": "gspo", "clip_eps_low": 0.1, "clip_eps_high": 0.1},
        {"type": "cispo"},
        {"type": "kimi"},
    ],
)
def test_micro_batches_sum_to_the_whole_batch(aggregation, loss):
    # gradient accumulation: the micro-batches' losses and gradients, with the whole batch's counts
    # (6 tokens, 3 sequences with tokens) and divisor, sum to the whole batch's
    div = 8 if aggregation == "seq-mean-token-sum" else None
    cfg = AlgorithmConfig(
        aggregation=aggregation, token_sum_divisor=div, loss=loss, kl={"coef": 0.1, "estimator": "k3"}
    )
    lp, old, ref, mask, adv = _batch()
    d = float(div or 1)
    whole_lp = lp.clone().requires_grad_()
    whole = policy_loss(whole_lp, old, adv, mask, cfg, ref_logprobs=ref, token_sum_divisor=d)
    whole.loss.backward()
    parts_lp = lp.clone().requires_grad_()
    total = sum(
        policy_loss(
            parts_lp[s],
            old[s],
            adv[s],
            mask[s],
            cfg,
            ref_logprobs=ref[s],
            num_tokens=6,
            num_seqs=3,
            token_sum_divisor=d,
        ).loss
        for s in (slice(0, 1), slice(1, 4))
    )
    total.backward()
    close(total, whole.loss)
    close(parts_lp.grad, whole_lp.grad)


# ----------------------------------------------------------------------------- losses


def test_clipped_objective_per_token_advantages():
    # A [B, L]: ratio 1.5 with A = +1 -> clipped to 1.2: -1.2; with A = -1 -> 1.5 (not clipped)
    loss, clipped = clipped_objective(torch.tensor([[1.5, 1.5]]), torch.tensor([[1.0, -1.0]]), 0.2, 0.2)
    close(loss, [[-1.2, 1.5]])
    assert clipped.tolist() == [[True, False]]


def test_gspo_shares_the_sequence_ratio_and_its_gradient():
    # row 0: log ratios .1, .3 (masked third token .9 ignored) -> s = exp(.2) = 1.2214, inside [.7, 1.3], A = 2
    # every token's loss is -A s = -2.4428; with seq-mean-token-mean the gradient is -s A * (1/2) per token,
    # i.e. -s * A * grad(mean log pi); the masked token gets none. Token-level PPO would use e^.1 and e^.3.
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    lp = (old + torch.tensor([[0.1, 0.3, 0.9]])).requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, clipped = gspo_token_loss(lp, old, torch.tensor([2.0]), mask, 0.3, 0.3)
    s = math.exp(0.2)
    close(loss, [[-2 * s] * 3])
    assert not clipped.any()
    aggregate(loss, mask, "seq-mean-token-mean").backward()
    close(lp.grad, [[-s * 2 / 2, -s * 2 / 2, 0.0]])


def test_gspo_clips_whole_sequences():
    # A = +1, s = exp(.5) = 1.6487 > 1.2 -> every token -1.2, clipped, no gradient;
    # A = -1, s = exp(-.5) = .6065 < .8 -> max(.6065, .8) = .8 on every token, clipped, no gradient
    old = torch.zeros(2, 2)
    lp = torch.tensor([[0.4, 0.6], [-0.4, -0.6]], requires_grad=True)
    loss, clipped = gspo_token_loss(lp, old, torch.tensor([1.0, -1.0]), torch.ones(2, 2), 0.2, 0.2)
    close(loss, [[-1.2, -1.2], [0.8, 0.8]])
    assert clipped.all()
    loss.sum().backward()
    close(lp.grad, torch.zeros(2, 2))
    # a single-token response: s is its own ratio, GSPO is token-level PPO-clip
    g, gc = gspo_token_loss(lp[:, :1], old[:, :1], torch.tensor([1.0, -1.0]), torch.ones(2, 1), 0.2, 0.2)
    p, pc = ppo_clip_token_loss(lp[:, :1], old[:, :1], torch.tensor([1.0, -1.0]), torch.ones(2, 1), 0.2, 0.2)
    close(g, p)
    assert gc.tolist() == pc.tolist()


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    # pi_old .2, .2; pi .6, .1 -> r = 3, .5; eps_high 1 (w <= 2), no lower bound -> w = 2 (clipped), .5; A = 1
    # loss = -w A log pi = -2 ln .6 = 1.02165, -.5 ln .1 = 1.15129; d/d log pi = -w A = -2, -.5
    old = torch.full((1, 2), LN(0.2))
    lp = torch.tensor([[LN(0.6), LN(0.1)]], requires_grad=True)
    loss, clipped = cispo_token_loss(lp, old, torch.tensor([1.0]), torch.ones_like(lp), None, 1.0)
    close(loss, [[-2 * LN(0.6), -0.5 * LN(0.1)]])
    assert clipped.tolist() == [[True, False]]
    loss.sum().backward()
    close(lp.grad, [[-2.0, -0.5]])
    # PPO-clip with the same bound drops the clipped token's gradient: ratio 3 > 2 with A > 0 -> 0; r = .5 -> -A r = -.5
    lp2 = lp.detach().clone().requires_grad_()
    ppo_clip_token_loss(lp2, old, torch.tensor([1.0]), torch.ones_like(old), 0.9, 1.0)[0].sum().backward()
    close(lp2.grad, [[0.0, -0.5]])
    # a lower bound 1 - .2 = .8 clips r = .5 up to .8: loss -.8 ln .1
    loss, clipped = cispo_token_loss(lp, old, torch.tensor([1.0]), torch.ones_like(lp), 0.2, 1.0)
    close(loss[0, 1], -0.8 * LN(0.1))
    assert clipped.tolist() == [[True, True]]


def test_kimi_penalty_is_flat_at_pi_old():
    # tau .5, A 2, log pi = ln .5: at pi = pi_old loss = -2 ln .5 = 1.38629 and gradient -A = -2 (penalty's is 0)
    # log pi - log pi_old = .4: loss = -2 ln .5 + .25 * .16 = 1.42629; gradient -2 + tau * .4 = -1.8
    old = torch.full((1, 2), LN(0.5))
    lp = torch.tensor([[LN(0.5), LN(0.5)]], requires_grad=True)
    shifted_old = old - torch.tensor([[0.0, 0.4]])
    loss = kimi_token_loss(lp, shifted_old, torch.tensor([2.0]), torch.ones_like(lp), 0.5)
    close(loss, [[-2 * LN(0.5), -2 * LN(0.5) + 0.04]])
    loss.sum().backward()
    close(lp.grad, [[-2.0, -1.8]])
    lp.grad = None
    kimi_token_loss(
        lp, old, torch.zeros(1), torch.ones_like(lp), 0.5
    ).sum().backward()  # the penalty alone, at pi = pi_old
    close(lp.grad, [[0.0, 0.0]])


def test_masked_tokens_do_not_move_the_loss():
    lp, old, _ref, mask, adv = _batch()
    for loss in ({"type": "ppo_clip"}, {"type": "gspo"}, {"type": "cispo"}, {"type": "kimi"}):
        cfg = AlgorithmConfig(loss=loss, aggregation="seq-mean-token-mean")
        a = policy_loss(lp, old, adv, mask, cfg).loss
        b = policy_loss(lp + 3.0 * (1 - mask), old, adv, mask, cfg).loss  # garbage on untrained positions
        close(a, b)


# ----------------------------------------------------------------------------- off-policy correction


def test_offpolicy_weights_mixed_version_response():
    # one response whose tokens were sampled by versions 3, 4, 5, then 9 (unmasked): the trainer's proximal logprobs
    # are -1 everywhere, the behavior ones -1 - ln 2, -1 + ln 2, -1, -1 - ln 9 -> ratios 2, .5, 1 (and 9, not trained)
    prox, m = torch.full((1, 4), -1.0), torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    beh = prox - torch.tensor([[LN(2), -LN(2), 0.0, LN(9)]])
    # token clamp [.8, 1.5] (truncated IS): each token its own ratio, clipped -> 1.5, .8, 1; the untrained one 1
    w, keep, outside = offpolicy_weights(prox, beh, m, "token", "clamp", 0.8, 1.5)
    close(w, [[1.5, 0.8, 1.0, 1.0]])
    close(keep, [[1.0] * 4])
    assert outside.tolist() == [[True, True, False, False]]
    # token mask [.6, 1.8] (icepop): 2 and .5 dropped, 1 kept
    w, keep, _ = offpolicy_weights(prox, beh, m, "token", "mask", 0.6, 1.8)
    close(w, [[0.0, 0.0, 1.0, 1.0]])
    close(keep, [[0.0, 0.0, 1.0, 1.0]])
    # sequence mask [.999, 1.001]: geometric mean over the trained tokens (2 * .5 * 1)^(1/3) = 1 -> the whole response kept
    w, keep, outside = offpolicy_weights(prox, beh, m, "sequence", "mask", 0.999, 1.001)
    close(w[:, :3], [[1.0, 1.0, 1.0]])
    close(keep, [[1.0] * 4])
    assert not outside.any()
    # ratios 2, 2, 1: geometric mean 4^(1/3) = 1.5874 -> outside [.5, 1.5]: masked (its trained tokens) or clamped
    beh2 = prox - torch.tensor([[LN(2), LN(2), 0.0, LN(9)]])
    w, keep, outside = offpolicy_weights(prox, beh2, m, "sequence", "mask", 0.5, 1.5)
    close(keep, [[0.0, 0.0, 0.0, 1.0]])
    assert outside.tolist() == [[True, True, True, False]]
    close(offpolicy_weights(prox, beh2, m, "sequence", "clamp", 0.5, 1.5)[0], [[1.5] * 4])


# rows: A = 1, 2; mask [[1, 1, 1], [1, 1, 0]]; logprobs = proximal (ratio 1, token loss -A);
# log(proximal / behavior) = [[ln 3, ln .25, 0], [ln 1.5, 0, ln 9 (unmasked)]]
CORR_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
CORR_BEH = -torch.tensor([[LN(3), LN(0.25), 0.0], [LN(1.5), 0.0, LN(9)]])


def _corr(correction):
    cfg = AlgorithmConfig(proximal="recompute", correction=correction)
    lp = torch.zeros(2, 3, requires_grad=True)
    out = policy_loss(lp, torch.zeros(2, 3), torch.tensor([1.0, 2.0]), CORR_MASK, cfg, behavior=CORR_BEH)
    out.loss.backward()
    return out, lp.grad


S15 = math.sqrt(1.5)


@pytest.mark.parametrize(
    "correction,loss,counts,grad",
    [
        # token clamp [.5, 2]: w = [[2, .5, 1], [1.5, 1]] -> 2 clamped; pg = (-(2 + .5 + 1) * 1 - (1.5 + 1) * 2) / 5 = -1.7;
        # d/d log pi = -w A / 5 (the weights carry no gradient)
        (
            {"level": "token", "action": "clamp", "low": 0.5, "high": 2.0},
            -1.7,
            [2, 0, 6.0],
            [[-2 / 5, -0.5 / 5, -1 / 5], [-3 / 5, -2 / 5, 0]],
        ),
        # token mask (icepop) [.5, 2]: 3 and .25 dropped -> pg = (-1 - 1.5 * 2 - 1 * 2) / 5 = -1.2 (masked tokens stay in the count)
        (
            {"level": "token", "action": "mask", "low": 0.5, "high": 2.0},
            -1.2,
            [0, 2, 3.5],
            [[0, 0, -1 / 5], [-3 / 5, -2 / 5, 0]],
        ),
        # sequence mask [.95, 2]: geometric means (3 * .25 * 1)^(1/3) = .90856 -> row 0 masked (3 tokens); sqrt(1.5) = 1.22474 kept
        # pg = -1.22474 * 2 * 2 / 5; weight_sum = 2 * 1.22474
        (
            {"level": "sequence", "action": "mask", "low": 0.95, "high": 2.0},
            -4 * S15 / 5,
            [0, 3, 2 * S15],
            [[0, 0, 0], [-2 * S15 / 5, -2 * S15 / 5, 0]],
        ),
    ],
)
def test_policy_loss_correction_counts(correction, loss, counts, grad):
    out, g = _corr(correction)
    close(out.loss, loss)
    close([out.clamped_tokens, out.masked_tokens, out.weight_sum], counts)
    close(g, grad)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("level,low", [("token", 0.5), ("sequence", 0.95)])
def test_correction_masked_tokens_stay_in_the_default_counts(aggregation, level, low):
    # policy.py: tokens the correction masks are trained with weight 0 and stay in the normalisers, also when the
    # counts are taken from the mask: one call on the whole batch = the sum of its rows with the whole batch's counts
    # (5 tokens, 2 sequences). Hand values: token mask, token-mean -> (-1 - 3 - 2) / 5 = -1.2 (not / 3);
    # sequence mask, seq-mean-token-mean -> (0 + (-2 * 1.22474 * 2) / 2) / 2 = -1.22474 (not / 1 sequence)
    cfg = AlgorithmConfig(
        proximal="recompute",
        correction={"level": level, "action": "mask", "low": low, "high": 2.0},
        aggregation=aggregation,
    )
    args = (torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([1.0, 2.0]), CORR_MASK)
    whole = policy_loss(*args, cfg, behavior=CORR_BEH).loss
    rows = sum(
        policy_loss(*(x[i : i + 1] for x in args), cfg, behavior=CORR_BEH[i : i + 1], num_tokens=5, num_seqs=2).loss
        for i in (0, 1)
    )
    close(whole, rows)
    if (level, aggregation) == ("token", "token-mean"):
        close(whole, -1.2)
    if (level, aggregation) == ("sequence", "seq-mean-token-mean"):
        close(whole, -S15)


def test_policy_loss_correction_needs_behavior():
    cfg = AlgorithmConfig(proximal="recompute", correction={"level": "token"})
    with pytest.raises(ValueError, match="behavior"):
        policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), cfg)


def test_policy_loss_cispo_and_kimi_clip_counts():
    # cispo: ratios 3 and .5 (pi .6, .1 over .2, .2) -> one weight bounded; kimi never clips
    lp, old = torch.tensor([[LN(0.6), LN(0.1)]]), torch.full((1, 2), LN(0.2))
    cispo = policy_loss(
        lp, old, torch.ones(1), torch.ones(1, 2), AlgorithmConfig(loss={"type": "cispo", "clip_eps_high": 1.0})
    )
    close(cispo.loss, (-2 * LN(0.6) - 0.5 * LN(0.1)) / 2)
    close(cispo.clipped_tokens, 1.0)
    close(policy_loss(lp, old, torch.ones(1), torch.ones(1, 2), AlgorithmConfig(preset="kimi")).clipped_tokens, 0.0)


# ----------------------------------------------------------------------------- prepare_rows

GROUPS = torch.tensor([4, 4, 4, 7, 7, 7, 9, 9])
REWARDS = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 3.0, 1.0])  # group 4 all equal
LEN8, NOTRUNC = torch.full((8,), 5), torch.zeros(8, dtype=torch.long)


@pytest.mark.parametrize(
    "adv", [{"type": "grpo"}, {"type": "rloo"}, {"type": "reinforce_pp"}, {"type": "grpo", "std": "batch"}]
)
def test_dynamic_sampling_drops_zero_variance_groups(adv):
    prep = prepare_rows(REWARDS, GROUPS, LEN8, NOTRUNC, AlgorithmConfig(advantage=adv, dynamic_sampling=True), None)
    assert prep.filtered == 3 and prep.truncated_masked == 0
    assert prep.trained_rows.tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    close(prep.advantages[:3], [0.0] * 3)
    close(
        prep.advantages[3:],
        group_advantages(REWARDS[3:], GROUPS[3:], adv["type"], AlgorithmConfig(advantage=adv).advantage.std),
    )


def test_dynamic_sampling_batch_baseline_on_kept_rows_only():
    # reinforce_pp on kept rewards 0, 1, 0, 3, 1: mean 1, centred -1, 0, -1, 2, 0, std sqrt(6 / 4) = 1.224745
    prep = prepare_rows(
        REWARDS, GROUPS, LEN8, NOTRUNC, AlgorithmConfig(preset="reinforce_pp", dynamic_sampling=True), None
    )
    close(prep.advantages, [0, 0, 0, -0.816497, 0, -0.816497, 1.632993, 0])
    # without dynamic sampling the 8 rows count: centred 0, 0, 0, -1, 0, -1, 2, 0, std sqrt(6 / 7) = .92582
    prep = prepare_rows(REWARDS, GROUPS, LEN8, NOTRUNC, AlgorithmConfig(preset="reinforce_pp"), None)
    close(prep.advantages, [0, 0, 0, -1.080123, 0, -1.080123, 2.160247, 0])
    assert prep.filtered == 0 and prep.trained_rows.tolist() == [1.0] * 8


def test_overlong_shaping_changes_which_groups_are_informative():
    # dapo: budget 8, buffer round(.25 * 8) = 2 -> penalty from length 6, -1 at 8
    # group 0: rewards 1, 1, lengths 3, 8 -> shaped 1, 0 (informative); group 1: 1, 0, lengths 8, 2 -> 0, 0 (filtered)
    prep = prepare_rows(
        torch.tensor([1.0, 1.0, 1.0, 0.0]),
        torch.tensor([0, 0, 1, 1]),
        torch.tensor([3, 8, 8, 2]),
        torch.zeros(4),
        AlgorithmConfig(preset="dapo"),
        8,
    )
    assert prep.trained_rows.tolist() == [1.0, 1.0, 0.0, 0.0] and prep.filtered == 2
    close(prep.advantages, [1 / math.sqrt(2), -1 / math.sqrt(2), 0.0, 0.0])
    close(prep.overlong_penalty, -0.5)  # (0 - 1 - 1 + 0) / 4
    with pytest.raises(ValueError, match="max_response_tokens"):
        prepare_rows(
            torch.ones(2),
            torch.zeros(2, dtype=torch.long),
            torch.ones(2),
            torch.zeros(2),
            AlgorithmConfig(preset="dapo"),
            None,
        )


def test_mask_truncated():
    # group 0: 1, 0 -> +-.70711, the truncated second row still counts in the baseline, then is masked
    # group 1: 0, 1 -> -+.70711; group 2: 1, 1 with a truncated row, filtered by dynamic sampling (counted there, not as truncated)
    cfg = AlgorithmConfig(overlong={"mask_truncated": True}, dynamic_sampling=True)
    prep = prepare_rows(
        torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]),
        torch.tensor([0, 0, 1, 1, 2, 2]),
        torch.ones(6),
        torch.tensor([0, 1, 0, 0, 1, 0]),
        cfg,
        None,
    )
    close(prep.advantages, [0.707107, 0.0, -0.707107, 0.707107, 0.0, 0.0])
    assert prep.trained_rows.tolist() == [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    assert (prep.truncated_masked, prep.filtered) == (1, 2)


def test_token_sum_divisor_resolution():
    assert token_sum_divisor(AlgorithmConfig(preset="dr_grpo"), 512) == 512
    assert token_sum_divisor(AlgorithmConfig(aggregation="seq-mean-token-sum", token_sum_divisor=64), 512) == 64
    assert token_sum_divisor(AlgorithmConfig(), 512) == 1
    with pytest.raises(ValueError, match="max_response_tokens"):
        token_sum_divisor(AlgorithmConfig(preset="dr_grpo"), None)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "preset,adv,std,loss,agg,div,extra",
    [
        ("grpo", "grpo", "group", ("ppo_clip", 0.2, 0.2), "token-mean", None, {}),
        ("dr_grpo", "dr_grpo", "none", ("ppo_clip", 0.2, 0.2), "seq-mean-token-sum", "max_tokens", {}),
        ("dapo", "grpo", "group", ("ppo_clip", 0.2, 0.28), "token-mean", None, {"dynamic_sampling": True}),
        ("gspo", "grpo", "group", ("gspo", 3e-4, 4e-4), "seq-mean-token-mean", None, {}),
        ("rloo", "rloo", "none", ("ppo_clip", 0.2, 0.2), "token-mean", None, {}),
        ("reinforce_pp", "reinforce_pp", "batch", ("ppo_clip", 0.2, 0.2), "token-mean", None, {}),
        ("kimi", "dr_grpo", "none", ("kimi",), "token-mean", None, {}),
        ("decoupled_ppo", "grpo", "group", ("ppo_clip", 0.2, 0.2), "token-mean", None, {"proximal": "recompute"}),
    ],
)
def test_presets_expand(preset, adv, std, loss, agg, div, extra):
    c = AlgorithmConfig(preset=preset)
    assert (c.advantage.type, c.advantage.std, c.aggregation, c.token_sum_divisor) == (adv, std, agg, div)
    assert c.loss.type == loss[0]
    if len(loss) > 1:
        assert (c.loss.clip_eps_low, c.loss.clip_eps_high) == loss[1:]
    assert c.dynamic_sampling == extra.get("dynamic_sampling", False)
    assert c.proximal == extra.get("proximal", "behavior")
    assert c.overlong.buffer_fraction == (0.25 if preset == "dapo" else None)
    corr = (
        None if c.correction is None else (c.correction.level, c.correction.action, c.correction.low, c.correction.high)
    )
    assert corr == (("token", "clamp", 0.0, 2.0) if preset == "decoupled_ppo" else None)
    assert c.kl is None


def test_explicit_knobs_override_the_preset():
    c = AlgorithmConfig(preset="dapo", loss={"clip_eps_high": 0.3}, dynamic_sampling=False, overlong={"penalty": 0.5})
    assert (c.loss.type, c.loss.clip_eps_low, c.loss.clip_eps_high) == (
        "ppo_clip",
        0.2,
        0.3,
    )  # same type: merged key by key
    assert not c.dynamic_sampling and (c.overlong.buffer_fraction, c.overlong.penalty) == (0.25, 0.5)
    c = AlgorithmConfig(preset="gspo", loss={"clip_eps_high": 5e-4}, advantage={"type": "grpo", "std": "batch"})
    assert (c.loss.type, c.loss.clip_eps_low, c.loss.clip_eps_high, c.advantage.std) == ("gspo", 3e-4, 5e-4, "batch")


def test_changing_the_loss_type_replaces_the_whole_section():
    c = AlgorithmConfig(preset="dapo", loss={"type": "cispo"})
    assert (c.loss.type, c.loss.clip_eps_low, c.loss.clip_eps_high) == ("cispo", None, 1.0)  # not dapo's .2 / .28
    c = AlgorithmConfig(preset="gspo", loss={"type": "ppo_clip"})
    assert (c.loss.clip_eps_low, c.loss.clip_eps_high) == (0.2, 0.2)  # not gspo's 3e-4 / 4e-4
    c = AlgorithmConfig(preset="kimi", advantage={"type": "grpo"})
    assert (c.advantage.type, c.advantage.std) == ("grpo", "group")


def test_config_refusals():
    with pytest.raises(ValueError, match="proximal"):
        AlgorithmConfig(correction={"level": "token", "action": "mask", "low": 0.5, "high": 2.0})
    with pytest.raises(ValueError, match="proximal"):
        AlgorithmConfig(preset="decoupled_ppo", proximal="behavior")
    with pytest.raises(ValueError, match="token_sum_divisor"):
        AlgorithmConfig(token_sum_divisor=4)
    with pytest.raises(ValueError, match="token_sum_divisor"):
        AlgorithmConfig(aggregation="seq-mean-token-mean", token_sum_divisor="max_tokens")
    with pytest.raises(ValueError, match="preset"):
        AlgorithmConfig(preset="ppo")
    with pytest.raises(ValueError, match="low"):
        AlgorithmConfig(proximal="recompute", correction={"low": 2.0, "high": 1.0})
    c = AlgorithmConfig(
        loss={"type": "cispo", "clip_eps_high": 1.0},
        correction={"level": "token", "action": "mask", "low": 0.5, "high": 2.0},
        proximal="recompute",
    )
    assert (c.loss.type, c.correction.action, c.proximal) == ("cispo", "mask", "recompute")


def test_replacing_a_presets_aggregation_drops_its_divisor():
    # dr_grpo's divisor belongs to its seq-mean-token-sum; a config that picks token-mean gets no divisor
    cfg = AlgorithmConfig(preset="dr_grpo", aggregation="token-mean")
    assert cfg.token_sum_divisor is None and cfg.advantage.type == "dr_grpo"
    with pytest.raises(ValueError, match="token_sum_divisor is set"):  # set by the config itself: refused
        AlgorithmConfig(preset="dr_grpo", aggregation="token-mean", token_sum_divisor=8)
