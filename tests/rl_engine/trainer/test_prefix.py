"""A group's shared prompt run once (rl_engine.trainer.prefix) gives what whole rows give: the
decoder's hidden states on every real position and their gradient, in float64 to rounding (tiny
Qwen2 model, no DeepSpeed; seconds).

    .venv/bin/python -m pytest tests/rl_engine/trainer/test_prefix.py -q
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.trainer.head import final_hidden
from rl_engine.trainer.prefix import can_share_prompts, share_plan, shared_prefix_hidden


def _rows(groups: list[tuple[int, list[int]]], vocab: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Right-padded (ids, attention, group) [b, L] x 2, [b]: per group (prompt length, its rows'
    response lengths), responses drawn apart; a response length of 0 repeats the row before it."""
    g = torch.Generator().manual_seed(seed)
    rows, group = [], []
    for k, (plen, responses) in enumerate(groups):
        prompt = torch.randint(3, vocab, (plen,), generator=g)
        for n in responses:
            rows.append(rows[-1] if n == 0 else torch.cat([prompt, torch.randint(3, vocab, (n,), generator=g)]))
            group.append(10 + 7 * k)  # any ids: not 0..g-1, not in order
    length = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    am = torch.zeros(len(rows), length, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], am[i, : len(r)] = r, 1
    return ids, am, torch.tensor(group)


def _rms_norm_in_its_dtype(self, x: torch.Tensor) -> torch.Tensor:
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


@pytest.fixture
def model(tiny_model_dir, monkeypatch):
    """The tiny model in float64 throughout. Qwen2's RMSNorm computes in float32 whatever its
    input; the shared prefix sums its rows' gradients before that norm's backward, whole rows
    after it, so the norm alone would part them by ~1e-8 and hide an error of our own below that."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen2 import modeling_qwen2

    monkeypatch.setattr(modeling_qwen2.Qwen2RMSNorm, "forward", _rms_norm_in_its_dtype)
    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    m.train()  # as the trainer runs it (the tiny model has no dropout)
    return m


CASES = {
    "groups of different prompts": [(5, [3, 6, 1, 4]), (9, [2, 2, 5]), (7, [8, 1])],
    "equal rows": [(6, [4, 0, 0])],  # the prefix stops a position short of the rows' end
    "one group": [(4, [5, 3, 3, 7])],
}


@pytest.mark.parametrize("groups", CASES.values(), ids=CASES.keys())
def test_shared_prefix_gives_the_whole_rows_hidden_states_and_gradients(model, groups):
    ids, am, group = _rows(groups, model.config.vocab_size)
    weight = torch.randn(*ids.shape, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    weight = weight.double() * am[..., None]  # [b, L, H]: a loss on the real positions only

    results = []
    for run in (
        lambda: final_hidden(model, model, ids, am),
        lambda: shared_prefix_hidden(model, model, ids, am, group),
    ):
        model.zero_grad(set_to_none=True)
        hidden = run()  # [b, L, H]
        (hidden * weight).sum().backward()
        results.append((hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (h_rows, g_rows), (h_shared, g_shared) = results
    real = am.bool()
    torch.testing.assert_close(h_shared[real], h_rows[real], rtol=1e-10, atol=1e-10)
    assert g_shared.keys() == g_rows.keys()
    for name, grad in g_rows.items():
        torch.testing.assert_close(g_shared[name], grad, rtol=1e-9, atol=1e-12, msg=name)


def test_prefix_lengths_stop_where_a_groups_rows_part_or_a_row_ends():
    ids, am, group = _rows(CASES["groups of different prompts"], vocab=50)
    plan = share_plan(ids, am, group)
    assert plan.local.tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2] and plan.first.tolist() == [0, 4, 7]
    # Groups 0 and 2 each hold a row one token past the prompt, which keeps that token its own;
    # group 1's drawn responses may happen to start alike: the prompt, or one token more.
    assert plan.plen[0] == 5 and plan.plen[2] == 7 and 9 <= plan.plen[1] <= 10
    positions, real = plan.counts()
    assert real == int(am.sum()) - 3 * 5 - 2 * int(plan.plen[1]) - 1 * 7  # each prefix once, not once a row
    assert positions == 3 * int(plan.plen.max()) + 9 * int((am.sum(-1) - plan.plen[plan.local]).max())
    ids, am, group = _rows(CASES["equal rows"], vocab=50)
    assert share_plan(ids, am, group).plen.tolist() == [9]  # 10 tokens each, the last their own


def test_nothing_to_share_runs_the_rows_as_they_are():
    ids, am, group = _rows([(3, [2]), (4, [1]), (2, [5])], vocab=50)
    assert share_plan(ids, am, group) is None  # every group a single row
    ids = torch.tensor([[5, 6, 7], [8, 6, 7]])  # one group whose rows differ from their first token
    assert share_plan(ids, torch.ones_like(ids), torch.tensor([1, 1])) is None


def test_prompts_are_shared_only_where_every_rank_may_run_its_own_forwards(model):
    """ZeRO-3 gathers a layer's weights collectively in that layer's forward: on several ranks every
    rank must run as many forwards, so a group's prompt runs once there only on one rank; a
    sliding window's cache would not hold a long prompt's keys."""
    assert can_share_prompts(model, zero_stage=3, world=1) and can_share_prompts(model, zero_stage=2, world=2)
    assert not can_share_prompts(model, zero_stage=3, world=2)
    model.config.sliding_window, model.config.use_sliding_window = 4, True
    assert not can_share_prompts(model, zero_stage=0, world=1)


SHARED_CASES = {
    "zero-0": {},
    "zero-3": {"trainer": {"zero_stage": 3}},
    "lora": {"model": {"lora": {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "mlp.down_proj"]}}},
}


@pytest.mark.slow
@pytest.mark.parametrize("case", SHARED_CASES.values(), ids=SHARED_CASES.keys())
def test_trainer_step_sharing_prompts_equals_whole_rows(tiny_model_dir, case, monkeypatch):
    """Two GRPO steps (KL on, ratios off 1) of the DeepSpeed trainer on a batch whose groups share
    their prompts, micro-batches of 2 rows: with `trainer.share_prompts` the decoder runs fewer
    positions, and the metrics and updated weights are whole rows' (fp32 rounding: the chunked
    head test's tolerances); so are the logprobs of `compute_logprobs`, which shares them too."""
    from trainer_helpers import grpo_case, make_batch, make_cfg

    from rl_engine.trainer import build_trainer, head, trainer_settings

    shared_runs = []
    real = head.shared_prefix_hidden
    monkeypatch.setattr(head, "shared_prefix_hidden", lambda *a: shared_runs.append(1) or real(*a))
    algo, _ = grpo_case()
    runs, logprobs = {}, {}
    for share in (False, True):
        sections = {**case, "trainer": {**case.get("trainer", {}), "share_prompts": share}}
        tr = build_trainer(trainer_settings(make_cfg(tiny_model_dir, algorithm=algo, **sections)))
        batch = make_batch(response_lens=(5, 3, 2, 1), prompt_len=6)
        batch["input_ids"][1, :6] = batch["input_ids"][0, :6]  # groups (0, 0, 1, 1): one prompt each
        batch["input_ids"][3, :6] = batch["input_ids"][2, :6]
        noise = torch.randn(batch["loss_mask"].shape, generator=torch.Generator().manual_seed(5))
        shared_runs.clear()
        logprobs[share] = tr.compute_logprobs(batch).cpu()  # [B, L]
        assert bool(shared_runs) == share
        batch["behavior_logprobs"] = (logprobs[share] - 0.3 * noise.abs()) * batch["loss_mask"]
        steps = [tr.train_step(batch), tr.train_step(batch)]
        runs[share] = steps, {k: v.detach().clone() for k, v in tr.named_weights()}
    (whole, w_whole), (shared, w_shared) = runs[False], runs[True]
    torch.testing.assert_close(logprobs[True], logprobs[False], rtol=1e-5, atol=1e-6)
    assert shared[0]["attended"] == whole[0]["attended"] - 2 * 6  # each group's prompt ran once
    assert shared[0]["positions"] < whole[0]["positions"]
    assert whole[1]["clip_frac"] > 0 and whole[1]["kl"] > 0
    for w, s in zip(whole, shared, strict=True):
        for key in w.keys() - {"positions", "attended"}:
            rel = 5e-5 if key == "grad_norm" else 1e-5
            assert s[key] == pytest.approx(w[key], rel=rel, abs=1e-6), key
    for name in w_whole:
        torch.testing.assert_close(w_shared[name], w_whole[name], rtol=1e-5, atol=1e-4, msg=name)
