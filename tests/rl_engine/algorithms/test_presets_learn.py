"""Every preset moves the tiny model the right way on a one-step problem.

One prompt, a group of four responses: two rewarded (1) that start with token GOOD, two not (0)
that start with token BAD, of unequal lengths, plus a
second group whose rewards are all equal (no signal: dynamic sampling must leave it out, the others
give it advantage 0). Each step recomputes the policy's logprobs of the eight rows (the proximal
policy), builds the loss exactly as the trainer does (`prepare_rows` then `policy_loss`, the
preset's knobs) and takes one Adam step. Behavior logprobs are the policy's own minus a stale
offset on some tokens (as if an older version sampled them), so the corrections have work to do.
After 5 steps the policy's first response token must be likelier GOOD and less likely BAD (the
one decision all rows share; later tokens are random and interfere through the tiny model).

    .venv/bin/python -m pytest tests/rl_engine/algorithms/test_presets_learn.py -q
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.algorithms import policy_loss, prepare_rows, token_logprobs, token_sum_divisor
from rl_engine.config import AlgorithmConfig
from rl_engine.config.algorithm import PRESETS

PROMPT = 4  # prompt tokens
LENS = (3, 5, 4, 2, 3, 3, 3, 3)  # response tokens per row
REWARDS = (1.0, 1.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5)  # group 0: signal; group 1: none
GROUPS = (0, 0, 0, 0, 1, 1, 1, 1)
MAX_TOKENS = 6
GOOD, BAD = 65, 66


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    length = PROMPT + max(LENS)
    ids = torch.randint(3, 200, (len(LENS), length), generator=g)  # [B, L]
    ids[:, :PROMPT] = ids[0, :PROMPT]  # one prompt
    mask = torch.zeros(len(LENS), length)  # [B, L]
    am = torch.zeros(len(LENS), length, dtype=torch.long)
    ids[:, PROMPT] = torch.tensor([GOOD, GOOD, BAD, BAD, GOOD, BAD, GOOD, BAD])
    for b, n in enumerate(LENS):
        mask[b, PROMPT : PROMPT + n] = 1
        am[b, : PROMPT + n] = 1
        ids[b, PROMPT + n :] = 0
    return {"input_ids": ids, "attention_mask": am, "mask": mask}


def first_token_logprobs(model, b) -> torch.Tensor:
    """log p(GOOD | prompt), log p(BAD | prompt): [2]."""
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"][:1, :PROMPT]).logits[0, -1]  # [V]
    return torch.log_softmax(logits, -1)[[GOOD, BAD]]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_raises_rewarded_and_lowers_unrewarded(preset, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cfg = AlgorithmConfig(preset=preset, repeat_times=4)
    b = batch()
    stale = torch.zeros_like(b["mask"])
    stale[::2, PROMPT : PROMPT + 2] = 1.0  # rows 0, 2, ...: their first two tokens came from an older policy
    prep = prepare_rows(
        torch.tensor(REWARDS),
        torch.tensor(GROUPS),
        torch.tensor(LENS),
        torch.zeros(len(LENS), dtype=torch.long),
        cfg,
        MAX_TOKENS,
    )
    if cfg.dynamic_sampling:
        assert prep.filtered == 4 and prep.trained_rows.tolist() == [1.0] * 4 + [0.0] * 4
    mask = b["mask"] * prep.trained_rows[:, None]  # [B, L]
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    before = first_token_logprobs(model, b)
    divisor = token_sum_divisor(cfg, MAX_TOKENS)
    for _ in range(5):
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits  # [B, L, V]
        logp = token_logprobs(logits, b["input_ids"])  # [B, L]
        current = logp.detach()
        behavior = current - stale * b["mask"]
        proximal = current if cfg.proximal == "recompute" else behavior
        out = policy_loss(logp, proximal, prep.advantages, mask, cfg, behavior=behavior, token_sum_divisor=divisor)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    moved = first_token_logprobs(model, b) - before  # [2]
    assert moved[0] > 0.01 and moved[1] < -0.01, (
        f"{preset}: log p(GOOD) moved {moved[0]:+.4f}, log p(BAD) {moved[1]:+.4f}"
    )
    if cfg.correction is not None:
        # the stale tokens of trained rows: w = e^1 = 2.72, clamped to decoupled_ppo's high 2 (4 rows x 2 tokens)
        assert out.clamped_tokens == 8 and out.masked_tokens == 0
