"""The real model (SmolLM2-135M-Instruct: Llama, BPE, chat template, eos = pad = <|im_end|> = 2,
tied embeddings) through what the 0.3M toy model could hide: a real trainer update synced into a
live vLLM engine (collective and checkpoint), tied lm_head after a sync, the vLLM-vs-trainer
logprob gap in float32 (bfloat16: bench.real, whose smoke test bounds it), eos/pad handling in the rows, and the too-long-prompt error.

One engine and one trainer for the module (a real engine start costs ~40 s on two CPU cores).

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/rl_engine/sync/test_real_model.py -x -q
"""

from __future__ import annotations

import pytest
import torch

from harness.real_model import QUESTIONS, chat_prompts, experience_rows, gaps, real_config, real_trainer_settings
from rl_engine.board import Board
from rl_engine.config import SamplingConfig
from rl_engine.errors import UserError
from rl_engine.rewards import Task, encode_task, format_prompt
from rl_engine.rollout.engine import Rollout
from rl_engine.sync import build_weight_receiver, build_weight_sender
from rl_engine.trainer.dist import free_port
from tests.rl_engine.sync.helpers import run_concurrently

# float32 on both sides, CPU: measured max |vLLM - trainer| per-token logprob 6.3e-5 (mean 9.1e-6)
# over 220 sampled response tokens at the base weights; the bound leaves ~15x margin.
LOGPROB_TOL = 1e-3
FP32_MEAN_GAP = 1e-4  # bound on the mean gap of sampled responses in float32 (measured 9.1e-6)
SAMPLING = SamplingConfig(max_tokens=24, temperature=1.0)
FIXED_RESPONSE = "The answer is 4, and that is all."
PROBE_ROWS = [0, 1, 2, 1000, 49151]  # embedding rows compared (eos/pad is 2)
EMBED = "model.embed_tokens.weight"


# ---------------------------------------------------------------- unit (tokenizer only)


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_chat_template_is_applied_once_and_adds_no_second_special_token(tok):
    text, ids = encode_task(tok, None, Task("t#1", "What is 2+2?", None), 256)
    assert text == format_prompt(tok, None, "What is 2+2?")
    assert text.count("<|im_start|>system") == 1 and text.count("<|im_start|>user") == 1
    assert text.endswith("<|im_start|>assistant\n")
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == im_start and tok.decode(ids[:2]) == "<|im_start|>system"
    assert ids.count(im_start) == 3  # system, user, assistant: nothing added in front
    assert tok.decode(ids) == text


def test_eos_is_trained_and_padding_after_it_is_masked(tok):
    """A response ending in <|im_end|> (eos = pad = 2), in a batch with a longer row: the eos token is
    trained with its behavior logprob where the trainer computes it; the pads after it (also 2) are not."""
    eos = tok.eos_token_id
    assert eos == tok.pad_token_id == 2
    prompt = chat_prompts(tok, [QUESTIONS[0]])[0]
    short = tok("4.", add_special_tokens=False).input_ids + [eos]
    long = tok("The answer is four, of course.", add_special_tokens=False).input_ids + [eos]
    rollouts = [Rollout(prompt, r, [-0.1 * (k + 1) for k in range(len(r))], "stop", 0) for r in (short, long)]
    t = experience_rows([rollouts]).to_tensors(pad_id=tok.pad_token_id)
    p, n, L = len(prompt), len(short), t["input_ids"].shape[1]
    assert p + len(long) == L
    row = 0
    assert t["input_ids"][row, p : p + n].tolist() == short
    assert t["input_ids"][row, p + n - 1] == eos and t["loss_mask"][row, p + n - 1] == 1  # eos is trained
    # Its behavior logprob sits at its own position: the trainer's token_logprobs puts logprob(token i | < i) there.
    assert t["behavior_logprobs"][row, p + n - 1] == pytest.approx(-0.1 * n)
    assert (t["input_ids"][row, p + n :] == 2).all()  # padding with the same id as eos ...
    assert (t["attention_mask"][row, p + n :] == 0).all() and (
        t["loss_mask"][row, p + n :] == 0
    ).all()  # ... masked everywhere
    assert t["attention_mask"][row, : p + n].all() and t["loss_mask"][row, :p].sum() == 0
    assert t["loss_mask"][1, p:].sum() == len(long) and t["attention_mask"][1].all()
    from rl_engine.algorithms import token_logprobs

    logits = torch.randn(2, L, 8)
    ids = t["input_ids"].clamp(max=7)
    lp = token_logprobs(logits, ids)
    want = torch.log_softmax(logits[row, p + n - 2], -1)[ids[row, p + n - 1]]
    assert lp[row, p + n - 1] == pytest.approx(float(want), abs=1e-6)


def test_a_prompt_longer_than_the_context_names_its_task_and_the_fix(tok):
    task = Task("tasks.jsonl#7", "word " * 300, None)
    with pytest.raises(UserError) as e:
        encode_task(tok, None, task, 256)
    msg = str(e.value)
    assert "'tasks.jsonl#7'" in msg and "model.max_model_len = 256" in msg and "raise model.max_model_len" in msg
    assert "shorten that task's prompt" in msg


# ---------------------------------------------------------------- real engine + trainer


@pytest.fixture(scope="module")
def real_engine(smollm2_dir, real_model_module_turn):
    from rl_engine.rollout.engine import build_rollout_engine

    eng = build_rollout_engine(real_config(smollm2_dir))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def real_trainer(smollm2_dir, real_model_module_turn):
    from rl_engine.trainer import build_trainer

    return build_trainer(real_trainer_settings(real_config(smollm2_dir)))


def _fixed(tok) -> list[tuple[list[int], list[int]]]:
    response = tok(FIXED_RESPONSE, add_special_tokens=False).input_ids + [tok.eos_token_id]
    return [(p, response) for p in chat_prompts(tok, QUESTIONS[:3])]


def engine_fixed_logprobs(engine, fixed) -> torch.Tensor:
    """The engine's logprobs of the fixed responses' tokens, concatenated [T]."""
    out = engine.prompt_logprobs([p + r for p, r in fixed])
    return torch.tensor([x for (p, r), lps in zip(fixed, out) for x in lps[len(p) - 1 :]])


def trainer_fixed_logprobs(trainer, fixed) -> torch.Tensor:
    parts = []
    for p, r in fixed:
        ids = torch.tensor([p + r])
        lp = trainer.compute_logprobs({"input_ids": ids, "attention_mask": torch.ones_like(ids)}).cpu()[0]  # [P + R]
        parts.append(lp[len(p) :])
    return torch.cat(parts)


def probe(engine) -> dict:
    [got] = engine.rpc("rft_weight_probe", [EMBED, "lm_head.weight"], PROBE_ROWS, timeout=60)
    for name in (EMBED, "lm_head.weight"):
        got[name]["rows"] = torch.tensor(got[name]["rows"])
    return got


def trainer_rows(trainer) -> torch.Tensor:
    return dict(trainer.named_weights())[EMBED][PROBE_ROWS].float().cpu()


def train_one_step(engine, trainer) -> dict:
    """A real GRPO update from the engine's own rollouts (rewards 1 and 0 in the group)."""
    [prompt] = chat_prompts(engine.tokenizer, [QUESTIONS[1]])
    groups = engine.generate([prompt], 2, SAMPLING, seed=100 + trainer.version)
    return trainer.train_step(experience_rows(groups).to_tensors(trainer.pad_token_id))


def check_synced(engine, trainer, before: torch.Tensor, before_rows: torch.Tensor) -> None:
    fixed = _fixed(engine.tokenizer)
    after, want = engine_fixed_logprobs(engine, fixed), trainer_fixed_logprobs(trainer, fixed)
    d = (after - want).abs()
    changed = (after - before).abs().max().item()
    sampled = gaps(trainer, engine.generate(chat_prompts(engine.tokenizer, QUESTIONS[:4]), 1, SAMPLING, seed=7))
    print(
        f"after sync to v{engine.version}: fixed response |vLLM - trainer| max {d.max():.2e} mean {d.mean():.2e} over {len(d)} tokens; "
        f"moved by up to {changed:.2e}; sampled max {sampled['max']:.2e} mean {sampled['mean']:.2e} over {sampled['tokens']}"
    )
    assert d.max() < LOGPROB_TOL and sampled["max"] < LOGPROB_TOL
    assert changed > 10 * LOGPROB_TOL  # the engine's logits really moved
    got = probe(engine)
    assert got["tied"] and got["lm_head_equal"], got  # lm_head is still the embedding, with its new values
    assert torch.equal(got[EMBED]["rows"], trainer_rows(trainer)) and torch.equal(
        got["lm_head.weight"]["rows"], trainer_rows(trainer)
    )
    assert not torch.equal(got[EMBED]["rows"], before_rows)


@pytest.mark.slow
def test_fp32_engine_matches_the_trainer_before_any_update(real_engine, real_trainer):
    """Both at the base weights: the gap of sampled chat responses, and the tied head as loaded."""
    prompts = chat_prompts(real_engine.tokenizer, QUESTIONS)
    g = gaps(real_trainer, real_engine.generate(prompts, 1, SamplingConfig(max_tokens=32, temperature=1.0), seed=3))
    print(f"float32 gap: mean {g['mean']:.2e} max {g['max']:.2e} over {g['tokens']} tokens")
    assert g["tokens"] > 50 and g["mean"] < FP32_MEAN_GAP and g["max"] < LOGPROB_TOL
    got = probe(real_engine)
    assert got["tied"] and got["lm_head_equal"]
    assert torch.equal(got[EMBED]["rows"], trainer_rows(real_trainer))
    assert "lm_head.weight" not in dict(real_trainer.named_weights())  # the trainer sends the tied weight once


@pytest.mark.slow
def test_collective_sync_of_a_trainer_update(real_engine, real_trainer, smollm2_dir, tmp_path):
    cfg = real_config(
        smollm2_dir,
        synchronizer={
            "sync_method": "collective",
            "collective": {"port": free_port(), "bucket_mb": 16, "timeout_s": 120},
        },
    )
    before, before_rows = (
        engine_fixed_logprobs(real_engine, _fixed(real_engine.tokenizer)),
        probe(real_engine)[EMBED]["rows"],
    )
    train_one_step(real_engine, real_trainer)
    v = real_trainer.version
    board = Board.at(str(tmp_path))
    sender, receiver = build_weight_sender(cfg, board), build_weight_receiver(cfg, board)
    run_concurrently(sender.connect, lambda: receiver.connect(real_engine), timeout=240)
    try:
        got = run_concurrently(
            lambda: (sender.prepare(v), sender.send(real_trainer.named_weights(), v)),
            lambda: (receiver.prepare(v), receiver.receive(real_engine, v))[1],
            timeout=240,
        )
        assert got[1] == v == real_engine.version
    finally:
        receiver.close()
        sender.close()
    check_synced(real_engine, real_trainer, before, before_rows)


@pytest.mark.slow
def test_checkpoint_sync_of_a_trainer_update(real_engine, real_trainer, smollm2_dir, tmp_path):
    cfg = real_config(
        smollm2_dir, name="run", buffer={"storage": {"url": str(tmp_path)}}, synchronizer={"sync_method": "checkpoint"}
    )
    before, before_rows = (
        engine_fixed_logprobs(real_engine, _fixed(real_engine.tokenizer)),
        probe(real_engine)[EMBED]["rows"],
    )
    train_one_step(real_engine, real_trainer)
    v = real_trainer.version
    board = Board.at(cfg.run_url)
    build_weight_sender(cfg, board).send(real_trainer.named_weights(), v)
    assert build_weight_receiver(cfg, board).receive(real_engine, v) == v == real_engine.version
    check_synced(real_engine, real_trainer, before, before_rows)
