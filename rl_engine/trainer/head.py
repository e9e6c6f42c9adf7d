"""The trainer's output head: token logprobs and entropy from a causal LM without keeping [b, L, V] logits.

For a model whose logits are `lm_head(last hidden state)` (`plain_lm_head`), the whole model runs
without logits and the head goes through `chunked_token_logprobs` a chunk of positions at a time;
other models take the full-logits path. Used by rl_engine.trainer.deepspeed_trainer for the policy
and SFT losses and for logprob passes (the policy's and the KL reference's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from rl_engine.algorithms import chunked_head_logprobs, chunked_token_logprobs, token_entropy, token_logprobs
from rl_engine.trainer.prefix import decoder_output, shared_prefix_hidden

# Positions per chunk of the output projection (`chunked_token_logprobs`): with a 49k vocabulary,
# 512 x 49152 float32 = 100 MB per [chunk, V] tensor, instead of [b, L, V] ones.
LOGITS_CHUNK_TOKENS = 512
# Architectures whose logits are exactly lm_head(final hidden state), the decoder's (`model`)
# last_hidden_state: the chunked head reproduces them. Others (Gemma's final logit softcap,
# Cohere's logit_scale, ...) transform the logits after lm_head, so the chunked head would be
# wrong for them: they keep the full-logits path (`plain_lm_head`).
PLAIN_HEAD_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def head_logprobs(
    model: torch.nn.Module,
    forward: Callable[..., Any],
    ids: Tensor,
    am: Tensor,
    temperature: float,
    chunk_tokens: int | None,
    mask: Tensor | None,
    entropy: bool = True,
    group: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(logprobs [b, L] with grad, entropy [b, L] without) of ids under `model`, which `forward`
    runs (the DeepSpeed engine for the policy: its forward, hooks included, stays in the path).
    `group` [b] (chunked path only): the rows' groups, whose shared prompts run once
    (rl_engine.trainer.prefix).

    Chunked path: the whole model runs with no logits (`logits_to_keep` an empty index), a hook
    takes the decoder's last hidden state, and the output projection goes through it
    `chunk_tokens` positions at a time, only where mask > 0 (0 elsewhere); under ZeRO-3
    the head module itself is called per chunk, since its partitioned weight is only whole
    inside its own forward. Full path (`chunk_tokens` None): the [b, L, V] logits,
    logprobs at every position; entropy zeros when `entropy` is False.
    """
    if chunk_tokens is None:
        logits = forward(input_ids=ids, attention_mask=am).logits  # [b, L, V]
        logp = token_logprobs(logits, ids, temperature)  # [b, L]
        with torch.no_grad():
            ent = token_entropy(logits.detach(), temperature) if entropy else torch.zeros_like(logp)  # [b, L]
        return logp, ent
    if group is None:
        hidden = final_hidden(model, forward, ids, am)  # [b, L, H]
    else:
        hidden = shared_prefix_hidden(model, forward, ids, am, group)  # [b, L, H]
    head = model.get_output_embeddings()
    if hasattr(head.weight, "ds_id"):  # ZeRO-3
        return chunked_head_logprobs(hidden, head, ids, temperature, chunk_tokens, mask)
    return chunked_token_logprobs(hidden, head.weight, head.bias, ids, temperature, chunk_tokens, mask)


def plain_lm_head(model: torch.nn.Module) -> bool:
    """True when `model`'s logits are its output embedding (a Linear) applied to its decoder's
    last hidden state and nothing else (see PLAIN_HEAD_MODEL_TYPES): the chunked head is exact."""
    cfg = getattr(model, "config", None)
    return (
        getattr(cfg, "model_type", None) in PLAIN_HEAD_MODEL_TYPES
        and getattr(cfg, "final_logit_softcapping", None) is None
        and getattr(cfg, "logit_scale", None) is None
        and isinstance(model.get_output_embeddings(), torch.nn.Linear)
    )


def final_hidden(model: torch.nn.Module, forward: Callable[..., Any], ids: Tensor, am: Tensor) -> Tensor:
    """The decoder's last hidden state [b, L, H] (after the final norm: what lm_head reads), from
    a forward of the whole model that computes no logits (`decoder_output`)."""
    return decoder_output(model, forward, input_ids=ids, attention_mask=am)[0]
