"""Shared helpers of the rollout and sync tests: process-wide vLLM engines and HF reference logprobs.

vLLM engines take ~20 s to start, so the whole suite shares at most two (explorer 0 and, for
the two-receiver collective test, explorer 1). Both test directories' conftest.py hand out the
same objects from here and close them at session end.
"""

from __future__ import annotations

import torch

from rl_engine.config import RFTConfig
from rl_engine.rollout.engine import Rollout, VLLMRolloutEngine, build_rollout_engine

_ENGINES: dict[int, VLLMRolloutEngine] = {}
MAX_MODEL_LEN = 128


def make_config(model_dir: str, **sections) -> RFTConfig:
    """A small valid RFTConfig around the tiny model (quarter-GiB KV cache)."""
    data = {
        "model": {"path": model_dir, "max_model_len": MAX_MODEL_LEN},
        "taskset": {"path": "unused.jsonl"},
        "explorer": {"engine": {"kv_cache_space_gib": 0.25}, "sampling": {"max_tokens": 16}},
    }
    data.update(sections)
    return RFTConfig.model_validate(data)


def shared_engine(model_dir: str, explorer_id: int = 0) -> VLLMRolloutEngine:
    """The session's engine of explorer `explorer_id`, started on first use."""
    if explorer_id not in _ENGINES:
        _ENGINES[explorer_id] = build_rollout_engine(make_config(model_dir), explorer_id=explorer_id)
    return _ENGINES[explorer_id]


def discard(explorer_id: int) -> None:
    """Close and forget one shared engine (after a test broke it on purpose)."""
    eng = _ENGINES.pop(explorer_id, None)
    if eng is not None:
        eng.close()


def close_all() -> None:
    while _ENGINES:
        _ENGINES.popitem()[1].close()


@torch.no_grad()
def hf_logprobs(model, r: Rollout, temperature: float) -> torch.Tensor:
    """What the trainer computes: log_softmax(logits / T) of each response token, fp32. -> [len(response)]"""
    ids = torch.tensor([r.prompt_ids + r.response_ids])  # [1, P + R]
    logits = model(ids).logits[0].float()  # [P + R, V]
    p = len(r.prompt_ids)
    lp = torch.log_softmax(logits[p - 1 : -1] / temperature, dim=-1)  # [R, V]: position t predicts token t+1
    return lp.gather(-1, torch.tensor(r.response_ids)[:, None])[:, 0]  # [R]


def max_logprob_diff(model, groups: list[list[Rollout]], temperature: float) -> float:
    """Largest |vLLM behavior logprob - HF logprob| over every response token."""
    worst = 0.0
    for g in groups:
        for r in g:
            diff = (hf_logprobs(model, r, temperature) - torch.tensor(r.logprobs)).abs().max().item()
            worst = max(worst, diff)
    return worst


def load_hf(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
