"""Micro-batches bucketed by length: what the trainer runs of a right-padded `[B, L]` batch.

A batch is padded to its longest row; cut into micro-batches as it comes, every micro-batch runs
all L positions, and short rows pay for the long ones (on the real model's demo, 10% of a step's
positions were padding). Instead the rows are sorted by length, longest first (a step's peak
memory shows in its first micro-batch), cut `size` at a time, and each micro-batch is trimmed to
its own longest row. Rows are right-padded (`ExperienceBatch.to_tensors`) and attention is
causal, so what a row's real positions compute does not change; every loss is normalised by
whole-batch counts, so the update is the same up to summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class MicroBatch:
    rows: Tensor  # [b] long: row indices into the batch
    length: int  # positions this micro-batch runs: its longest row


def micro_batches(attention: Tensor, size: int, group: Tensor | None = None) -> list[MicroBatch]:
    """The micro-batches of a batch whose real tokens are `attention` [B, L] (1s then 0s per row).
    A batch of one micro-batch runs as it is: sorting it saves nothing, and it keeps the order of
    the loss's sums, so a seeded run of one micro-batch a step (the demo's SFT warm start) stays
    bit for bit what it was. With `group` [B] (the rows' groups, whose prompts the trainer runs
    once per micro-batch: rl_engine.trainer.prefix) a group's rows stay together: groups longest
    first, each group's rows longest first."""
    lengths = attention.sum(-1)  # [B]
    if len(lengths) <= size:
        order = torch.arange(len(lengths), device=lengths.device)  # [B]
    else:
        order = torch.argsort(lengths, descending=True, stable=True)  # [B]
        if group is not None:
            local = torch.unique(group, return_inverse=True)[1]  # [B]
            longest = torch.zeros(int(local.max()) + 1, dtype=lengths.dtype, device=lengths.device)
            longest = longest.scatter_reduce(0, local, lengths, reduce="amax")  # [G]
            order = order[torch.argsort(local[order], stable=True)]  # by group, longest row first within
            order = order[torch.argsort(longest[local[order]], descending=True, stable=True)]  # longest group first
    return [
        MicroBatch(rows, int(lengths[rows].max())) for rows in (order[i : i + size] for i in range(0, len(order), size))
    ]


def take(tensors: dict[str, Tensor], mb: MicroBatch) -> dict[str, Tensor]:
    """The rows of `mb` of every per-row tensor in `tensors` (first dimension the batch's rows, as
    its `attention_mask` [B, L]), position tensors (second dimension L) trimmed to `mb.length`."""
    n, length = tensors["attention_mask"].shape
    out = {}
    for k, v in tensors.items():
        if v.dim() >= 1 and v.shape[0] == n:
            v = v[mb.rows]
            out[k] = v[:, : mb.length] if v.dim() >= 2 and v.shape[1] == length else v
    return out


def positions(mbs: list[MicroBatch]) -> int:
    """Positions the micro-batches run: rows x trimmed length, summed."""
    return sum(len(mb.rows) * mb.length for mb in mbs)
