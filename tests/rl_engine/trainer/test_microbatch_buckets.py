"""Micro-batches bucketed by length (rl_engine/trainer/buckets.py): the plan by hand, and a trainer
that runs no padding computes what the padded batch computes.

tests/rl_engine/trainer/test_reference_step.py holds the bucketed step against the reference's
padded one (ragged rows, an environment span masked out, every loss type, 1 and 4 micro-batches).
"""

from __future__ import annotations

import pytest
import torch
from trainer_helpers import make_batch, make_cfg

from rl_engine.trainer import build_trainer, trainer_settings
from rl_engine.trainer.buckets import micro_batches, positions, take


def _attention(lengths: list[int], width: int) -> torch.Tensor:
    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()  # [B, L]


def test_rows_sorted_longest_first_each_trimmed_to_its_longest():
    am = _attention([3, 9, 5, 9, 2], width=9)
    mbs = micro_batches(am, 2)
    assert [mb.rows.tolist() for mb in mbs] == [[1, 3], [2, 0], [4]]  # ties keep their order
    assert [mb.length for mb in mbs] == [9, 5, 2]
    assert positions(mbs) == 2 * 9 + 2 * 5 + 2  # against 5 x 9 padded
    assert positions(micro_batches(am, 1)) == int(am.sum())  # one row each: no padding at all
    [whole] = micro_batches(am, 5)  # one micro-batch: the padded batch, its rows in their order
    assert whole.rows.tolist() == [0, 1, 2, 3, 4] and whole.length == 9 and positions([whole]) == am.numel()


def test_a_groups_rows_stay_together_longest_group_first():
    """With the rows' groups (the trainer runs a group's shared prompt once per micro-batch): groups
    ordered by their longest row, each group's rows longest first, then cut as before."""
    am = _attention([3, 9, 5, 4, 6, 2], width=9)
    group = torch.tensor([7, 7, 7, 3, 3, 3])  # group 7 holds the longest row
    mbs = micro_batches(am, 2, group)
    assert [mb.rows.tolist() for mb in mbs] == [[1, 2], [0, 4], [3, 5]]
    assert [mb.length for mb in mbs] == [9, 6, 4]
    assert [mb.rows.tolist() for mb in micro_batches(am, 3, group)] == [[1, 2, 0], [4, 3, 5]]  # whole groups
    [whole] = micro_batches(am, 6, group)  # one micro-batch: as it is
    assert whole.rows.tolist() == [0, 1, 2, 3, 4, 5]


def test_take_trims_position_tensors_and_keeps_row_tensors():
    am = _attention([3, 9, 5], width=9)
    b = {"attention_mask": am, "ids": torch.arange(27).view(3, 9), "rewards": torch.tensor([0.0, 1.0, 2.0])}
    b["scalar"] = torch.tensor(7.0)  # not per row: left out
    second = micro_batches(am, 2)[1]  # row 0 alone, length 3
    mb = take(b, second)
    assert set(mb) == {"attention_mask", "ids", "rewards"}
    assert mb["ids"].tolist() == [[0, 1, 2]] and mb["rewards"].tolist() == [0.0]
    assert mb["attention_mask"].tolist() == [[1, 1, 1]]


@pytest.mark.slow
def test_no_padding_computes_what_padding_computes(tiny_model_dir):
    """One row per micro-batch (each at its own length: no padding run) against one micro-batch of
    the whole padded batch: the same logprobs on every real position, the same loss, metrics and
    updated weights (1e-5; Adam's first step as in test_trainer_steps), and `positions` counts
    what each ran."""
    lens = (5, 3, 2, 1)
    runs = {}
    for micro in (1, 4):
        tr = build_trainer(trainer_settings(make_cfg(tiny_model_dir, trainer={"micro_batch_size": micro})))
        batch = make_batch(tr, response_lens=lens)
        noise = torch.randn(batch["loss_mask"].shape, generator=torch.Generator().manual_seed(5))
        batch["behavior_logprobs"] -= 0.3 * noise.abs() * batch["loss_mask"]  # ratios off 1, some clipped
        logprobs = tr.compute_logprobs(batch)  # [B, L]
        metrics = tr.train_step(batch)
        runs[micro] = (batch, logprobs, metrics, {k: v.detach().clone() for k, v in tr.named_weights()})
    (batch, lp1, m1, w1), (_, lp4, m4, w4) = runs[1], runs[4]
    real = batch["attention_mask"] > 0  # [B, L]
    torch.testing.assert_close(lp1[real], lp4[real], rtol=1e-5, atol=1e-6)
    assert torch.all(lp1[~real] == 0)  # a row alone runs none of its padding
    assert m4["clip_frac"] > 0
    for key in ("loss", "pg_loss", "entropy", "clip_frac", "approx_kl", "grad_norm"):
        assert m1[key] == pytest.approx(m4[key], rel=1e-5, abs=1e-7), key
    for name in w4:
        torch.testing.assert_close(w1[name], w4[name], rtol=1e-5, atol=1e-4)
    assert m1["attended"] == m4["attended"] == int(batch["attention_mask"].sum())
    assert m1["positions"] == m1["attended"] and m4["positions"] == batch["attention_mask"].numel()
