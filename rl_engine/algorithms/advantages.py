"""Advantages (one scalar per experience, from its reward and its group) and the reward-side knobs
that come before them: overlong shaping and dynamic sampling's zero-variance filter.

An estimator is one registered function `(rewards [B], group_index [B], **params) -> [B]`
(rl_engine.registry.ESTIMATORS; a user's registers with `rl_engine.api.register_estimator`).
The built-ins are a baseline and a scale. Baselines: the group's mean (grpo, dr_grpo), the mean of
the group's other members (rloo), the batch's mean (reinforce_pp). Scales (`std`): the group's
std, the whole batch's std (of the centred rewards), or none. The trainer broadcasts each scalar
to every response token of its experience.

    adv = group_advantages(torch.tensor([1., 0., 1., 1.]), torch.tensor([0, 0, 1, 1]), "grpo", "group")
    # group 0: mean .5, std .7071 -> [.7071, -.7071]; group 1: std 0 -> [0, 0]
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from rl_engine.registry import ESTIMATORS

StdLevel = Literal["group", "batch", "none"]


def group_advantages(
    rewards: Tensor, group_index: Tensor, estimator: str = "grpo", std: StdLevel = "group", eps: float = 1e-6
) -> Tensor:
    """Advantages [B] float32 of rewards [B] within groups given by group_index [B] long, by the
    registered estimator named `estimator` (rl_engine.registry.ESTIMATORS).

    Group ids may be any integers. Stds are unbiased sample stds (as in TRL and verl). Edge cases,
    which must not produce NaN or blow up:
    - group baselines: a group of size 1 has no peer to compare with: its advantage is 0;
    - std "group": a group whose rewards are all equal (std 0) gets 0 for every member (with a
      group baseline its centred rewards are 0 anyway; with the batch baseline there is no scale);
    - std "batch": a batch whose centred rewards are all equal gets 0.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(ESTIMATORS.unknown(estimator))
    return ESTIMATORS.get(estimator)(rewards, group_index, std=std, eps=eps)


def grpo_advantages(rewards: Tensor, group_index: Tensor, std: StdLevel = "group", eps: float = 1e-6) -> Tensor:
    """GRPO: reward minus its group's mean [B], scaled as `std` says."""
    g = _Groups(rewards, group_index)
    return _scaled(g, g.r - g.mean, std, eps)


def dr_grpo_advantages(rewards: Tensor, group_index: Tensor, std: StdLevel = "none", eps: float = 1e-6) -> Tensor:
    """Dr.GRPO: GRPO's baseline; no std by default (pair it with a constant loss normaliser)."""
    return grpo_advantages(rewards, group_index, std, eps)


def rloo_advantages(rewards: Tensor, group_index: Tensor, std: StdLevel = "none", eps: float = 1e-6) -> Tensor:
    """RLOO: reward minus the mean of the other members of its group (a group of one: 0)."""
    g = _Groups(rewards, group_index)
    # r_i - (S - r_i) / (n - 1) = n / (n - 1) * (r_i - mean): the other members' mean
    n = g.n
    centred = torch.where(n > 1, g.r - (g.sums[g.inverse] - g.r) / (n - 1).clamp(min=1), torch.zeros_like(g.r))  # [B]
    return _scaled(g, centred, std, eps)


def reinforce_pp_advantages(rewards: Tensor, group_index: Tensor, std: StdLevel = "batch", eps: float = 1e-6) -> Tensor:
    """REINFORCE++: reward minus the whole batch's mean reward, whitened over the batch by default."""
    g = _Groups(rewards, group_index)
    return _scaled(g, g.r - g.r.mean(), std, eps)


class _Groups:
    """Per-experience group statistics of rewards [B] (float64: means of large rewards stay exact)."""

    def __init__(self, rewards: Tensor, group_index: Tensor):
        if rewards.dim() != 1 or group_index.shape != rewards.shape:
            raise ValueError(
                f"rewards {tuple(rewards.shape)} and group_index {tuple(group_index.shape)} must both be [B]"
            )
        self.r = rewards.to(torch.float64)  # [B]
        _, self.inverse, self.counts = torch.unique(group_index, return_inverse=True, return_counts=True)  # [B], [G]
        self.sums = torch.zeros(self.counts.numel(), dtype=torch.float64).index_add_(0, self.inverse, self.r)  # [G]
        self.n = self.counts[self.inverse].to(torch.float64)  # [B]: size of each experience's group
        self.mean = (self.sums / self.counts)[self.inverse]  # [B]


def _scaled(g: _Groups, centred: Tensor, std: str, eps: float) -> Tensor:
    """centred [B] divided by the std of its group, of the batch, or nothing; float32 [B]."""
    if std == "none":
        return centred.to(torch.float32)
    if std == "batch":
        s = centred.std() if centred.numel() > 1 else centred.new_zeros(())
        return (centred / (s + eps) if s > 0 else torch.zeros_like(centred)).to(torch.float32)
    if std != "group":
        raise ValueError(f"unknown std level {std!r}; use group, batch or none")
    sq = torch.zeros(g.counts.numel(), dtype=torch.float64).index_add_(0, g.inverse, (g.r - g.mean) ** 2)  # [G]
    group_std = (sq / (g.counts - 1).clamp(min=1)).sqrt()[g.inverse]  # [B]; groups of one: 0
    return torch.where(group_std > 0, centred / (group_std + eps), torch.zeros_like(centred)).to(torch.float32)


def informative_rows(rewards: Tensor, group_index: Tensor) -> Tensor:
    """[B] bool: True for members of groups whose rewards are not all equal (dynamic sampling keeps
    these). A group of one is never informative: it has nothing to be compared with."""
    _, inverse = torch.unique(group_index, return_inverse=True)  # [B]
    g = int(inverse.max()) + 1 if inverse.numel() else 0
    r = rewards.to(torch.float64)
    lo = torch.full((g,), float("inf"), dtype=torch.float64).scatter_reduce(0, inverse, r, "amin")  # [G]
    hi = torch.full((g,), float("-inf"), dtype=torch.float64).scatter_reduce(0, inverse, r, "amax")  # [G]
    return (hi > lo)[inverse]


def overlong_penalty(response_len: Tensor, max_tokens: int, buffer_tokens: int, penalty: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment [B] float32 (<= 0, added to the reward) of response lengths [B].

    0 up to max_tokens - buffer_tokens, then falling linearly to -penalty at max_tokens (and below
    it further, never: a response cannot be longer than its budget).
    """
    start = max_tokens - buffer_tokens
    over = (response_len.to(torch.float32) - start).clamp(min=0.0, max=float(buffer_tokens))  # [B]
    return -penalty * over / max(buffer_tokens, 1)
