"""rft's trainer step against the reference GRPO step (bench/reference.py) on one batch.

The same batch (3 groups of 4, each group's rows one prompt, which rft's trainer runs once per
micro-batch (rl_engine.trainer.prefix), ragged response lengths 1-7, a group whose rewards are all equal,
an environment span inside one response masked out of the loss, behavior logprobs off the policy
by row-dependent noise so that some ratios clip) and the same starting weights (the tests' tiny
model) go through `DeepSpeedTrainer.train_step` and `ReferenceTrainer.step`, for every loss type
(ppo_clip, gspo, cispo, kimi, each with rft's default knobs; ppo_clip with configs/smollm2.yaml's
0.2 / 0.28), token-mean aggregation (the config's), 1 and 4 micro-batches; then the gspo, kimi and
dr_grpo presets' own aggregation and advantages at 4 micro-batches. Compared:

- the loss, the gradient norm before clipping, the clip fraction;
- the gradient itself, after clipping, as the optimizer receives it: rft's is read by a step
  pre-hook on its AdamW (`register_step_pre_hook`), the reference's before its own AdamW step;
- the weights after the step (AdamW's first step, at the warm-up's lr / 2).

Tolerance: 1e-5 relative, plus an absolute floor. The two compute the same sums in a different
order (rft: chunked output head on trained positions only; the reference: full [B, L, V] logits),
so a gradient entry's fp32 error scales with the largest terms summed into its tensor, not with
the entry: the floor is 1e-5 x the tensor's largest entry. A weight after AdamW's first step
moved by lr * g / (|g| + 1e-8): an entry whose gradient is a few ulps of its tensor's largest
(all but exactly 0) moves by up to lr either way on noise, so the post-step weights are compared
where the reference's gradient is above the gradient floor (to 1% of one update step: measured
0.3% at most; the gradients within 1.3e-6 of their tensor's largest entry), and by the gradient
itself elsewhere. A per-sequence mean in place of token-mean moves the gradient by 78% of its
tensor's largest entry and the weights by 2 lr: it fails here.

    cd tests/rl_engine/trainer && ../../../.venv/bin/pytest -q test_reference_step.py
"""

from __future__ import annotations

import pytest
import torch
from trainer_helpers import make_cfg

from bench.reference import RefAlgo, ReferenceTrainer, advantages, reduce_loss, token_losses

RESPONSE_LENS = (7, 2, 5, 4, 6, 3, 1, 7, 4, 4, 5, 2)
REWARDS = (1.0, 0.0, 0.5, 1.0, 0.1, 1.1, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0)  # group 2: all equal, advantage 0
NOISE = (0.0, 1e-4, 0.3, 0.05, 1.0, 0.0, 1.5, 2e-4, 0.3, 0.1, 0.0, 0.4)  # per row: ratios off 1 by this
PROMPT_LEN, ENV_ROW, ENV_SPAN = 4, 0, (2, 4)  # row 0's response tokens 2-3 came from the environment
LR, TEMPERATURE = 1e-3, 0.8
LOSSES = {
    "ppo_clip": {"type": "ppo_clip", "clip_eps_low": 0.2, "clip_eps_high": 0.28},
    "gspo": {"type": "gspo"},
    "cispo": {"type": "cispo"},
    "kimi": {"type": "kimi"},
}


def same_batch(trainer) -> dict[str, torch.Tensor]:
    """The batch of the module docstring, in `ExperienceBatch.to_tensors`' layout."""
    rows, length = len(RESPONSE_LENS), PROMPT_LEN + max(RESPONSE_LENS)
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, 200, (rows, length), generator=g)  # [B, L]
    ids[:, :PROMPT_LEN] = ids[torch.arange(rows) // 4 * 4, :PROMPT_LEN]  # a group's rows answer one prompt
    am = torch.zeros(rows, length, dtype=torch.long)
    lm = torch.zeros(rows, length)
    for b, n in enumerate(RESPONSE_LENS):
        am[b, : PROMPT_LEN + n] = 1
        lm[b, PROMPT_LEN : PROMPT_LEN + n] = 1
        ids[b, PROMPT_LEN + n :] = 0  # the tiny tokenizer's pad
    lm[ENV_ROW, PROMPT_LEN + ENV_SPAN[0] : PROMPT_LEN + ENV_SPAN[1]] = 0  # attended to, not trained
    batch = {
        "input_ids": ids,
        "attention_mask": am,
        "loss_mask": lm,
        "versions": torch.where(lm > 0, 0, -1).long(),
        "rewards": torch.tensor(REWARDS),
        "group_index": torch.arange(rows) // 4,
        "response_start": torch.full((rows,), PROMPT_LEN, dtype=torch.long),
        "response_len": torch.tensor(RESPONSE_LENS),
        "truncated": torch.zeros(rows, dtype=torch.long),
        "behavior_logprobs": torch.zeros(rows, length),
    }
    noise = torch.randn(rows, length, generator=torch.Generator().manual_seed(5)) * torch.tensor(NOISE)[:, None]
    batch["behavior_logprobs"] = (trainer.compute_logprobs(batch).cpu() - noise) * lm  # [B, L]
    return batch


def rft_step(model_dir: str, algorithm: dict, micro: int):
    """(config, batch, metrics, gradients after clipping, weights after) of rft's first train_step on the batch."""
    from rl_engine.trainer import build_trainer, trainer_settings

    cfg = make_cfg(
        model_dir,
        algorithm={"repeat_times": 4, **algorithm},
        explorer={"batch_size": 3, "sampling": {"temperature": TEMPERATURE}},
        trainer={"micro_batch_size": micro, "lr": LR, "warmup_steps": 2, "grad_clip": 1.0, "share_prompts": True},
    )
    tr = build_trainer(trainer_settings(cfg))
    batch = same_batch(tr)
    names = {id(p): n for n, p in tr.engine.module.named_parameters()}
    grads: dict[str, torch.Tensor] = {}

    def keep(opt, *_):
        grads.update({names[id(p)]: p.grad.clone() for gr in opt.param_groups for p in gr["params"]})

    tr.engine.optimizer.register_step_pre_hook(keep)
    metrics = tr.train_step(dict(batch))
    weights = {n: p.detach().clone() for n, p in tr.engine.module.named_parameters()}
    return cfg, batch, metrics, grads, weights


def reference_step(model_dir: str, cfg, batch, micro: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    t = cfg.trainer
    ref = ReferenceTrainer(
        model,
        RefAlgo.from_config(cfg.algorithm, cfg.explorer.sampling.max_tokens),
        t.lr,
        t.warmup_steps,
        t.grad_clip,
        TEMPERATURE,
        tuple(t.betas),
        t.weight_decay,
    )
    out = ref.step(batch, micro, keep_grads=True)
    return out, {n: p.detach().clone() for n, p in model.named_parameters()}


def max_differences(rft: dict, ref: dict, ref_grads: dict, lr: float) -> dict[str, float]:
    """The largest differences of gradients and post-step weights, each over its tolerance's floor:
    gradient |rft - ref| / max|ref| of its tensor; weight |rft - ref| / lr where the reference's
    gradient is above the gradient floor (the others: AdamW turns their fp32 noise into +-lr)."""
    out = {"grad_over_tensor_max": 0.0, "weight_over_lr": 0.0, "noise_entries": 0}
    for name, g_ref in ref_grads.items():
        scale = g_ref.abs().max()
        out["grad_over_tensor_max"] = max(
            out["grad_over_tensor_max"], float((rft["grads"][name] - g_ref).abs().max() / scale)
        )
        moved = g_ref.abs() > 1e-5 * scale  # [*]
        dw = (rft["weights"][name] - ref["weights"][name]).abs()[moved]
        out["weight_over_lr"] = max(out["weight_over_lr"], float(dw.max() / lr) if dw.numel() else 0.0)
        out["noise_entries"] += int((~moved & (g_ref != 0)).sum())
    return out


def assert_same_step(
    cfg, m, grads, weights, ref, ref_weights, clipping: bool, norm_clipped: bool = True
) -> dict[str, float]:
    """rft's step (metrics m, gradients, weights) equals the reference's (ref, ref_weights); returns
    the largest differences (`max_differences`)."""
    # The batch exercises what it is meant to: the global-norm clip binds (or not), a clipped loss
    # clips some tokens, not all.
    assert (m["grad_norm"] > cfg.trainer.grad_clip) == norm_clipped
    if clipping:
        assert 0 < ref["clip_frac"] < 1
    # abs 1e-7: fp32's resolution of the O(1) per-token terms summed into a loss that may cancel to near 0
    assert m["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)
    assert m["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert m["clip_frac"] == pytest.approx(ref["clip_frac"], abs=1e-9)  # a count of tokens: exact
    assert m["lr"] == ref["lr"] == LR / 2  # step 1 of a 2-step warm-up
    assert set(grads) == set(ref["grads"]) == set(weights)
    for name, g_ref in ref["grads"].items():
        torch.testing.assert_close(grads[name], g_ref, rtol=1e-5, atol=1e-5 * float(g_ref.abs().max()), msg=name)
        moved = g_ref.abs() > 1e-5 * g_ref.abs().max()  # [*]: above the gradient floor
        # 1% of one update step: a wrong lr, clip or Adam setting moves these entries by ~lr
        torch.testing.assert_close(
            weights[name][moved], ref_weights[name][moved], rtol=1e-5, atol=0.01 * LR / 2, msg=name
        )
    d = max_differences({"grads": grads, "weights": weights}, {"weights": ref_weights}, ref["grads"], LR / 2)
    assert d["noise_entries"] < 1e-3 * sum(w.numel() for w in weights.values())  # nearly every entry is compared
    return d


@pytest.mark.slow
@pytest.mark.parametrize("micro", [12, 3], ids=["1-micro-batch", "4-micro-batches"])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_rft_step_equals_reference_step(tiny_model_dir, loss, micro):
    """Each loss type with the config's token-mean aggregation and GRPO advantages."""
    cfg, batch, m, grads, weights = rft_step(tiny_model_dir, {"loss": LOSSES[loss], "aggregation": "token-mean"}, micro)
    ref, ref_weights = reference_step(tiny_model_dir, cfg, batch, micro)
    assert m["attended"] < int(batch["attention_mask"].sum())  # rft ran a group's prompt once per micro-batch
    d = assert_same_step(cfg, m, grads, weights, ref, ref_weights, clipping=loss != "kimi")
    print(f"{loss} x{12 // micro}: loss {m['loss']:.7g} vs {ref['loss']:.7g}, {d}")


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["gspo", "kimi", "dr_grpo"])
def test_presets_equal_the_reference_step(tiny_model_dir, preset):
    """The presets' other knobs, 4 micro-batches: gspo's seq-mean-token-mean, kimi's and dr_grpo's
    advantages without the std, dr_grpo's seq-mean-token-sum over the token budget (the gradient
    below the clip: the update unclipped)."""
    cfg, batch, m, grads, weights = rft_step(tiny_model_dir, {"preset": preset}, 3)
    ref, ref_weights = reference_step(tiny_model_dir, cfg, batch, 3)
    # dr_grpo: each response's token sum / the token budget (64), over 12 responses, where token-mean
    # divides by the batch's 48 tokens: a 16x smaller gradient, under the clip
    d = assert_same_step(
        cfg, m, grads, weights, ref, ref_weights, clipping=preset != "kimi", norm_clipped=preset != "dr_grpo"
    )
    print(f"preset {preset}: loss {m['loss']:.7g} vs {ref['loss']:.7g}, {d}")


@pytest.mark.slow
def test_batch_std_equals_the_reference_step(tiny_model_dir):
    """Group mean, batch std (`advantage.std: batch`), 4 micro-batches."""
    cfg, batch, m, grads, weights = rft_step(tiny_model_dir, {"advantage": {"type": "grpo", "std": "batch"}}, 3)
    assert cfg.algorithm.advantage.std == "batch"
    ref, ref_weights = reference_step(tiny_model_dir, cfg, batch, 3)
    d = assert_same_step(cfg, m, grads, weights, ref, ref_weights, clipping=True)
    print(f"std batch: loss {m['loss']:.7g} vs {ref['loss']:.7g}, {d}")


def test_reference_advantages_by_hand():
    """Groups (1, 0) and (1, 1, 0.1), a group of one (0.5). Centred: +-.5 | .3, .3, -.6 | 0.
    group std: +-.70711 | .57735, .57735, -1.1547 | 0; batch std of the six centred values
    (unbiased, sqrt(1.04 / 5) = .45607): 1.09632, -1.09632, .65779, .65779, -1.31559, 0; none: centred."""
    from rl_engine.algorithms import group_advantages

    r, g = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.1, 0.5]), torch.tensor([0, 0, 1, 1, 1, 2])
    expect = {
        "group": [0.70711, -0.70711, 0.57735, 0.57735, -1.1547, 0.0],
        "batch": [1.09632, -1.09632, 0.65779, 0.65779, -1.31559, 0.0],
        "none": [0.5, -0.5, 0.3, 0.3, -0.6, 0.0],
    }
    for std, values in expect.items():
        torch.testing.assert_close(advantages(r, g, std), torch.tensor(values), rtol=0, atol=1e-5, msg=std)
        torch.testing.assert_close(group_advantages(r, g, "grpo", std), advantages(r, g, std), rtol=0, atol=1e-6)


def test_the_reference_takes_each_std_level_and_refuses_what_it_does_not_implement(tmp_path):
    for std in ("group", "batch", "none"):
        cfg = make_cfg(str(tmp_path), algorithm={"advantage": {"type": "grpo", "std": std}})
        assert RefAlgo.from_config(cfg.algorithm).std == std
    cfg = make_cfg(str(tmp_path), algorithm={"advantage": {"type": "rloo"}, "kl": {"coef": 0.01}})
    with pytest.raises(ValueError, match="does not implement kl, advantage rloo"):
        RefAlgo.from_config(cfg.algorithm)


def test_ppo_clip_token_mean_by_hand():
    """Two responses of one group, rewards (1, 0): A = +-.5 / std(1, 0) = +-.70711 (eps 1e-6: 1.4e-6 off).
    Row 0's tokens have ratios 1.25 (inside 1.28) and 1; row 1's one token 0.5, below 1 - .2 with A < 0:
    clipped to .8. Per token -min(rA, clip(r)A): -.88388, -.70711 | +.56569; token-mean over the
    batch's 3 tokens: -1.02530 / 3 = -.34177 (per-sequence mean would give -.11490)."""
    from rl_engine.algorithms import policy_loss
    from rl_engine.config import AlgorithmConfig

    logp = torch.log(torch.tensor([[1.0, 0.5, 0.25], [1.0, 0.1, 1.0]]))  # [B, L]: column 0 the prompt
    old = torch.log(torch.tensor([[1.0, 0.4, 0.25], [1.0, 0.2, 1.0]]))  # [B, L]
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])  # [B, L]
    hand = (-0.70711 * 1.25 - 0.70711 + 0.70711 * 0.8) / 3
    adv = advantages(torch.tensor([1.0, 0.0]), torch.tensor([7, 7]))  # [B]
    assert adv.tolist() == pytest.approx([0.70711, -0.70711], abs=1e-5)
    algo = RefAlgo(loss="ppo_clip", clip_eps_low=0.2, clip_eps_high=0.28)
    per_token, bound = token_losses(logp, old, adv, mask, algo)  # [B, L] x 2
    assert bound.tolist() == [[False, False, False], [False, True, False]]
    assert float(reduce_loss(per_token, mask, algo, 3.0, 2.0)) == pytest.approx(hand, abs=1e-5)
    assert hand == pytest.approx(-0.34177, abs=1e-5)
    cfg = AlgorithmConfig.model_validate(
        {"loss": {"type": "ppo_clip", "clip_eps_low": 0.2, "clip_eps_high": 0.28}, "aggregation": "token-mean"}
    )
    assert float(policy_loss(logp, old, adv, mask, cfg).loss) == pytest.approx(hand, abs=1e-5)
