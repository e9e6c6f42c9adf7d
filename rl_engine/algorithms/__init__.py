"""Advantages and losses of the RL algorithms (GRPO, PPO-clip, KL, SFT): plain tensor functions.

    from rl_engine.algorithms import grpo_advantages, policy_loss, token_logprobs
"""

from rl_engine.algorithms.advantages import grpo_advantages
from rl_engine.algorithms.losses import aggregate, chunked_head_logprobs, chunked_token_logprobs, kl_token, ppo_clip_token_loss, sft_loss, token_entropy, token_logprobs, version_mask
from rl_engine.algorithms.policy import PolicyLoss, policy_loss

__all__ = [
    "PolicyLoss",
    "aggregate",
    "chunked_head_logprobs",
    "chunked_token_logprobs",
    "grpo_advantages",
    "kl_token",
    "policy_loss",
    "ppo_clip_token_loss",
    "sft_loss",
    "token_entropy",
    "token_logprobs",
    "version_mask",
]
