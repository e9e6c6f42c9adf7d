"""The warm start's SFT examples and evaluation set (fast; the full warm start runs in test_loop.py).

.venv/bin/python -m pytest tests/rl_engine/demos/test_warmstart.py -q
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.demos.warmstart import all_problems, encode_examples, main
from rl_engine.tiny_model import build_tokenizer


def test_encode_examples_layout():
    tok = build_tokenizer()
    batch = encode_examples(tok, [{"question": "12+7=", "answer": "19"}, {"question": "1+1=", "answer": "2"}])
    # row 0: 5 prompt tokens, "1" "9" EOS; row 1: 4 prompt tokens, "2" EOS, then padding
    ids = batch["input_ids"]
    assert tok.decode(ids[0, :7]) == "12+7=19" and ids[0, 7] == tok.eos_token_id
    assert batch["loss_mask"][0].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert batch["loss_mask"][1].tolist() == [0, 0, 0, 0, 1, 1, 0, 0]
    assert batch["attention_mask"][1].tolist() == [1, 1, 1, 1, 1, 1, 0, 0]
    assert ids[1, 5] == tok.eos_token_id and torch.all(ids[1, 6:] == tok.pad_token_id)


def test_all_problems_cover_the_task_range():
    problems = all_problems(20)
    assert len(problems) == 21 * 21 and {"question": "20+20=", "answer": "40"} in problems


def test_bad_arguments():
    from rl_engine.errors import UserError

    with pytest.raises(UserError, match="--batch-size within 2..1024"):
        main(["/tmp/unused", "--batch-size", "1"])


def test_sft_settings_are_those_of_the_rl_config_warm_start_used_to_fake(tiny_model_dir):
    """Warm start builds its settings from its arguments; they are the values the trainer got
    from the RL config it faked before (so the warm start's figures hold)."""
    from rl_engine.config import RFTConfig
    from rl_engine.demos.warmstart import sft_settings
    from rl_engine.trainer import trainer_settings

    old = RFTConfig.model_validate(
        {
            "seed": 3,
            "model": {"path": tiny_model_dir},
            "taskset": {"path": "unused.jsonl"},
            "algorithm": {"repeat_times": 64},
            "explorer": {"batch_size": 1, "sampling": {"temperature": 1.0}},
            "trainer": {"total_steps": 360, "micro_batch_size": 64, "lr": 1e-3, "warmup_steps": 20, "num_threads": 2},
        }
    )
    new = sft_settings(tiny_model_dir, 64, 1e-3, 20, seed=3, threads=2)
    assert new.model_dump(exclude={"algorithm", "max_response_tokens"}) == trainer_settings(old).model_dump(
        exclude={"algorithm", "max_response_tokens"}
    )  # RL-only fields
    assert new.algorithm.kl is None  # no reference model, as before
    old_eval = RFTConfig.model_validate(
        {"model": {"path": tiny_model_dir}, "taskset": {"path": "unused.jsonl"}, "trainer": {"micro_batch_size": 16}}
    )
    assert sft_settings(tiny_model_dir, 16, 1e-5, 0, seed=42).model_dump(
        exclude={"algorithm", "max_response_tokens"}
    ) == trainer_settings(old_eval).model_dump(exclude={"algorithm", "max_response_tokens"})


@pytest.mark.slow  # a DeepSpeed trainer on CPU: ~10 s on idle cores
def test_warm_start_runs_without_an_rl_config(tmp_path, monkeypatch):
    import json

    from transformers import AutoModelForCausalLM

    from rl_engine.config import RFTConfig

    def no_rl_config(*args, **kwargs):
        raise AssertionError("warm start built an RFTConfig")

    monkeypatch.setattr(RFTConfig, "model_validate", classmethod(no_rl_config))
    monkeypatch.setattr(RFTConfig, "__init__", no_rl_config)
    out = tmp_path / "sft"
    assert (
        main([str(out), "--steps", "3", "--batch-size", "8", "--lr", "1e-3", "--warmup-steps", "1", "--threads", "1"])
        == 0
    )
    summary = json.loads((out / "warmstart.json").read_text())
    assert (summary["steps"], summary["batch_size"], summary["lr"], summary["warmup_steps"]) == (3, 8, 1e-3, 1)
    assert 0.0 < summary["final_loss"] < 10.0 and 0.0 <= summary["expected_exact_t1"] <= 1.0
    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "qwen2"
