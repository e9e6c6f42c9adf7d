"""The trainer's chunked output projection (hidden states -> `chunked_token_logprobs`) gives the
step of the full-logits path it replaced: same metrics and updated weights, GRPO (KL on,
ratios clipped) and SFT, ZeRO 0 and 3 (3: the head module is called per chunk).

    .venv/bin/python -m pytest tests/rl_engine/trainer/test_chunked_head.py -q -m slow
"""

from __future__ import annotations

import pytest
import torch
from trainer_helpers import grpo_case, make_batch, make_cfg

from rl_engine.trainer import build_trainer, trainer_settings
from rl_engine.trainer.head import LOGITS_CHUNK_TOKENS

pytestmark = pytest.mark.slow


def weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.named_weights()}


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_chunked_head_step_equals_full_logits_step(tiny_model_dir, zero_stage):
    algo, build = grpo_case()
    cfg = make_cfg(
        tiny_model_dir, algorithm=algo, trainer={"zero_stage": zero_stage}, explorer={"sampling": {"temperature": 0.8}}
    )
    results = []
    for chunk in (None, 5):  # None: the full-logits path; 5 positions: chunks cut across rows, short last one
        tr = build_trainer(trainer_settings(cfg))
        assert tr.logits_chunk_tokens == LOGITS_CHUNK_TOKENS  # the tiny model is a Qwen2: chunked by default
        tr.logits_chunk_tokens = chunk
        tr.share_prompts = False  # the chunked head alone (tests/rl_engine/trainer/test_prefix.py: the two together)
        batch = build(tr)
        lp = tr.compute_logprobs(batch)  # [B, L], every position
        steps = [tr.train_step(batch), tr.train_step(batch), tr.sft_step(make_batch(seed=1))]
        results.append((lp, steps, weights(tr)))
    (lp_full, m_full, w_full), (lp_chunk, m_chunk, w_chunk) = results
    torch.testing.assert_close(lp_chunk, lp_full, rtol=1e-5, atol=1e-5)
    assert m_full[1]["clip_frac"] > 0 and m_full[1]["kl"] > 0
    for full, chunked in zip(m_full, m_chunk):
        assert full.keys() == chunked.keys()
        for key in full:
            # The gradient norm sums ~0.3M squares whose summation order the chunking changes; on
            # a CPU without AVX-512 ZeRO 3's differed by 1.05e-5 relative (6.414975 vs 6.414907).
            rel = 5e-5 if key == "grad_norm" else 1e-5
            assert chunked[key] == pytest.approx(full[key], rel=rel, abs=1e-6), key
    # Adam divides by sqrt(v): where a gradient entry is ~0, summation-order noise (other matmul
    # shapes here) moves that entry's update by a visible fraction of lr = 1e-3 per step; over
    # these 3 steps a few of ~0.3M entries move by up to ~6e-5. 1e-4 = a tenth of one step.
    for name in w_full:
        torch.testing.assert_close(w_chunk[name], w_full[name], rtol=1e-5, atol=1e-4)


def test_models_with_a_logit_transform_keep_full_logits(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from rl_engine.trainer.head import plain_lm_head

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert plain_lm_head(model)
    model.config.final_logit_softcapping = 30.0  # Gemma-2's: logits = 30 tanh(lm_head(h) / 30)
    assert not plain_lm_head(model)
    model.config.final_logit_softcapping = None
    model.config.model_type = "gemma"
    assert not plain_lm_head(model)
