"""Per-token policy quantities and losses: logprobs, entropy, PPO-clip, KL, SFT, aggregation.

Every [B, L] tensor here is aligned to token positions of prompt+response, the layout of
`ExperienceBatch.to_tensors`: value [b, i] belongs to token input_ids[b, i] predicted from
input_ids[b, :i]; position 0 has no prediction and holds 0. `mask` [B, L] float is 1 on the
tokens that are trained (response tokens, minus any masked out).

Losses are split in two steps, per-token values then `aggregate`, so that the trainer can pass
the token and sequence counts of the *whole* batch when it splits it into micro-batches:
the sum of the micro-batch losses is then exactly the loss of the whole batch (gradient
accumulation gives the same update as one big batch).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

Aggregation = Literal["token-mean", "seq-mean"]


def token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """logprob [B, L] of input_ids[b, i] under logits[b, i-1] / temperature; column 0 is 0.

    logits [B, L, V] (the model's output on input_ids), input_ids [B, L] long.
    """
    logits = logits[:, :-1].float() / temperature  # [B, L-1, V]: position i-1 predicts token i
    targets = input_ids[:, 1:].unsqueeze(-1)  # [B, L-1, 1]
    # logsumexp + gather instead of a full log_softmax keeps one [B, L-1, V] tensor alive, not two.
    picked = logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)  # [B, L-1]
    return F.pad(picked, (1, 0))  # [B, L]


def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy [B, L] of the distribution that predicted token i (column 0 is 0); logits [B, L, V]."""
    logp = F.log_softmax(logits[:, :-1].float() / temperature, dim=-1)  # [B, L-1, V]
    ent = -(logp.exp() * logp).sum(-1)  # [B, L-1]
    return F.pad(ent, (1, 0))  # [B, L]


def aggregate(values: Tensor, mask: Tensor, mode: Aggregation = "token-mean", num_tokens: float | None = None, num_seqs: float | None = None) -> Tensor:
    """Scalar from per-token values [B, L] over mask [B, L].

    token-mean: sum(values * mask) / num_tokens (default: mask.sum()), every token weighs the same.
    seq-mean: each sequence's token mean, summed and divided by num_seqs (default: the number of
    sequences with at least one token), every sequence weighs the same.
    Pass the whole batch's counts when `values` is one micro-batch of it.
    """
    mask = mask.to(values.dtype)
    if mode == "token-mean":
        denom = mask.sum().clamp(min=1.0) if num_tokens is None else max(float(num_tokens), 1.0)
        return (values * mask).sum() / denom
    if mode == "seq-mean":
        per_seq_tokens = mask.sum(-1)  # [B]
        per_seq = (values * mask).sum(-1) / per_seq_tokens.clamp(min=1.0)  # [B]
        denom = (per_seq_tokens > 0).sum().clamp(min=1).to(values.dtype) if num_seqs is None else max(float(num_seqs), 1.0)
        return per_seq.sum() / denom
    raise ValueError(f"unknown loss aggregation {mode!r}; use 'token-mean' or 'seq-mean'")


def ppo_clip_token_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, clip_eps_low: float, clip_eps_high: float) -> tuple[Tensor, Tensor]:
    """PPO-clip loss per token and where the clip is active.

    logprobs, old_logprobs [B, L] (current policy, and the policy that the ratio divides by);
    advantages [B] (one per sequence) or [B, L]. Returns (loss [B, L], clipped [B, L] bool):
    loss = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high)) with r = exp(logprobs - old).
    `clipped` marks tokens whose gradient the clip removed (the second term is the larger).
    """
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages  # [B, 1] or [B, L]
    ratio = torch.exp(logprobs - old_logprobs)  # [B, L]
    unclipped = -adv * ratio  # [B, L]
    clipped_obj = -adv * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)  # [B, L]
    return torch.maximum(unclipped, clipped_obj), clipped_obj > unclipped


def kl_token(logprobs: Tensor, ref_logprobs: Tensor, estimator: Literal["k1", "k3"] = "k3") -> Tensor:
    """Per-token estimate [B, L] of KL(policy || reference) from sampled tokens' logprobs [B, L].

    k1 = log p - log q (unbiased, can be negative); k3 = q/p - 1 - log(q/p) (unbiased, >= 0,
    lower variance), Schulman's estimators with samples drawn from p.
    """
    log_ratio = logprobs - ref_logprobs  # [B, L], log p/q
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; use 'k1' or 'k3'")


def version_mask(versions: Tensor, trainer_version: int, max_version_gap: int | None) -> Tensor:
    """1.0 [B, L] where a token may be trained: its generating version (versions [B, L] long,
    -1 outside responses) is at most `max_version_gap` behind `trainer_version`; None keeps all.
    """
    if max_version_gap is None:
        return torch.ones_like(versions, dtype=torch.float32)
    return ((trainer_version - versions) <= max_version_gap).to(torch.float32)


def sft_loss(logprobs: Tensor, mask: Tensor, num_tokens: float | None = None) -> Tensor:
    """Cross-entropy (negative log-likelihood) of the masked tokens, token-mean; logprobs, mask [B, L]."""
    return aggregate(-logprobs, mask, "token-mean", num_tokens=num_tokens)
