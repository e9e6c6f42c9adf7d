"""The warm start's SFT examples and evaluation set (fast; the full warm start runs in test_loop.py).

    .venv/bin/python -m pytest tests/rl_engine/trainer/test_warmstart.py -q
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.tiny_model import build_tokenizer
from rl_engine.warmstart import all_problems, encode_examples, main


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
