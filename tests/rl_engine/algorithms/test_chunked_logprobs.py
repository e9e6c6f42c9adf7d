"""Chunked logprobs/entropy from hidden states (`chunked_token_logprobs`, `chunked_head_logprobs`)
against `token_logprobs` / `token_entropy` on the full logits hidden @ W.T (+ b): values and
gradients, chunk sizes that do and do not divide the token count, temperature, masks.

    .venv/bin/python -m pytest tests/rl_engine/algorithms/test_chunked_logprobs.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rl_engine.algorithms import chunked_head_logprobs, chunked_token_logprobs, token_entropy, token_logprobs

B, L, H, V = 3, 7, 8, 50  # 3 x 6 = 18 predicted positions


def case(seed: int = 0, bias: bool = False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, L, H, generator=g, dtype=torch.float64).float().requires_grad_()  # [B, L, H]
    weight = (torch.randn(V, H, generator=g) * 0.7).requires_grad_()  # [V, H]
    b = (torch.randn(V, generator=g) * 0.5).requires_grad_() if bias else None  # [V]
    ids = torch.randint(0, V, (B, L), generator=g)  # [B, L]
    upstream = torch.randn(B, L, generator=g)  # [B, L]: a made-up d loss / d logprob
    return hidden, weight, b, ids, upstream


def full_path(hidden, weight, b, ids, temperature, mask=None):
    logits = F.linear(hidden, weight, b)  # [B, L, V]
    logp = token_logprobs(logits, ids, temperature)  # [B, L]
    ent = token_entropy(logits.detach(), temperature)  # [B, L]
    if mask is not None:
        logp, ent = logp * (mask > 0), ent * (mask > 0)
    return logp, ent


def grads(out, upstream, tensors):
    return torch.autograd.grad((out * upstream).sum(), [t for t in tensors if t is not None])


def chunked(kind, hidden, weight, b, ids, temperature, chunk, mask=None):
    if kind == "weight":
        return chunked_token_logprobs(hidden, weight, b, ids, temperature, chunk, mask)
    return chunked_head_logprobs(hidden, lambda h: F.linear(h, weight, b), ids, temperature, chunk, mask)


@pytest.mark.parametrize("kind", ["weight", "head"])
@pytest.mark.parametrize(
    "chunk", [1, 4, 5, 18, 100]
)  # 18 positions: 5 and 4 leave a short last chunk, 100 is one chunk
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_full_logits(kind, chunk, temperature):
    hidden, weight, b, ids, up = case(bias=chunk == 5)
    ref_lp, ref_ent = full_path(hidden, weight, b, ids, temperature)
    lp, ent = chunked(kind, hidden, weight, b, ids, temperature, chunk)
    assert lp.shape == ent.shape == (B, L) and lp.dtype == torch.float32
    assert torch.equal(lp[:, 0], torch.zeros(B)) and torch.equal(ent[:, 0], torch.zeros(B))
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    assert lp.requires_grad and not ent.requires_grad
    for got, want in zip(grads(lp, up, (hidden, weight, b)), grads(ref_lp, up, (hidden, weight, b))):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["weight", "head"])
def test_mask_skips_positions_and_they_hold_zero(kind):
    hidden, weight, b, ids, up = case(seed=1)
    mask = torch.zeros(B, L)
    mask[0, 3:] = 1  # a response after a prompt of 3
    mask[1, 1:4] = 1
    mask[2, 0] = 1  # position 0 has no prediction: stays 0 whatever the mask says
    ref_lp, ref_ent = full_path(hidden, weight, b, ids, 1.3, mask)
    lp, ent = chunked(kind, hidden, weight, b, ids, 1.3, 3, mask)
    assert torch.equal(lp[mask == 0], torch.zeros(int((mask == 0).sum()))) and float(lp[2].detach().abs().sum()) == 0.0
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads(lp, up, (hidden, weight)), grads(ref_lp, up, (hidden, weight))):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_empty_mask_gives_zeros_and_zero_gradients():
    hidden, weight, _, ids, _ = case(seed=2)
    lp, ent = chunked_token_logprobs(hidden, weight, None, ids, 1.0, 4, torch.zeros(B, L))
    assert torch.equal(lp, torch.zeros(B, L)) and torch.equal(ent, torch.zeros(B, L))
    g_h, g_w = torch.autograd.grad(lp.sum(), [hidden, weight], allow_unused=True, materialize_grads=True)
    assert float(g_h.abs().sum()) == 0.0 and float(g_w.abs().sum()) == 0.0


def test_frozen_weight_and_no_grad():
    # The KL reference's head: no gradient to anything, and under no_grad nothing is saved.
    hidden, weight, _, ids, _ = case(seed=3)
    ref_lp, _ = full_path(hidden, weight, None, ids, 1.0)
    with torch.no_grad():
        lp, _ = chunked_token_logprobs(hidden, weight, None, ids, 1.0, 4)
        lp2, _ = chunked_head_logprobs(hidden, lambda h: F.linear(h, weight), ids, 1.0, 4)
    assert not lp.requires_grad and not lp2.requires_grad
    torch.testing.assert_close(lp, ref_lp.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lp2, ref_lp.detach(), atol=1e-5, rtol=1e-5)
    lp3, _ = chunked_token_logprobs(hidden, weight.detach(), None, ids, 1.0, 5)  # gradient to hidden only
    (g_h,) = torch.autograd.grad(lp3.sum(), [hidden])
    (want,) = torch.autograd.grad(ref_lp.sum(), [hidden])
    torch.testing.assert_close(g_h, want, atol=1e-5, rtol=1e-5)


def test_bfloat16_weights_close_to_the_full_path():
    # A bf16 model: logits in bf16 as lm_head gives them, logprobs in float32, gradients in bf16.
    hidden, weight, _, ids, up = case(seed=4)
    h16, w16 = hidden.detach().bfloat16().requires_grad_(), weight.detach().bfloat16().requires_grad_()
    ref_lp, _ = full_path(h16, w16, None, ids, 1.0)
    lp, _ = chunked_token_logprobs(h16, w16, None, ids, 1.0, 5)
    torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=1e-4)
    got, want = grads(lp, up, (h16, w16)), grads(ref_lp, up, (h16, w16))
    assert got[0].dtype == got[1].dtype == torch.bfloat16
    for a, c in zip(got, want):
        torch.testing.assert_close(a.float(), c.float(), atol=2e-2, rtol=2e-2)
