"""Partial rollouts on the real vLLM engine: a generation cut into segments and continued by
re-prefill equals the uninterrupted one, and after a weight sync in between its new tokens carry
the new version with logprobs the trainer's model reproduces.

    .venv/bin/python -m pytest tests/rl_engine/sync/test_partial_engine.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rl_engine.buffer import BufferWriter, ContinuationStore
from rl_engine.config import PartialRolloutConfig, SamplingConfig
from rl_engine.rewards import Task, TaskIterator
from rl_engine.roles.partial import PartialRollouts, PartialSettings
from rl_engine.storage import open_storage
from rl_engine.sync import build_weight_receiver, build_weight_sender
from tests.rl_engine.roles.test_partial import run_step
from tests.rl_engine.rollout.engines import MAX_MODEL_LEN, load_hf
from tests.rl_engine.sync.helpers import named_weights, perturbed_hf
from tests.rl_engine.sync.test_checkpoint_sync import _board, _cfg, restore_original  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow

# Re-prefill computes a token's logprob in a prefill pass, the uninterrupted run in a decode
# step; on CPU in fp32 they agree to float rounding. Measured max |diff| ~1e-6.
REPREFILL_TOL = 1e-4
LOGPROB_TOL = 1e-5  # same bound as the sync tests (vLLM vs the trainer's HF forward)
NO_REPEAT = {"repeat_ngram": 1, "repeat_threshold": 1000}  # a random tiny model loops; keep its tokens


def _partial(engine, tmp_path, segment: int, max_response: int, sampling: SamplingConfig) -> PartialRollouts:
    p = PartialRolloutConfig(enabled=True, segment_max_tokens=segment, max_response_tokens=max_response, **NO_REPEAT)
    settings = PartialSettings(
        p, sampling, batch_size=1, repeat_times=2, max_model_len=MAX_MODEL_LEN, template=None, seed=7, explorer_id=0
    )
    tasks = TaskIterator([Task("t", "12+30=", "42")], 1, shuffle=False)
    return PartialRollouts(
        engine,
        ContinuationStore(*open_storage(str(tmp_path), {}), 0, fsync=False),
        tasks,
        lambda *a: 0.0,
        settings,
        first_step=1,
    )


def test_greedy_cut_and_resumed_equals_uninterrupted(engine, tmp_path):
    greedy = SamplingConfig(temperature=0.0, max_tokens=24, stop=[])
    prompt = engine.tokenizer("12+30=", add_special_tokens=False).input_ids
    (whole,) = engine.generate([prompt], 1, greedy, seed=1)[0]
    p = _partial(engine, tmp_path, segment=5, max_response=24, sampling=greedy)
    batch, m = run_step(
        p, BufferWriter(*open_storage(str(tmp_path), {}), 0), 1
    )  # one group: its segments run as extra rounds of step 1
    rows = batch.experiences()
    assert len(rows) == 2 and m["rounds"] >= 2
    for x in rows:
        n = len(whole.response_ids)
        assert x.response_ids == whole.response_ids, (
            "re-prefilled continuation diverged from the uninterrupted generation"
        )
        diff = float(np.max(np.abs(np.array(x.logprobs[:n]) - np.array(whole.logprobs))))
        print(f"re-prefill vs decode: max |logprob diff| = {diff:.2e} over {n} tokens, {x.num_segments} segments")
        assert diff < REPREFILL_TOL
        assert [s["end"] - s["start"] for s in x.segments][:-1] == [5] * (x.num_segments - 1)


def test_after_a_sync_new_tokens_carry_the_new_version_and_the_trainers_logprobs(
    engine,
    tiny_model_dir,
    tmp_path,
    restore_original,  # noqa: F811 - the fixture imported above
):
    sampling = SamplingConfig(temperature=1.0, max_tokens=24)
    cfg = _cfg(tiny_model_dir, str(tmp_path / "sync"))
    sender, receiver = build_weight_sender(cfg, _board(cfg)), build_weight_receiver(cfg, _board(cfg))
    p = _partial(engine, tmp_path, segment=6, max_response=30, sampling=sampling)
    writer = BufferWriter(*open_storage(str(tmp_path), {}), 0)
    # Step 1 with version 0. The random tiny model rarely samples EOS: the first group runs to
    # its 30 tokens in extra rounds, the second (held from the start, 2 in flight) is left cut after its one segment.
    run_step(p, writer, 1)
    pending = [m for g in p.groups for m in g.members if m.finish_reason is None]
    assert pending, "expected a cut generation after step 1"
    trained = perturbed_hf(tiny_model_dir, seed=11)
    sender.send(named_weights(trained), version=1)
    assert receiver.receive(engine) == 1
    resumed_id = pending[0].experience_id
    rows = {}
    for e in range(2, 8):
        rows.update({x.experience_id: x for x in run_step(p, writer, e)[0].experiences()})
        if resumed_id in rows:
            break
    x = rows[resumed_id]
    first, rest = x.segments[0], x.segments[1:]
    assert first["version"] == 0 and rest and all(s["version"] == 1 for s in rest)
    original = load_hf(tiny_model_dir)
    for model, span in (
        (original, slice(first["start"], first["end"])),
        (trained, slice(rest[0]["start"], rest[-1]["end"])),
    ):
        ids = torch.tensor([x.prompt_ids + x.response_ids])  # [1, P + R]
        with torch.no_grad():
            logits = model(ids).logits[0].float()  # [P + R, V]
        lp = torch.log_softmax(logits[len(x.prompt_ids) - 1 : -1], dim=-1).gather(
            -1, torch.tensor(x.response_ids)[:, None]
        )[:, 0]  # [R]
        diff = float((lp[span] - torch.tensor(x.logprobs)[span]).abs().max())
        print(f"segment tokens {span.start}..{span.stop}: max |vLLM - HF| = {diff:.2e}")
        assert diff < LOGPROB_TOL
