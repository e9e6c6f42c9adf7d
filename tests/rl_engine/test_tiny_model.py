"""The tiny test model: HF layout, deterministic per seed, loadable, tokenizer round-trips text."""

from __future__ import annotations

import hashlib
from pathlib import Path

from cli.main import main as rft


def digest(d: str | Path) -> str:
    return hashlib.sha256(Path(d, "model.safetensors").read_bytes()).hexdigest()


def test_layout_and_architecture(tiny_model_dir):
    from transformers import AutoConfig

    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert Path(tiny_model_dir, f).is_file(), f
    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    assert cfg.model_type == "qwen2"
    assert cfg.hidden_size // cfg.num_attention_heads >= 32  # vLLM's CPU build refuses head_dim 16


def test_deterministic_per_seed(tmp_path, tiny_model_dir):
    assert rft(["make-tiny-model", str(tmp_path / "same"), "--seed", "0"]) == 0
    assert rft(["make-tiny-model", str(tmp_path / "other"), "--seed", "1"]) == 0
    assert digest(tmp_path / "same") == digest(tiny_model_dir)
    assert digest(tmp_path / "other") != digest(tiny_model_dir)


def test_tokenizer_round_trips_text_and_has_special_tokens(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "Q: 12+7=?\nA: 19 ok"
    ids = tok(text).input_ids
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text
    assert tok.pad_token_id is not None and tok.eos_token_id is not None and tok.pad_token_id != tok.eos_token_id


def test_transformers_forward_is_finite(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    n = sum(p.numel() for p in model.parameters())
    assert 100_000 < n < 1_000_000
    logits = model(torch.tensor([[5, 6, 7, 8]])).logits  # [1, 4, V]
    assert logits.shape == (1, 4, model.config.vocab_size) and torch.isfinite(logits).all()
