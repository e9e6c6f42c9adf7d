"""rl_engine/model_dir.py: the one model-directory check the engine, the trainer, preflight and `rft demo` share."""

from __future__ import annotations

import pytest

from rl_engine.errors import UserError
from rl_engine.model_dir import is_model_dir, require_model_dir


def test_a_model_directory_passes_and_comes_back_expanded(tiny_model_dir):
    assert is_model_dir(tiny_model_dir) and require_model_dir(tiny_model_dir) == tiny_model_dir


def test_missing_or_without_config_names_the_field_and_the_fix(tmp_path):
    with pytest.raises(
        UserError, match=r"model\.path = '.*gone': model directory '.*gone' does not exist.*rft make-tiny-model"
    ):
        require_model_dir(str(tmp_path / "gone"))
    assert not is_model_dir(tmp_path)
    with pytest.raises(
        UserError, match=r"model\.path = .* has no config\.json; model\.path must be a Hugging Face model directory"
    ):
        require_model_dir(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(
        UserError,
        match=r"model\.path = '.*config\.json': '.*config\.json' is a file, not a directory; point model\.path at",
    ):
        require_model_dir(f"{tmp_path}/config.json")


def test_a_tokenizer_directory_needs_no_config(tmp_path):
    assert require_model_dir(str(tmp_path), "model.tokenizer_path", config=False) == str(tmp_path)
    with pytest.raises(
        UserError,
        match=r"model\.tokenizer_path = '.*gone': model directory '.*gone' does not exist.*point model\.tokenizer_path at",
    ):
        require_model_dir(str(tmp_path / "gone"), "model.tokenizer_path", config=False)
