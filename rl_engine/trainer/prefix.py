"""A group's shared prompt run once per micro-batch: the decoder's hidden states of rows that start alike.

A GRPO group is `repeat_times` responses to one prompt, so its rows begin with the same tokens.
Attention is causal, so the hidden state of a position depends only on the tokens up to it: on
the positions that the rows of a group share, each of the rows computes the same thing. Here
those shared positions run once per group (`use_cache`), and each row runs only the rest of
its tokens, attending to its group's cached keys and values. The rows' hidden states are then
put together as a whole-row forward would give them, so the output head and the loss are the
same as before; the gradient reaches the shared positions through the cache (once per group,
summed over its rows, as autograd sums them through any shared input).

On the real model's demo (prompts of 47 tokens, responses of 22 on average, 8 to a group) a
row ran 69 positions; shared, a group runs 47 + 8 x its longest response.

`decoder_output` (one forward that computes no logits, the decoder's last hidden state taken by a
hook) serves both this path and the whole rows' (rl_engine.trainer.head).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


def full_attention(model: torch.nn.Module) -> bool:
    """True when every layer of `model` attends to all earlier positions: no sliding window, whose
    cache would keep only the window's last keys of a long shared prefix."""
    cfg = getattr(model, "config", None)
    return getattr(cfg, "sliding_window", None) is None or getattr(cfg, "use_sliding_window", True) is False


def can_share_prompts(model: torch.nn.Module, zero_stage: int, world: int) -> bool:
    """True when a trainer of `model` on `world` data-parallel ranks at `zero_stage` may run a
    group's prompt once: full attention, and not ZeRO-3 on several ranks, which gathers each
    layer's weights collectively in that layer's forward, so every rank must run as many forwards
    while a rank's plan depends on its own rows."""
    return full_attention(model) and not (zero_stage == 3 and world > 1)


@dataclass(frozen=True)
class SharedPrompts:
    """How a micro-batch runs with its groups' shared prefixes (`share_plan`)."""

    local: Tensor  # [b] each row's group, 0..g-1
    first: Tensor  # [g] a group's first row
    plen: Tensor  # [g] its shared prefix length
    lengths: Tensor  # [b] each row's real tokens

    def counts(self) -> tuple[int, int]:
        """(positions the decoder runs: g x the longest prefix + b x the longest remainder, the
        real tokens among them: each prefix once, each row's remainder)."""
        own = self.lengths - self.plen[self.local]  # [b]
        return len(self.plen) * int(self.plen.max()) + len(own) * int(own.max()), int(self.plen.sum() + own.sum())


def share_plan(ids: Tensor, am: Tensor, group: Tensor) -> SharedPrompts | None:
    """The shared prefixes of a right-padded micro-batch `ids` / `am` [b, L] whose rows belong to
    `group` [b] (any ids), or None where nothing is shared: every group a single row, or a group
    whose rows differ from their first token.

    A group's prefix is the longest run of leading real tokens all its rows have in common, less
    one position where it would cover a whole row (every row keeps a position of its own to run).
    """
    local = torch.unique(group, return_inverse=True)[1]  # [b] in 0..g-1
    g = int(local.max()) + 1
    if g == len(local):
        return None
    lengths = am.sum(-1)  # [b]
    rows = torch.arange(len(local), device=ids.device)  # [b]
    first = torch.full((g,), len(local), device=ids.device).scatter_reduce(0, local, rows, reduce="amin")  # [g]
    same = (ids == ids[first[local]]) & (am > 0)  # [b, L]: a real token equal to its group's first row's
    run = torch.minimum(torch.cumprod(same.long(), -1).sum(-1), lengths - 1)  # [b] leading positions alike
    plen = torch.full((g,), ids.shape[1], dtype=torch.long, device=ids.device)
    plen = plen.scatter_reduce(0, local, run, reduce="amin")  # [g]
    return SharedPrompts(local, first, plen, lengths) if int(plen.min()) >= 1 else None


def shared_prefix_hidden(
    model: torch.nn.Module, forward: Callable[..., Any], ids: Tensor, am: Tensor, group: Tensor
) -> Tensor:
    """The decoder's last hidden state [b, L, H] of right-padded `ids` / `am` [b, L], as a
    whole-row forward of `model` (run by `forward`) gives it on the real positions, with each
    group's shared prefix run once (see the module docstring); a micro-batch with nothing to
    share (`share_plan` None) runs as one forward of its rows."""
    plan = share_plan(ids, am, group)
    if plan is None:
        return decoder_output(model, forward, input_ids=ids, attention_mask=am)[0]
    local, first, plen = plan.local, plan.first, plan.plen
    length = ids.shape[1]
    dev = ids.device
    p = int(plen.max())
    pre_am = (torch.arange(p, device=dev) < plen[:, None]).long()  # [g, P]
    pre_ids = ids[first, :p] * pre_am  # [g, P]
    pre_h, out = decoder_output(model, forward, input_ids=pre_ids, attention_mask=pre_am, use_cache=True)  # [g, P, H]
    cache = out.past_key_values
    cache.batch_select_indices(local)  # each row its group's keys and values: [b, heads, P, d] per layer

    start = plen[local]  # [b] where each row's own positions begin
    s = int((plan.lengths - start).max())  # suffix positions the micro-batch runs
    pos = start[:, None] + torch.arange(s, device=dev)  # [b, S] the positions of row i's suffix
    inside = pos < length  # [b, S]
    suf_ids = torch.where(inside, ids.gather(1, pos.clamp(max=length - 1)), 0)  # [b, S]
    suf_am = torch.where(inside, am.gather(1, pos.clamp(max=length - 1)), 0)  # [b, S]
    suf_h, _ = decoder_output(
        model,
        forward,
        input_ids=suf_ids,
        attention_mask=torch.cat([pre_am[local], suf_am], 1),  # [b, P + S]
        position_ids=pos,
        past_key_values=cache,
        use_cache=True,
    )  # [b, S, H]
    # Position t of row i: the group's prefix below its start, else the row's own position t - start.
    t = torch.arange(length, device=dev)[None]  # [1, L]
    where = torch.where(t < start[:, None], t, p + t - start[:, None]).clamp(max=p + s - 1)  # [b, L]
    both = torch.cat([pre_h[local], suf_h], 1)  # [b, P + S, H]
    return both.gather(1, where[..., None].expand(-1, -1, both.shape[-1]))  # [b, L, H]


def decoder_output(model: torch.nn.Module, forward: Callable[..., Any], **inputs: Any) -> tuple[Tensor, Any]:
    """(the decoder's last hidden state [b, L, H], the model's output) of one forward of the whole
    model on `inputs` that computes no logits (`logits_to_keep` = no position).

    The whole model rather than its decoder alone: under ZeRO-3 DeepSpeed's forward pre-hook on
    the root module starts each step's parameter-fetch trace; calling `model.model` directly
    would skip it.
    """
    got: list[Tensor] = []
    hook = model.get_decoder().register_forward_hook(
        lambda _m, _a, out: got.append(out[0] if isinstance(out, tuple) else out.last_hidden_state)
    )
    try:
        none = torch.zeros(0, dtype=torch.long, device=inputs["input_ids"].device)
        out = forward(**inputs, logits_to_keep=none)
    finally:
        hook.remove()
    return got[-1], out
