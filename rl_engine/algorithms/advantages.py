"""GRPO group-relative advantages: one scalar per experience, from its reward and its group.

An experience's advantage is its reward minus the mean reward of its group (the rollouts of the
same task), divided by the group's standard deviation unless `std_normalize` is off (Dr.GRPO).
The trainer broadcasts the scalar to every response token of the experience.

    adv = grpo_advantages(torch.tensor([1., 0., 1., 1.]), torch.tensor([0, 0, 1, 1]))
    # group 0: mean .5, std .7071 -> [.7071, -.7071]; group 1: std 0 -> [0, 0]
"""

from __future__ import annotations

import torch
from torch import Tensor


def grpo_advantages(rewards: Tensor, group_index: Tensor, std_normalize: bool = True, eps: float = 1e-6) -> Tensor:
    """Advantages [B] of rewards [B] float within groups given by group_index [B] long.

    Group ids may be any integers (not necessarily 0..G-1). The std is the unbiased sample std
    (as in TRL and verl). Edge cases, which must not produce NaN or blow up:
    - a group of size 1 has no peer to compare with: its advantage is 0;
    - a group whose rewards are all equal (std 0) gets 0 for every member: no signal, no noise.
    """
    if rewards.dim() != 1 or group_index.shape != rewards.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_index {tuple(group_index.shape)} must both be [B]")
    rewards = rewards.to(torch.float64)  # float64: means of large rewards stay exact enough
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)  # inverse [B], counts [G]
    num_groups = counts.numel()
    sums = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse, rewards)  # [G]
    means = sums / counts  # [G]
    centred = rewards - means[inverse]  # [B]
    if not std_normalize:
        return centred.to(torch.float32)
    sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse, centred**2)  # [G]
    # Unbiased variance; groups of one get variance 0 (their centred reward is 0 anyway).
    var = sq / (counts - 1).clamp(min=1)  # [G]
    std = var.sqrt()[inverse]  # [B]
    return (centred / (std + eps)).to(torch.float32)
