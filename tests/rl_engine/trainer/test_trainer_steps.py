"""Trainer steps against hand-computed values: GRPO loss, SFT loss, accumulation, masking.

With behavior logprobs equal to the trainer's own, every ratio is 1, so the token-mean loss is
-sum_b A_b n_b / N (n_b trained tokens of row b). Rewards (1, 0 | 1, 0) in groups (0, 0 | 1, 1)
give A = (+a, -a, +a, -a) with a = .5 / std(1, 0) = .5 / .70711 = .70711, and response lengths
(5, 3, 5, 3) give -(a*5 - a*3 + a*5 - a*3) / 16 = -a / 4 = -.17678.

    .venv/bin/python -m pytest tests/rl_engine/trainer/test_trainer_steps.py -q
"""

from __future__ import annotations

import math

import pytest
import torch
from trainer_helpers import make_batch, make_cfg

from rl_engine.trainer import build_trainer, trainer_settings

pytestmark = pytest.mark.slow
A = 0.5 / math.sqrt(0.5)  # GRPO advantage magnitude of rewards (1, 0)
HAND_LOSS = -A / 4


def weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.named_weights()}


def test_grpo_step_hand_computed_changes_weights_and_lowers_loss(shared_trainer):
    tr = shared_trainer
    batch = make_batch(tr)  # behavior = current policy: ratio 1
    before, v0 = weights(tr), tr.version
    m1 = tr.train_step(batch)
    assert m1["loss"] == pytest.approx(HAND_LOSS, abs=1e-5)
    assert m1["pg_loss"] == pytest.approx(HAND_LOSS, abs=1e-5)
    assert m1["clip_frac"] == 0.0 and m1["approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert m1["logprob_diff"] == pytest.approx(0.0, abs=1e-6)
    assert m1["tokens"] == 16 and m1["lr"] == pytest.approx(1e-3) and m1["grad_norm"] > 0
    # micro-batches by length: rows 0 and 2 at 4 + 5 positions, rows 1 and 3 at 4 + 3 (4 x 9 padded)
    assert m1["positions"] == 2 * 9 + 2 * 7 and m1["attended"] == 4 * 4 + 16  # prompts + responses
    assert tr.version == v0 + 1 and m1["version"] == v0 + 1
    after = weights(tr)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before), f"unchanged: {set(before) - set(changed)}"
    m2 = tr.train_step(batch)  # the same batch, scored by the updated policy
    assert m2["loss"] < m1["loss"] - 0.05
    assert m2["approx_kl"] > 0 and m2["logprob_diff"] > 0


def test_entropy_metric_matches_the_model(shared_trainer):
    tr = shared_trainer
    batch = make_batch(tr, seed=3)
    with torch.no_grad():
        logits = tr.engine.module(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits  # [B, L, V]
    logp = torch.log_softmax(logits[:, :-1], -1)  # [B, L-1, V]
    ent = -(logp.exp() * logp).sum(-1)  # [B, L-1]
    mask = batch["loss_mask"][:, 1:]
    expected = float((ent * mask).sum() / mask.sum())
    assert tr.train_step(batch)["entropy"] == pytest.approx(expected, rel=1e-5)


def test_sft_step_hand_computed_and_lowers_loss(shared_trainer):
    tr = shared_trainer
    batch = make_batch(seed=1)
    lp = tr.compute_logprobs(batch)  # [B, L], temperature 1
    nll = float(-(lp * batch["loss_mask"]).sum() / batch["loss_mask"].sum())
    m1 = tr.sft_step(batch)
    assert m1["loss"] == pytest.approx(nll, rel=1e-5)
    m2 = tr.sft_step(batch)
    assert m2["loss"] < m1["loss"]


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_grad_accumulation_equals_one_big_micro_batch(tiny_model_dir, loss_agg):
    # Response lengths (5, 3 | 2, 1): the two micro-batches hold 8 and 3 tokens, so normalising
    # each micro-batch by its own count would give a different update than one batch of 4.
    algo = {"aggregation": loss_agg, "kl": {"coef": 0.1, "estimator": "k3"}}
    results = []
    for micro in (2, 4):
        tr = build_trainer(
            trainer_settings(make_cfg(tiny_model_dir, algorithm=algo, trainer={"micro_batch_size": micro}))
        )
        batch = make_batch(tr, response_lens=(5, 3, 2, 1))
        noise = torch.randn(batch["loss_mask"].shape, generator=torch.Generator().manual_seed(5))
        batch["behavior_logprobs"] -= 0.3 * noise.abs() * batch["loss_mask"]  # ratios > 1, some clipped
        tr.train_step(batch)  # the first step moves the policy, then the KL term is non-zero
        metrics = tr.train_step(batch)
        results.append((metrics, weights(tr)))
    (m2, w2), (m4, w4) = results
    assert m4["clip_frac"] > 0 and m4["kl"] > 0
    for key in ("pg_loss", "kl", "entropy", "clip_frac", "approx_kl", "grad_norm"):
        assert m2[key] == pytest.approx(m4[key], rel=1e-5, abs=1e-7), key
    # The loss is pg_loss + 0.1 kl, which nearly cancel with seq-mean-token-mean (-0.1414 + 0.1372
    # = -0.0043): its error is its parts' (1e-5 of them), not 1e-5 of the small difference.
    assert m2["loss"] == pytest.approx(m4["loss"], abs=1e-5 * (abs(m4["pg_loss"]) + 0.1 * abs(m4["kl"])))
    # Adam divides by sqrt(v): where a gradient entry is ~0, fp32 summation-order noise moves
    # the update by a visible fraction of lr (1e-3). The head runs on each micro-batch's trained
    # positions only, so the two splits multiply differently shaped matrices, and step 2 starts
    # from step 1's noise: up to 1.9e-5 seen on one machine, 4.0e-5 on another (AMD EPYC), on a
    # few of 8192 entries; 1e-4 = 10% of one update step (a wrong gradient moves whole rows by ~lr,
    # and shifts the metrics above by far more than their tolerance).
    for name in w4:
        torch.testing.assert_close(w2[name], w4[name], rtol=1e-5, atol=1e-4)


def test_recompute_old_logprobs_and_version_gap_mask(tiny_model_dir):
    cfg = make_cfg(tiny_model_dir, algorithm={"proximal": "recompute", "max_version_gap": 0})
    tr = build_trainer(trainer_settings(cfg))
    batch = make_batch()  # behavior logprobs all 0: far from the policy's, ignored by "recompute"
    m1 = tr.train_step(batch)
    assert m1["loss"] == pytest.approx(HAND_LOSS, abs=1e-5) and m1["clip_frac"] == 0.0
    assert m1["logprob_diff"] > 1.0 and m1["masked_stale_tokens"] == 0
    # Now at version 1: rows 0-1 come from version 0 (gap 1 > 0, masked), rows 2-3 from version 1.
    batch["versions"][2:] = torch.where(batch["loss_mask"][2:] > 0, 1, -1)
    m2 = tr.train_step(batch)
    assert m2["masked_stale_tokens"] == 8 and m2["tokens"] == 8
    assert m2["loss"] == pytest.approx(-(A * 5 - A * 3) / 8, abs=1e-5)


def test_compute_logprobs_uses_sampling_temperature(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    tr = build_trainer(trainer_settings(make_cfg(tiny_model_dir, explorer={"sampling": {"temperature": 0.7}})))
    batch = make_batch(seed=2)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # [B, L, V]
    expected = torch.log_softmax(logits[:, :-1] / 0.7, -1).gather(-1, batch["input_ids"][:, 1:, None])[
        ..., 0
    ]  # [B, L-1]
    got = tr.compute_logprobs(batch)
    assert got.shape == batch["input_ids"].shape and torch.all(got[:, 0] == 0)
    real = batch["attention_mask"][:, 1:] > 0  # [B, L-1]; padding past a row's micro-batch is not run
    torch.testing.assert_close(got[:, 1:][real], expected[real], rtol=1e-5, atol=1e-5)


def test_wrong_batch_rows(shared_trainer):
    with pytest.raises(ValueError, match="train batch has 2 rows; this rank trains 4"):
        shared_trainer.train_step(make_batch(rows=2, response_lens=(2, 2)))


def test_decoupled_ppo_dynamic_sampling_and_correction_counts(tiny_model_dir):
    # One trainer, the knobs the run-level code adds around the loss:
    # dynamic sampling: rewards (1, 0 | 1, 1): group 1 has no variance, so only rows 0-1 are trained
    # and the token-mean divides by their 8 tokens: -(A*5 - A*3) / 8.
    # correction (token, clamp, [0.5, 2]) of proximal (recomputed = current) vs behavior: behavior
    # is the policy's own minus 1 on the first 2 response tokens of row 0 (w = e > 2: clamped to 2)
    # and plus 1 on row 1's first token (w = 1/e < .5: clamped to .5); the ratio to the proximal
    # policy is 1, so every token's loss is -A and the weights scale it:
    # row 0: -A (2 + 2 + 1 + 1 + 1) = -7A; row 1: +A (.5 + 1 + 1) = 2.5A -> (-7A + 2.5A) / 8.
    cfg = make_cfg(
        tiny_model_dir,
        algorithm={
            "proximal": "recompute",
            "dynamic_sampling": True,
            "correction": {"level": "token", "action": "clamp", "low": 0.5, "high": 2.0},
        },
    )
    tr = build_trainer(trainer_settings(cfg))
    batch = make_batch(tr)
    batch["rewards"] = torch.tensor([1.0, 0.0, 1.0, 1.0])
    start = 4  # prompt_len: the first response token
    batch["behavior_logprobs"][0, start : start + 2] -= 1.0
    batch["behavior_logprobs"][1, start] += 1.0
    m = tr.train_step(batch)
    assert m["filtered_experiences"] == 2 and m["tokens"] == 8
    assert m["loss"] == pytest.approx((-7 * A + 2.5 * A) / 8, abs=1e-5)
    assert m["offpolicy_clamped_frac"] == pytest.approx(3 / 8) and m["offpolicy_masked_frac"] == 0.0
    assert m["is_weight_mean"] == pytest.approx((2 + 2 + 1 + 1 + 1 + 0.5 + 1 + 1) / 8, abs=1e-6)
