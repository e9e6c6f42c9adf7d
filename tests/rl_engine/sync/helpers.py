"""Helpers of the sync tests: perturbed HF models and concurrent trainer/explorer threads."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

import torch

from rl_engine.config import SamplingConfig
from tests.rl_engine.rollout.engines import load_hf

SAMPLING = SamplingConfig(max_tokens=16, temperature=1.0)
PROMPTS = ["12+30=", "hello world", "x"]


def perturbed_hf(model_dir: str, seed: int, scale: float = 0.05):
    """The tiny model with N(0, scale^2) noise on every parameter (the 'trained' weights)."""
    hf = load_hf(model_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in hf.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return hf


def named_weights(hf) -> list[tuple[str, torch.Tensor]]:
    """What the trainer's named_weights() yields: (HF name, full tensor), tied lm_head included."""
    return list(hf.state_dict().items())


def rollouts(engine, seed: int = 1):
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    return engine.generate(prompts, n=2, sampling=SAMPLING, seed=seed)


def run_concurrently(*calls: Callable[[], Any], timeout: float = 180) -> list[Any]:
    """Run each call in its own thread (trainer + explorers); their results in order.

    A side that hangs fails the test after `timeout` instead of blocking the session on
    executor shutdown (the stuck thread is left behind).
    """
    ex = ThreadPoolExecutor(len(calls))
    try:
        futures = [ex.submit(c) for c in calls]
        done, pending = wait(futures, timeout=timeout, return_when=FIRST_EXCEPTION)
        for f in done:
            if f.exception() is not None:
                raise f.exception()  # the first side that failed, not the peer that then timed out
        if pending:
            raise TimeoutError(f"{len(pending)} of {len(calls)} concurrent sides still running after {timeout} s")
        return [f.result() for f in futures]
    finally:
        ex.shutdown(wait=False, cancel_futures=True)
