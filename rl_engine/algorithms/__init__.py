"""The RL algorithms as plain tensor functions: advantage estimators, reward-side knobs (overlong
shaping, dynamic sampling), policy losses (PPO-clip, GSPO, CISPO, Kimi), off-policy correction, KL,
SFT, aggregation; `policy_loss` and `prepare_rows` combine them as `AlgorithmConfig` says.

    from rl_engine.algorithms import group_advantages, policy_loss, prepare_rows, token_logprobs
"""

from rl_engine.algorithms.advantages import group_advantages, informative_rows, overlong_penalty
from rl_engine.algorithms.losses import (
    aggregate,
    chunked_head_logprobs,
    chunked_token_logprobs,
    cispo_token_loss,
    clipped_objective,
    gspo_token_loss,
    kimi_token_loss,
    kl_token,
    offpolicy_weights,
    ppo_clip_token_loss,
    sft_loss,
    token_entropy,
    token_logprobs,
    version_mask,
)
from rl_engine.algorithms.policy import PolicyLoss, policy_loss
from rl_engine.algorithms.prepare import PreparedRows, prepare_batch_rows, prepare_rows, row_metrics, token_sum_divisor

__all__ = [
    "PolicyLoss",
    "PreparedRows",
    "aggregate",
    "chunked_head_logprobs",
    "chunked_token_logprobs",
    "cispo_token_loss",
    "clipped_objective",
    "group_advantages",
    "gspo_token_loss",
    "informative_rows",
    "kimi_token_loss",
    "kl_token",
    "offpolicy_weights",
    "overlong_penalty",
    "policy_loss",
    "ppo_clip_token_loss",
    "prepare_batch_rows",
    "prepare_rows",
    "row_metrics",
    "sft_loss",
    "token_entropy",
    "token_logprobs",
    "token_sum_divisor",
    "version_mask",
]
