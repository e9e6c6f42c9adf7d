"""Per-token policy quantities and losses: logprobs, entropy, PPO-clip, GSPO, CISPO, Kimi, off-policy weights, KL, SFT, aggregation.

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

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


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


def chunked_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    input_ids: Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 512,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(logprobs [B, L], entropy [B, L]) of `token_logprobs` / `token_entropy` on the logits
    hidden @ weight.T + bias, without ever holding those logits whole.

    hidden [B, L, H] (the decoder's final hidden states, what the output projection reads),
    weight [V, H] and bias [V] or None (the output projection), input_ids [B, L] long.
    Why: [B, L, V] float32 logits over a large vocabulary (49k: 300 MB at B=16, L=96), with
    their temperature copy, log-softmax and what autograd keeps for backward, dominate a small
    model's training memory. Here positions go `chunk_tokens` at a time through a custom
    autograd function that keeps, per position, only the logsumexp; backward recomputes each
    chunk's logits. Extra memory is O(chunk_tokens x V) plus one [V, H] gradient buffer.
    logprobs carry the gradient (to hidden, weight and bias); entropy has none (a metric).
    mask [B, L] (optional): only positions with mask > 0 are computed, the others hold 0
    (prompt tokens: they are not trained, and skipping them saves their share of the compute).
    """
    b_idx, pos = _predicted_positions(input_ids, mask)  # [N], [N]: token (b, pos) is predicted from position pos-1
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, b_idx * hidden.shape[1] + pos - 1)  # [N, H]
    logp, ent = _ChunkedLinearLogprobs.apply(
        h, weight, bias, input_ids[b_idx, pos], float(temperature), int(chunk_tokens)
    )  # [N], [N]
    return _place(logp, b_idx, pos, input_ids.shape), _place(ent, b_idx, pos, input_ids.shape)


def chunked_head_logprobs(
    hidden: Tensor,
    head: Callable[[Tensor], Tensor],
    input_ids: Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 512,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """`chunked_token_logprobs` with the output projection given as a module (or any callable
    [n, H] -> [n, V]) instead of its weight; each chunk under `torch.utils.checkpoint`.

    Why a second form: a module whose weight is not a plain tensor (DeepSpeed ZeRO-3 partitions
    it and gathers it only inside the module's own forward) must be called, not read. Calling
    it per chunk under checkpoint keeps memory O(chunk_tokens x V) as well: backward re-runs the
    chunk (the module's hooks gather its weight again), at the cost of recomputing the chunk's
    entropy too, which the custom function of `chunked_token_logprobs` avoids.
    """
    b_idx, pos = _predicted_positions(input_ids, mask)  # [N], [N]
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, b_idx * hidden.shape[1] + pos - 1)  # [N, H]
    targets = input_ids[b_idx, pos]  # [N]

    def chunk(h_c: Tensor, t_c: Tensor) -> tuple[Tensor, Tensor]:
        z = head(h_c).float() / temperature  # [c, V]
        picked = z.gather(-1, t_c.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)  # [c]
        with torch.no_grad():
            return picked, _entropy_rows(z.detach())  # [c], [c]

    recompute = torch.is_grad_enabled() and (
        h.requires_grad or any(p.requires_grad for p in getattr(head, "parameters", list)())
    )
    parts = []
    for s in range(0, h.shape[0], chunk_tokens):
        args = (h[s : s + chunk_tokens], targets[s : s + chunk_tokens])
        parts.append(checkpoint(chunk, *args, use_reentrant=False) if recompute else chunk(*args))
    logp = torch.cat([p[0] for p in parts]) if parts else h.new_zeros(0, dtype=torch.float32)  # [N]
    ent = torch.cat([p[1] for p in parts]) if parts else h.new_zeros(0, dtype=torch.float32)  # [N]
    return _place(logp, b_idx, pos, input_ids.shape), _place(ent, b_idx, pos, input_ids.shape)


def _predicted_positions(input_ids: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """(row [N], position [N]) of the tokens that get a logprob: positions 1.. (where mask > 0)."""
    keep = torch.ones_like(input_ids[:, 1:], dtype=torch.bool) if mask is None else mask[:, 1:] > 0  # [B, L-1]
    b_idx, j = keep.nonzero(as_tuple=True)  # [N], [N]
    return b_idx, j + 1


def _place(values: Tensor, b_idx: Tensor, pos: Tensor, shape: torch.Size) -> Tensor:
    """[B, L] float32 zeros holding values [N] at (b_idx, pos); differentiable in `values`."""
    return values.new_zeros(shape, dtype=torch.float32).index_put((b_idx, pos), values)


def _entropy_rows(z: Tensor) -> Tensor:
    """Entropy [n] of softmax(z), z [n, V] float32 (the computation of `token_entropy`)."""
    logp = F.log_softmax(z, dim=-1)  # [n, V]
    return -(logp.exp() * logp).sum(-1)


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    """Float32 logits [c, V] / temperature of one chunk h [c, H]."""
    z = F.linear(h, weight, bias).float()  # [c, V]
    return z.div_(temperature) if temperature != 1.0 else z


class _ChunkedLinearLogprobs(torch.autograd.Function):
    """logprob [N] of targets [N] (and entropy [N], no gradient) under
    softmax((h @ weight.T + bias) / temperature), chunk_tokens rows at a time.

    Saves h, weight, bias, targets and the per-row logsumexp; backward recomputes each chunk's
    logits: d logprob / d z = onehot(target) - softmax(z), then through the linear map.
    """

    @staticmethod
    def forward(
        ctx, h: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float, chunk_tokens: int
    ):  # type: ignore[override]
        n = h.shape[0]
        logp = h.new_empty(n, dtype=torch.float32)  # [N]
        ent = h.new_empty(n, dtype=torch.float32)  # [N]
        lse = h.new_empty(n, dtype=torch.float32)  # [N]
        for s in range(0, n, chunk_tokens):
            e = min(s + chunk_tokens, n)
            z = _chunk_logits(h[s:e], weight, bias, temperature)  # [c, V]
            lse[s:e] = torch.logsumexp(z, dim=-1)
            z.sub_(lse[s:e].unsqueeze(-1))  # [c, V]: log-softmax, in place (one [c, V] tensor, not two)
            logp[s:e] = z.gather(-1, targets[s:e].unsqueeze(-1)).squeeze(-1)
            ent[s:e] = -(z.exp() * z).sum(-1)
        ctx.save_for_backward(h, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp: Tensor, g_ent: Tensor):  # type: ignore[override]
        h, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        t, chunk = ctx.temperature, ctx.chunk_tokens
        g_h = torch.empty_like(h) if need_h else None  # [N, H]
        g_w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        )  # [V, H], float32 sums
        g_b = (
            torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
            if need_b and bias is not None
            else None
        )  # [V]
        for s in range(0, h.shape[0], chunk):
            e = min(s + chunk, h.shape[0])
            g = g_logp[s:e].float().unsqueeze(-1)  # [c, 1]
            p = _chunk_logits(h[s:e], weight, bias, t).sub_(lse[s:e].unsqueeze(-1)).exp_()  # [c, V]: softmax
            gz = p.mul_(-g).scatter_add_(-1, targets[s:e].unsqueeze(-1), g)  # [c, V]: g * (onehot - softmax)
            gz = gz.div_(t).to(h.dtype)  # [c, V]: gradient of the logits before / temperature
            if g_h is not None:
                g_h[s:e] = gz @ weight.to(h.dtype)
            if g_w is not None and gz.dtype == torch.float32:
                g_w.addmm_(gz.t(), h[s:e])  # [V, H], no temporary
            elif g_w is not None:
                g_w.add_(gz.t() @ h[s:e])  # [V, H]: a half-precision product, summed in float32
            if g_b is not None:
                g_b.add_(gz.sum(0))
        return (
            g_h,
            None if g_w is None else g_w.to(weight.dtype),
            None if g_b is None else g_b.to(bias.dtype),
            None,
            None,
            None,
        )


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: Aggregation = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    token_sum_divisor: float = 1.0,
) -> Tensor:
    """Scalar from per-token values [B, L] over mask [B, L].

    token-mean: sum(values * mask) / num_tokens (default: mask.sum()); every token weighs the same.
    seq-mean-token-mean: each sequence's token mean, summed, / num_seqs (default: sequences with
    at least one token); every sequence weighs the same.
    seq-mean-token-sum: each sequence's token sum / token_sum_divisor, summed, / num_seqs (Dr.GRPO:
    a constant divisor, so a token's weight does not depend on its response's length).
    Pass the whole batch's counts when `values` is one micro-batch of it.
    """
    mask = mask.to(values.dtype)
    if mode == "token-mean":
        denom = mask.sum().clamp(min=1.0) if num_tokens is None else max(float(num_tokens), 1.0)
        return (values * mask).sum() / denom
    if mode not in ("seq-mean-token-mean", "seq-mean-token-sum"):
        raise ValueError(
            f"unknown loss aggregation {mode!r}; use token-mean, seq-mean-token-mean or seq-mean-token-sum"
        )
    per_seq_tokens = mask.sum(-1)  # [B]
    per_seq = (values * mask).sum(-1)  # [B]
    per_seq = per_seq / per_seq_tokens.clamp(min=1.0) if mode == "seq-mean-token-mean" else per_seq / token_sum_divisor
    denom = (per_seq_tokens > 0).sum().clamp(min=1).to(values.dtype) if num_seqs is None else max(float(num_seqs), 1.0)
    return per_seq.sum() / denom


def clipped_objective(
    ratio: Tensor, advantages: Tensor, clip_eps_low: float, clip_eps_high: float
) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic objective per token: (loss [B, L], clipped [B, L] bool).

    ratio [B, L] (carries the gradient), advantages [B] or [B, L]:
    loss = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high)); `clipped` marks tokens whose
    gradient the clip removed (the clipped term is the larger).
    """
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages  # [B, 1] or [B, L]
    unclipped = -adv * ratio  # [B, L]
    clipped_obj = -adv * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)  # [B, L]
    return torch.maximum(unclipped, clipped_obj), clipped_obj > unclipped


def ppo_clip_token_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, clip_eps_low: float, clip_eps_high: float
) -> tuple[Tensor, Tensor]:
    """Token-level PPO-clip: `clipped_objective` of r = exp(logprobs - old_logprobs) [B, L]."""
    return clipped_objective(torch.exp(logprobs - old_logprobs), advantages, clip_eps_low, clip_eps_high)


def gspo_token_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, clip_eps_low: float, clip_eps_high: float
) -> tuple[Tensor, Tensor]:
    """GSPO (GSPO-token form): every token of a sequence takes the sequence's ratio
    s = exp(mean over its masked tokens of (logprobs - old_logprobs)), clipped as a whole.

    Per token the ratio is sg(s) * pi_t / sg(pi_t): its value is s, its gradient s * grad log pi_t,
    so with seq-mean-token-mean aggregation the gradient is GSPO's s * A * mean_t grad log pi_t.
    logprobs, old_logprobs, mask [B, L]; advantages [B]. Returns (loss [B, L], clipped [B, L]).
    """
    m = mask.to(logprobs.dtype)
    seq_log_ratio = ((logprobs - old_logprobs) * m).sum(-1) / m.sum(-1).clamp(min=1.0)  # [B]
    ratio = torch.exp(seq_log_ratio.detach().unsqueeze(-1) + logprobs - logprobs.detach())  # [B, L], value s per row
    return clipped_objective(ratio, advantages, clip_eps_low, clip_eps_high)


def cispo_token_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps_low: float | None,
    clip_eps_high: float,
) -> tuple[Tensor, Tensor]:
    """CISPO: loss = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi per token [B, L], and
    where the weight was clipped [B, L] bool. Unlike PPO-clip, no token loses its gradient: the
    clip only bounds the weight. clip_eps_low None: no lower bound."""
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages  # [B, 1] or [B, L]
    r = torch.exp(logprobs - old_logprobs).detach()  # [B, L]
    w = r.clamp(min=0.0 if clip_eps_low is None else 1.0 - clip_eps_low, max=1.0 + clip_eps_high)  # [B, L]
    return -w * adv * logprobs, w != r


def kimi_token_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, tau: float) -> Tensor:
    """Kimi k1.5's objective per token [B, L]: -A * log pi + tau / 2 * (log pi - log pi_old)^2.

    The first term is the policy gradient with the mean-reward baseline (use dr_grpo advantages);
    the second, zero and flat at pi = pi_old, pulls pi back towards pi_old as it moves away.
    """
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages  # [B, 1] or [B, L]
    return -adv * logprobs + 0.5 * tau * (logprobs - old_logprobs) ** 2


def offpolicy_weights(
    proximal: Tensor,
    behavior: Tensor,
    mask: Tensor,
    level: Literal["token", "sequence"],
    action: Literal["clamp", "mask"],
    low: float,
    high: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Off-policy correction of tokens sampled by vLLM (behavior) and trained against the trainer's
    proximal policy: (weight [B, L], keep [B, L] float, outside [B, L] bool), no gradient.

    w = pi_proximal / pi_behavior per token, or per sequence the geometric mean over its masked
    tokens (exp of the mean log ratio), broadcast to its tokens. `outside`: w not in [low, high]
    (on masked tokens only). clamp: weight = clip(w, low, high), keep = 1 (truncated IS);
    mask: weight = w inside, keep = 0 outside (icepop; per sequence: a sequence mask).
    proximal, behavior, mask [B, L].
    """
    m = mask.to(torch.float32)
    log_w = (proximal - behavior).float().detach() * m  # [B, L]
    if level == "sequence":
        log_w = ((log_w.sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)).expand_as(log_w)  # [B, L]
    w = torch.exp(log_w)  # [B, L]
    outside = ((w < low) | (w > high)) & (m > 0)  # [B, L]
    if action == "clamp":
        return w.clamp(low, high), torch.ones_like(m), outside
    if action == "mask":
        return torch.where(outside, torch.zeros_like(w), w), (~outside).to(torch.float32), outside
    raise ValueError(f"unknown correction action {action!r}; use clamp or mask")


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
