"""Weights out of the trainer: HF directories (save_hf), named_weights, resumable state.

.venv/bin/python -m pytest tests/rl_engine/trainer/test_trainer_checkpoint.py -q
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from trainer_helpers import make_batch, make_cfg

from rl_engine.errors import UserError
from rl_engine.trainer import build_trainer, trainer_settings

pytestmark = pytest.mark.slow


def test_save_hf_round_trip(shared_trainer, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tr = shared_trainer
    tr.train_step(make_batch(tr))  # weights differ from the initial ones on disk
    out = tmp_path / "hf"
    tr.save_hf(str(out))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()
    }
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.pad_token_id == tr.pad_token_id and tok.eos_token_id == tr.tokenizer.eos_token_id
    batch = make_batch(seed=4)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # [B, L, V]
        ours = tr.engine.module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(logits, ours, rtol=0, atol=1e-6)
    # and the saved weights are the trained ones, not the initial model's
    initial = AutoModelForCausalLM.from_pretrained(tr.settings.model_path, dtype=torch.float32)
    assert not torch.equal(initial.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_save_hf_under_zero3_gathers_the_trained_weights(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    tr = build_trainer(trainer_settings(make_cfg(tiny_model_dir, trainer={"zero_stage": 3})))
    batch = make_batch(tr)
    tr.train_step(batch)
    tr.save_hf(str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # [B, L, V]
    expected = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]  # [B, L-1]
    real = batch["attention_mask"][:, 1:] > 0  # [B, L-1]; padding past a row's micro-batch is not run
    torch.testing.assert_close(tr.compute_logprobs(batch)[:, 1:][real], expected[real], rtol=0, atol=1e-5)
    assert not torch.allclose(
        batch["behavior_logprobs"][:, 1:] * batch["loss_mask"][:, 1:], expected * batch["loss_mask"][:, 1:], atol=1e-5
    )


def test_save_hf_through_fsspec(shared_trainer):
    import fsspec

    shared_trainer.save_hf("memory://rft-test/hf")
    fs = fsspec.filesystem("memory")
    names = {p.rsplit("/", 1)[1] for p in fs.ls("/rft-test/hf", detail=False)}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert json.loads(fs.cat_file("/rft-test/hf/config.json"))["model_type"] == "qwen2"


def test_named_weights_are_hf_names(shared_trainer, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    expected = {k for k, _ in hf.named_parameters()}  # tied lm_head appears once, as embed_tokens
    got = dict(shared_trainer.named_weights())
    assert set(got) == expected
    assert got["model.embed_tokens.weight"].shape == hf.model.embed_tokens.weight.shape


@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_resume_gives_the_identical_next_step(tiny_model_dir, tmp_path, zero_stage):
    # save after step 1, train steps 2 and 3; warmup 4: the LR differs at every step, so a scheduler that restarts is caught too
    cfg = make_cfg(tiny_model_dir, trainer={"zero_stage": zero_stage, "warmup_steps": 4})
    batches = [make_batch(seed=s) for s in (10, 11, 12)]
    state_url = str(tmp_path / "state")

    first = build_trainer(trainer_settings(cfg))
    first.train_step(batches[0])
    first.save_state(state_url, extra={"cursor": {"offset": 4}})
    expected = [
        first.train_step(batches[1]),
        first.train_step(batches[2]),
    ]  # step 3: the LR scheduler's own state shows
    expected_weights = {k: v.clone() for k, v in first.named_weights()}

    second = build_trainer(trainer_settings(cfg))
    assert second.version == 0
    extra = second.load_state(state_url)
    assert extra == {"cursor": {"offset": 4}} and second.version == 1
    got = [second.train_step(batches[1]), second.train_step(batches[2])]
    assert second.version == 3
    assert got == expected
    for name, value in second.named_weights():
        assert torch.equal(value, expected_weights[name]), name


def test_state_files_hold_no_pickle(shared_trainer, tmp_path):
    shared_trainer.save_state(str(tmp_path / "s"), extra={})
    names = sorted(p.name for p in (tmp_path / "s").iterdir())
    assert names == ["COMMITTED", "model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json"]
    # every file is plain JSON or safetensors (which refuses anything else): no pickle anywhere
    for p in (tmp_path / "s").iterdir():
        if p.suffix == ".safetensors":
            assert load_file(p)
        else:
            json.loads(p.read_text())


def test_load_uncommitted_state_fails(shared_trainer, tmp_path):
    shared_trainer.save_state(str(tmp_path / "s"), extra={})
    (tmp_path / "s" / "COMMITTED").unlink()
    with pytest.raises(UserError, match="no committed trainer state"):
        shared_trainer.load_state(str(tmp_path / "s"))
