"""The policy objective of one (micro-)batch, as `AlgorithmConfig`'s knobs combine it.

    loss = aggregate(w * token_loss(pi, pi_proximal, A), mask) + kl.coef * aggregate(keep * KL, mask)

token_loss: the registered loss `cfg.loss` names (ppo_clip | gspo | cispo | kimi | a plugin's) against the proximal policy (vLLM's behavior logprobs,
or the trainer's own recomputed before the update); w and keep: the off-policy correction of
proximal vs behavior (1 without one). The caller has already removed from `mask` what is not
trained at all (stale versions, dynamic sampling's filtered groups, truncated responses), and
counts normalisers from it; tokens the correction masks stay in those counts (they are trained
with weight 0), so gradient accumulation still sums to the whole batch's loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rl_engine.algorithms.losses import aggregate, kl_token, offpolicy_weights
from rl_engine.config import AlgorithmConfig
from rl_engine.errors import UserError
from rl_engine.registry import LOSSES


@dataclass
class PolicyLoss:
    """The loss to back-propagate and its parts (scalars; the *_tokens are counts over the mask)."""

    loss: Tensor
    pg_loss: Tensor
    kl: Tensor | None
    clipped_tokens: Tensor  # the loss's own clip removed (ppo_clip, gspo) or bounded (cispo) their gradient
    clamped_tokens: Tensor  # the correction clamped their weight
    masked_tokens: Tensor  # the correction dropped them
    weight_sum: Tensor  # sum of the correction's weights (their mean is this / tokens)


def policy_loss(
    logprobs: Tensor,
    proximal: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: AlgorithmConfig,
    behavior: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    token_sum_divisor: float = 1.0,
) -> PolicyLoss:
    """The objective over mask [B, L].

    logprobs [B, L] (with grad), proximal [B, L] (the ratio's denominator), advantages [B],
    behavior [B, L] (vLLM's logprobs; required when cfg.correction is set), ref_logprobs [B, L]
    (required when cfg.kl is set). num_tokens / num_seqs: the whole batch's counts when this is one
    micro-batch (see `aggregate`); token_sum_divisor: seq-mean-token-sum's constant, resolved.
    """
    m = mask.to(torch.float32)
    weight, keep = torch.ones_like(m), torch.ones_like(m)  # [B, L] x 2
    clamped = masked = torch.zeros((), dtype=torch.float32)
    if cfg.correction is not None:
        if behavior is None:
            raise ValueError("algorithm.correction is set but no behavior logprobs were given")
        c = cfg.correction
        weight, keep, outside = offpolicy_weights(proximal, behavior, m, c.level, c.action, c.low, c.high)
        if c.action == "clamp":
            clamped = (outside.float() * m).sum()
        else:
            masked = (outside.float() * m).sum()
    token_loss, clipped = _token_loss(logprobs, proximal, advantages, m, cfg)  # [B, L] x 2
    # Aggregated over m, not m * keep: a masked token weighs 0 but stays in every normaliser,
    # whether the counts are passed in or taken from this mask.
    pg = aggregate(weight * token_loss, m, cfg.aggregation, num_tokens, num_seqs, token_sum_divisor)
    trained = m * keep  # [B, L]
    kl, loss = None, pg
    if cfg.kl is not None:
        if ref_logprobs is None:
            raise ValueError("algorithm.kl is set but no reference logprobs were given")
        kl = aggregate(
            keep * kl_token(logprobs, ref_logprobs, cfg.kl.estimator),
            m,
            cfg.aggregation,
            num_tokens,
            num_seqs,
            token_sum_divisor,
        )
        loss = pg + cfg.kl.coef * kl
    return PolicyLoss(
        loss=loss,
        pg_loss=pg.detach(),
        kl=None if kl is None else kl.detach(),
        clipped_tokens=(clipped.float() * trained).sum().detach(),
        clamped_tokens=clamped,
        masked_tokens=masked,
        weight_sum=(weight * m).sum(),
    )


def _token_loss(
    logprobs: Tensor, proximal: Tensor, advantages: Tensor, mask: Tensor, cfg: AlgorithmConfig
) -> tuple[Tensor, Tensor]:
    """(per-token loss [B, L], clipped [B, L] bool) of the configured policy loss; a loss that
    returns only the loss clipped nothing."""
    out = LOSSES.build(cfg.loss)(logprobs, proximal, advantages, mask)
    loss, clipped = out if isinstance(out, tuple) else (out, torch.zeros_like(out, dtype=torch.bool))
    if not isinstance(loss, torch.Tensor) or loss.shape != logprobs.shape:
        raise UserError(
            f"algorithm.loss {cfg.loss.type!r} returned {getattr(loss, 'shape', type(loss).__name__)}; "
            f"a policy loss returns one value per token, shape {tuple(logprobs.shape)} (rl_engine.api.PolicyLoss)"
        )
    return loss, clipped
