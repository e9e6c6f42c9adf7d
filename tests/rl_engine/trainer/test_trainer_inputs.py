"""Bad inputs to the trainer fail early with a clear UserError (no DeepSpeed start needed).

.venv/bin/python -m pytest tests/rl_engine/trainer/test_trainer_inputs.py -q
"""

from __future__ import annotations

import json
import shutil

import pytest
from pydantic import ValidationError
from trainer_helpers import make_cfg

from rl_engine.errors import UserError
from rl_engine.trainer import build_trainer, trainer_settings


def test_missing_model_path(tiny_model_dir, tmp_path):
    cfg = make_cfg(tiny_model_dir)
    cfg.model.path = str(tmp_path / "nowhere")  # the config validator ran earlier; the directory went away since
    with pytest.raises(UserError, match="nowhere.*not found or has no config.json"):
        build_trainer(trainer_settings(cfg))


def test_tokenizer_without_pad_token(tiny_model_dir, tmp_path):
    model = tmp_path / "nopad"
    shutil.copytree(tiny_model_dir, model)
    tok_cfg = json.loads((model / "tokenizer_config.json").read_text())
    tok_cfg["pad_token"] = None  # absent, Qwen2Tokenizer would fall back to EOS; explicit null has none
    (model / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    with pytest.raises(UserError, match="has no pad token"):
        build_trainer(trainer_settings(make_cfg(str(model))))


@pytest.mark.parametrize("micro,ranks", [(3, 1), (2, 4)])
def test_batch_size_not_multiple_of_micro_batch_times_ranks(tiny_model_dir, micro, ranks):
    with pytest.raises(
        ValidationError,
        match=rf"train_batch_size = 4 must be a multiple of trainer.micro_batch_size = {micro} x trainer.num_ranks = {ranks}",
    ):
        make_cfg(tiny_model_dir, trainer={"micro_batch_size": micro, "num_ranks": ranks})  # train_batch_size 4
    # A hand-started torchrun may give the trainer another world size than the config's: it checks again.
    cfg = make_cfg(tiny_model_dir, trainer={"micro_batch_size": 4})
    cfg.trainer.micro_batch_size = 3
    with pytest.raises(
        UserError, match="train_batch_size = 4 must be a multiple of trainer.micro_batch_size = 3 x world size 1"
    ):
        build_trainer(trainer_settings(cfg))


def test_dist_env_inherited_from_a_parent_trainer_is_replaced(monkeypatch):
    import os

    import torch.distributed

    from rl_engine.trainer import dist

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)  # as in a fresh process
    monkeypatch.setattr(dist, "free_port", lambda: 45678)
    # A launcher's variables (no owner mark) are kept.
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500", "MASTER_ADDR": "10.0.0.1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv(dist.OWNER, raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    dist.ensure_dist_env()
    assert (os.environ["RANK"], os.environ["MASTER_PORT"], os.environ["LOCAL_RANK"]) == ("1", "29500", "1")
    # What a parent process filled in for its own one-process world (it still holds that port) is replaced.
    monkeypatch.setenv(dist.OWNER, str(os.getpid() + 1))
    monkeypatch.setenv("RANK", "0"), monkeypatch.setenv("WORLD_SIZE", "1"), monkeypatch.setenv("MASTER_PORT", "31337")
    dist.ensure_dist_env()
    assert (os.environ["MASTER_PORT"], os.environ[dist.OWNER], os.environ["WORLD_SIZE"]) == (
        "45678",
        str(os.getpid()),
        "1",
    )
    # ... and then kept on later calls in this process.
    monkeypatch.setattr(dist, "free_port", lambda: 1)
    dist.ensure_dist_env()
    assert os.environ["MASTER_PORT"] == "45678"


def test_a_trainer_alone_in_its_process_trains_on_the_plans_device(monkeypatch):
    """ensure_dist_env(local_device): the one rank of this process's own world gets LOCAL_RANK =
    the device the run's plan gives it (rl_engine.run.devices), also for a second trainer in the
    process; a launcher's LOCAL_RANK (torchrun: CUDA_VISIBLE_DEVICES already narrowed) is kept."""
    import os

    import torch.distributed

    from rl_engine.trainer import dist

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR", dist.OWNER):
        monkeypatch.delenv(k, raising=False)
    dist.ensure_dist_env(local_device=2)
    assert (os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]) == ("2", "1")
    dist.ensure_dist_env(local_device=1)  # a later trainer of this process, on another device
    assert os.environ["LOCAL_RANK"] == "1"
    monkeypatch.delenv(dist.OWNER)
    monkeypatch.setenv("RANK", "1"), monkeypatch.setenv("WORLD_SIZE", "2"), monkeypatch.setenv("LOCAL_RANK", "1")
    dist.ensure_dist_env(local_device=5)
    assert os.environ["LOCAL_RANK"] == "1"
