"""The synchronous GRPO loop on the demo task: from the warm-started tiny model, a few steps of
GRPO raise the expected reward, with vLLM's behavior logprobs matching the trainer's.

Slow (the session's demo model: its warm start ~15 s on idle cores, once per machine; vLLM start ~10 s):

    .venv/bin/python -m pytest tests/rl_engine/demos/test_loop.py -m slow -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl_engine.trainer.dist import free_port

pytestmark = pytest.mark.slow
STEPS = 10
# Seen with warm-start seed 0: +.051, +.038, +.036 at loop seeds 42, 1, 7; seed-1 warm start: +.089.
# The warm start is trained on the machine, and its numerics follow the CPU's: on a 2-core EPYC
# without AVX-512 the loop started at .388 and gained +.0155 over the 10 steps. Without an update the
# expected reward does not move (it is computed, not sampled), so +.01 still needs learning.
MIN_GAIN = 0.01


@pytest.fixture(scope="module")
def warm_model(demo_model_dir):
    """The demo's model (the tiny model after the SFT warm start, seed 0) and its warmstart.json."""
    summary = json.loads((Path(demo_model_dir) / "warmstart.json").read_text())
    assert summary["seed"] == 0 and summary["max_operand"] == 20, summary  # the defaults the figures below are from
    return demo_model_dir, summary


def test_warm_start_is_partly_right(warm_model):
    _, summary = warm_model
    # seed 0: .43 expected exact-match at temperature 1, .60 greedy: room for GRPO, and signal
    assert 0.2 <= summary["expected_exact_t1"] <= 0.6
    assert summary["greedy_exact"] >= summary["expected_exact_t1"]


def test_grpo_steps_raise_the_expected_reward(warm_model, tmp_path):
    from rl_engine.config import RFTConfig
    from rl_engine.demos.arithmetic import write_arithmetic_taskset
    from rl_engine.demos.loop import run_loop

    model_dir, _ = warm_model
    tasks = write_arithmetic_taskset(str(tmp_path / "tasks.jsonl"), 2000, seed=0)
    cfg = RFTConfig.model_validate(
        {
            "name": "loop-test",
            "seed": 42,
            "model": {"path": model_dir, "max_model_len": 128},
            "taskset": {"path": tasks},
            "algorithm": {"repeat_times": 8, "loss": {"type": "ppo_clip", "clip_eps_high": 0.28}},
            "explorer": {
                "batch_size": 8,
                "sampling": {"temperature": 1.0, "max_tokens": 8},
                "engine": {"kv_cache_space_gib": 0.25, "num_threads": 1},
            },
            "buffer": {"storage": {"url": str(tmp_path / "runs")}},
            "trainer": {"micro_batch_size": 32, "lr": 5e-5, "warmup_steps": 3, "num_threads": 1},
            "synchronizer": {"mode": "synchronous", "sync_method": "collective", "collective": {"port": free_port()}},
        }
    )
    history = run_loop(cfg, STEPS, log=lambda line: None)
    first, last = history[0], history[-1]
    assert [h["step"] for h in history] == list(range(STEPS + 1)) and last["version"] == STEPS
    # On-policy at every step: vLLM's behavior logprobs are the trainer's (float32, CPU), so
    # ratios start at 1 and nothing is clipped before the update.
    for h in history[1:]:
        assert h["logprob_diff"] < 1e-4 and h["clip_frac"] == 0.0, h
    assert last["eval_expected_exact_t1"] >= first["eval_expected_exact_t1"] + MIN_GAIN, [
        round(h["eval_expected_exact_t1"], 3) for h in history
    ]
