"""A reference GRPO step, written from the published definitions in plain PyTorch: the yardstick
rft's trainer is checked against (tests/rl_engine/trainer/test_reference_step.py) and bench.peer's
reference loop trains with (bench/reference_loop.py).

Written from the papers and TRL's GRPOTrainer documentation, not from rl_engine.algorithms (only
the config's knob values are read from rft): no DeepSpeed, no chunked output head, no vLLM.

- logprobs: log_softmax(logits / temperature) of the full [B, L, V] logits, gathered at each
  token; value [b, i] belongs to token i, predicted from position i-1 (rft's batch layout).
- advantages (GRPO, Shao et al. 2024): (r - mean of the group) / (unbiased std of the group + eps);
  a group whose rewards are all equal gets 0. Dr.GRPO (Liu et al. 2025): no std. Group mean and
  batch std ("Tricks or Traps?", 2025: Lite PPO): the centred rewards over their std across the batch.
- ppo_clip (PPO; DAPO's clip-higher eps_low / eps_high): -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A),
  r = pi / pi_old per token, pi_old the generating policy's logprobs.
- gspo (Zheng et al. 2025, GSPO-token): every token of sequence i takes the sequence ratio
  s_i = exp(mean over its tokens of log(pi / pi_old)) as its value and s_i grad log pi_t as its
  gradient (s_i,t = sg[s_i] pi_t / sg[pi_t]), clipped as PPO clips r.
- cispo (MiniMax-M1, 2025): -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi; no lower bound when
  eps_low is unset. No token loses its gradient.
- kimi (Kimi k1.5, 2025): -A log pi + tau / 2 (log pi - log pi_old)^2 per token.
- aggregation: token-mean (DAPO's, TRL's loss_type "dapo"): sum over every trained token of the
  batch / their number; seq-mean-token-mean; seq-mean-token-sum / a constant (Dr.GRPO). With
  micro-batches each one's sum is divided by the whole batch's count (TRL's num_items_in_batch).
- the update: fused torch AdamW (transformers' default; the config's betas, weight decay), global-norm gradient clipping, the
  config's linear warm-up: step t (1-based) at lr * min(1, t / warmup_steps).

    ref = ReferenceTrainer(model, RefAlgo.from_config(cfg), lr=..., warmup_steps=..., grad_clip=...)
    out = ref.step(batch, micro_batch_size=8)   # {"loss", "grad_norm", "clip_frac", "lr"}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

LOSSES = ("ppo_clip", "gspo", "cispo", "kimi")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@dataclass(frozen=True)
class RefAlgo:
    """The knob values the reference takes from rft's config (the same values, its own code)."""

    loss: str = "ppo_clip"
    clip_eps_low: float | None = 0.2
    clip_eps_high: float = 0.28
    tau: float = 0.1
    aggregation: str = "token-mean"
    token_sum_divisor: float = 1.0
    std: str = "group"  # GRPO divides by the group's std; Dr.GRPO does not; "batch": the batch's
    eps: float = 1e-6  # rft's group_advantages eps (TRL uses 1e-4; the test batches have no near-zero std)

    @classmethod
    def from_config(cls, algo: Any, max_response_tokens: int | None = None) -> RefAlgo:
        """The reference's knobs from an rft `AlgorithmConfig`; refuses what the reference does not
        implement (KL, off-policy corrections, dynamic sampling, overlong shaping, other estimators)."""
        unsupported = {
            "kl": algo.kl is not None,
            "correction": algo.correction is not None,
            "proximal: recompute": algo.proximal != "behavior",
            "dynamic_sampling": bool(algo.dynamic_sampling),
            "overlong": algo.overlong.buffer_fraction is not None or algo.overlong.mask_truncated,
            f"advantage {algo.advantage.type}": algo.advantage.type not in ("grpo", "dr_grpo"),
            f"loss {algo.loss.type}": algo.loss.type not in LOSSES,
            f"aggregation {algo.aggregation}": algo.aggregation not in AGGREGATIONS,
        }
        refused = [k for k, bad in unsupported.items() if bad]
        if refused:
            raise ValueError(f"the reference step does not implement {', '.join(refused)}")
        divisor = algo.token_sum_divisor
        if divisor == "max_tokens":
            divisor = max_response_tokens
        return cls(
            loss=algo.loss.type,
            clip_eps_low=getattr(algo.loss, "clip_eps_low", None),
            clip_eps_high=getattr(algo.loss, "clip_eps_high", 0.0),
            tau=getattr(algo.loss, "tau", 0.1),
            aggregation=algo.aggregation,
            token_sum_divisor=float(divisor or 1.0),
            std=algo.advantage.std,
        )


def sequence_logprobs(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, temperature: float) -> Tensor:
    """logprob [B, L] of input_ids[b, i] under the model's logits at i-1 / temperature; column 0 is 0."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # [B, L, V]
    logp_all = F.log_softmax(logits[:, :-1].float() / temperature, dim=-1)  # [B, L-1, V]
    picked = torch.gather(logp_all, 2, input_ids[:, 1:, None]).squeeze(2)  # [B, L-1]
    return torch.cat([picked.new_zeros(picked.shape[0], 1), picked], dim=1)  # [B, L]


def advantages(rewards: Tensor, groups: Tensor, std: str = "group", eps: float = 1e-6) -> Tensor:
    """GRPO advantages [B] float32 of rewards [B] in groups [B]: a plain loop over the groups, each
    reward minus its group's mean, divided by the group's std (`std` "group"), by the std of all
    those centred rewards ("batch", as Lite PPO; TRL's `scale_rewards="batch"` takes the raw
    rewards' std instead) or by nothing ("none")."""
    r = rewards.double()  # [B]
    out = torch.zeros_like(r)
    for g in groups.unique():
        rows = groups == g  # [B] bool
        members = r[rows]  # [n]
        if members.numel() < 2:
            continue  # nobody to compare with: 0
        centred = members - members.mean()  # [n]
        if std == "group":
            s = members.std(unbiased=True)
            centred = centred / (s + eps) if s > 0 else torch.zeros_like(centred)
        out[rows] = centred
    if std == "batch" and out.numel() > 1:
        s = out.std(unbiased=True)
        out = out / (s + eps) if s > 0 else torch.zeros_like(out)
    return out.float()


def token_losses(logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, algo: RefAlgo) -> tuple[Tensor, Tensor]:
    """(loss [B, L], clip-bound [B, L] bool) per token of `algo.loss`; logp (with grad), old, mask [B, L], adv [B]."""
    a = adv[:, None]  # [B, 1]
    low = 1.0 - algo.clip_eps_low if algo.clip_eps_low is not None else 0.0
    high = 1.0 + algo.clip_eps_high
    log_ratio = (logp - old) * mask  # [B, L]; 0 off the mask
    if algo.loss == "ppo_clip":
        ratio = torch.exp(log_ratio)  # [B, L]
        surr1, surr2 = ratio * a, torch.clamp(ratio, low, high) * a  # [B, L] x 2
        bound = (a > 0) & (ratio > high) | (a < 0) & (ratio < low)  # [B, L]: the clipped surrogate is the min
        return -torch.min(surr1, surr2), bound
    if algo.loss == "gspo":
        n_tok = mask.sum(1).clamp(min=1.0)  # [B]
        s = torch.exp(log_ratio.sum(1) / n_tok)  # [B]: the sequence ratio (geometric mean of token ratios)
        ratio = s.detach()[:, None] * torch.exp(logp - logp.detach())  # [B, L]: value s_i, gradient s_i grad log pi_t
        surr1, surr2 = ratio * a, torch.clamp(ratio, low, high) * a  # [B, L] x 2
        bound = ((a > 0) & (ratio > high) | (a < 0) & (ratio < low)) & (mask > 0)  # [B, L]
        return -torch.min(surr1, surr2), bound
    if algo.loss == "cispo":
        ratio = torch.exp(log_ratio).detach()  # [B, L]
        weight = torch.clamp(ratio, low, high)  # [B, L]: bounded, no gradient
        return -weight * a * logp, (weight != ratio) & (mask > 0)
    if algo.loss == "kimi":
        return -a * logp + algo.tau / 2 * (logp - old) ** 2, torch.zeros_like(mask, dtype=torch.bool)
    raise ValueError(f"unknown loss {algo.loss!r}; the reference has {LOSSES}")


def reduce_loss(loss: Tensor, mask: Tensor, algo: RefAlgo, batch_tokens: float, batch_seqs: float) -> Tensor:
    """A micro-batch's share of the batch loss: loss, mask [b, L]; the whole batch's counts divide it."""
    if algo.aggregation == "token-mean":
        return (loss * mask).sum() / batch_tokens
    per_row = (loss * mask).sum(1)  # [b]
    if algo.aggregation == "seq-mean-token-mean":
        per_row = per_row / mask.sum(1).clamp(min=1.0)
    else:  # seq-mean-token-sum
        per_row = per_row / algo.token_sum_divisor
    return per_row.sum() / batch_seqs


class ReferenceTrainer:
    """One model, torch AdamW, global-norm clipping and the warm-up schedule; `step` = one update."""

    def __init__(
        self,
        model: torch.nn.Module,
        algo: RefAlgo,
        lr: float,
        warmup_steps: int,
        grad_clip: float,
        temperature: float = 1.0,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
    ):
        self.model, self.algo, self.lr, self.warmup = model, algo, lr, warmup_steps
        self.grad_clip, self.temperature = grad_clip, temperature
        self.params = [p for p in model.parameters() if p.requires_grad]
        # fused, as transformers' Trainer (TRL's) defaults to on torch >= 2.8 (adamw_torch_fused)
        self.opt = torch.optim.AdamW(self.params, lr=lr, betas=betas, weight_decay=weight_decay, fused=True)
        self.steps = 0

    def lr_at(self, step: int) -> float:
        """The learning rate of update `step` (1-based): linear warm-up to lr over warmup_steps."""
        return self.lr * min(1.0, step / self.warmup) if self.warmup else self.lr

    def step(self, batch: dict[str, Tensor], micro_batch_size: int, keep_grads: bool = False) -> dict[str, Any]:
        """One update on batch (rft's trainer layout: input_ids, attention_mask, loss_mask,
        behavior_logprobs [B, L]; rewards, group_index [B]). Returns loss, grad_norm (before
        clipping), clip_frac, lr, and with keep_grads the clipped gradients by parameter name."""
        mask = batch["loss_mask"].float()  # [B, L]
        adv = advantages(batch["rewards"], batch["group_index"], self.algo.std, self.algo.eps)  # [B]
        tokens = float(mask.sum().clamp(min=1.0))
        seqs = float((mask.sum(1) > 0).sum().clamp(min=1))
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        total, bound = 0.0, 0.0
        n = mask.shape[0]
        for i in range(0, n, micro_batch_size):
            rows = slice(i, i + micro_batch_size)
            logp = sequence_logprobs(
                self.model, batch["input_ids"][rows], batch["attention_mask"][rows], self.temperature
            )  # [b, L]
            old = batch["behavior_logprobs"][rows].float()  # [b, L]
            m = mask[rows]  # [b, L]
            loss_tok, clipped = token_losses(logp, old, adv[rows], m, self.algo)  # [b, L] x 2
            loss = reduce_loss(loss_tok, m, self.algo, tokens, seqs)
            loss.backward()
            total += float(loss.detach())
            bound += float((clipped.float() * m).sum())
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))  # global L2
        scale = self.grad_clip / (norm + 1e-6)
        if scale < 1.0:
            for g in grads:
                g.mul_(scale)
        self.steps += 1
        lr = self.lr_at(self.steps)
        for group in self.opt.param_groups:
            group["lr"] = lr
        kept = (
            {k: p.grad.detach().clone() for k, p in self.model.named_parameters() if p.grad is not None}
            if keep_grads
            else {}
        )
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        out: dict[str, Any] = {"loss": total, "grad_norm": float(norm), "clip_frac": bound / tokens, "lr": lr}
        if keep_grads:
            out["grads"] = kept
        return out
