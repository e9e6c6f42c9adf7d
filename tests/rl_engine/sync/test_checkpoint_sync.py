"""Checkpoint sync: committed safetensors checkpoints on storage, loaded into a live vLLM engine.

.venv/bin/python -m pytest tests/rl_engine/sync/test_checkpoint_sync.py -q
"""

from __future__ import annotations

import json

import pytest
import torch

from rl_engine import storage
from rl_engine.board import Board
from rl_engine.storage import open_storage
from rl_engine.sync import build_weight_receiver, build_weight_sender
from rl_engine.sync.checkpoint import COMMIT, CheckpointReceiver, CheckpointSender
from tests.rl_engine.rollout.engines import load_hf, make_config, max_logprob_diff
from tests.rl_engine.sync.helpers import named_weights, perturbed_hf, rollouts

LOGPROB_TOL = 1e-5
CHANGED = 1e-2


def _board(cfg) -> Board:
    return Board.at(cfg.run_url, cfg.buffer.storage.options)


def _cfg(model_dir: str, url: str, options: dict | None = None):
    return make_config(
        model_dir,
        name="run",
        buffer={"storage": {"url": url, "options": options or {}}},
        synchronizer={"sync_method": "checkpoint"},
    )


# ---------------------------------------------------------------- fast (no engine)


def test_sharded_checkpoint_is_an_hf_model_dir(tiny_model_dir, tmp_path):
    trained = perturbed_hf(tiny_model_dir, seed=2)
    sender = CheckpointSender(
        *open_storage(str(tmp_path / "run"), None),
        tiny_model_dir,
        torch.float32,
        Board.at(str(tmp_path / "run")),
        1,
        30,
        shard_bytes=200_000,
    )
    sender.send(named_weights(trained), version=4)
    d = tmp_path / "run" / "checkpoints" / "version=4"
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    assert json.loads((d / COMMIT).read_text())["version"] == 4
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    for (name, want), (_, got) in zip(trained.state_dict().items(), back.state_dict().items()):
        assert torch.equal(want, got), name


def test_writer_that_dies_commits_nothing(tiny_model_dir, tmp_path):
    board = Board.at(str(tmp_path / "run"))
    sender = CheckpointSender(*open_storage(str(tmp_path / "run"), None), tiny_model_dir, torch.float32, board, 1, 30)
    receiver = CheckpointReceiver(*open_storage(str(tmp_path / "run"), None), board)

    def dies_midway():
        yield from named_weights(load_hf(tiny_model_dir))[:3]
        raise RuntimeError("trainer killed")

    with pytest.raises(RuntimeError, match="trainer killed"):
        sender.send(dies_midway(), version=1)
    assert receiver.latest_committed() is None
    sender.send(named_weights(load_hf(tiny_model_dir)), version=2)
    assert receiver.committed_versions() == [2]


def test_a_reload_keeps_only_the_warnings_that_mean_something():
    """vLLM warns "<Layer>: Failed to load weights" at every reload for layers a checkpoint never
    holds (rotary caches; a tied model's lm_head, rebuilt after the load): those are dropped, every
    other layer's, and an untied head's, come through. (The live check: the worker-run test reads
    the run's engines.log, tests/deployments/test_live_operations.py.)"""
    import logging

    from rl_engine.sync.worker_ext import _ExpectedNotLoaded

    def passes(layer: str, tied: bool) -> bool:
        record = logging.LogRecord("vllm", logging.WARNING, __file__, 1, "%s: Failed to load weights", (layer,), None)
        return _ExpectedNotLoaded(tied_head=tied).filter(record)

    assert not passes("RotaryEmbedding", tied=False) and not passes("Llama3RotaryEmbedding", tied=False)
    assert not passes("ParallelLMHead", tied=True) and passes("ParallelLMHead", tied=False)
    assert passes("QKVParallelLinear", tied=True) and passes("VocabParallelEmbedding", tied=True)


# ---------------------------------------------------------------- real engine


@pytest.fixture
def restore_original(engine, tiny_model_dir, tmp_path):
    """Put the shared engine back to the original weights as version 0 after the test."""
    yield
    cfg = _cfg(tiny_model_dir, str(tmp_path / "restore"))
    build_weight_sender(cfg, _board(cfg)).send(named_weights(load_hf(tiny_model_dir)), version=0)
    assert build_weight_receiver(cfg, _board(cfg)).receive(engine, version=0) == 0


@pytest.mark.slow
def test_checkpoint_sync_loads_only_committed_versions(engine, tiny_model_dir, tmp_path, restore_original):
    cfg = _cfg(tiny_model_dir, str(tmp_path))
    sender, receiver = build_weight_sender(cfg, _board(cfg)), build_weight_receiver(cfg, _board(cfg))
    original, trained = load_hf(tiny_model_dir), perturbed_hf(tiny_model_dir, seed=3)
    assert engine.version == 0 and receiver.latest_committed() is None
    assert receiver.receive(engine) == 0  # nothing published yet: nothing loaded

    sender.send(named_weights(trained), version=1)
    assert receiver.latest_committed() == 1
    assert receiver.receive(engine) == 1 == engine.version
    after = rollouts(engine)
    d_trained, d_original = max_logprob_diff(trained, after, 1.0), max_logprob_diff(original, after, 1.0)
    print(f"after checkpoint sync max |diff| vs trained {d_trained:.2e}, vs original {d_original:.2e}")
    assert d_trained < LOGPROB_TOL and d_original > CHANGED
    assert all(r.version == 1 for g in after for r in g)

    # Version 2 written but never committed (the trainer died before the marker).
    sender.send(named_weights(perturbed_hf(tiny_model_dir, seed=4)), version=2)
    storage.open_storage(str(tmp_path))[0].rm(f"{tmp_path}/run/checkpoints/version=2/{COMMIT}")
    assert receiver.latest_committed() == 1
    assert receiver.receive(engine) == 1  # newest committed is what the engine has: no reload
    with pytest.raises(RuntimeError, match="version 2 .* is not committed"):
        receiver.receive(engine, version=2)
    assert engine.version == 1
    assert max_logprob_diff(trained, rollouts(engine), 1.0) < LOGPROB_TOL


@pytest.mark.slow
def test_checkpoint_sync_through_s3(engine, tiny_model_dir, s3_bucket, restore_original):
    url, options = s3_bucket
    cfg = _cfg(tiny_model_dir, url, options)
    trained = perturbed_hf(tiny_model_dir, seed=5)
    build_weight_sender(cfg, _board(cfg)).send(named_weights(trained), version=3)
    assert build_weight_receiver(cfg, _board(cfg)).receive(engine) == 3 == engine.version
    assert max_logprob_diff(trained, rollouts(engine), 1.0) < LOGPROB_TOL


@pytest.mark.slow
def test_profiled_reload_installs_the_weights_and_reports_its_parts(engine, tiny_model_dir, tmp_path, restore_original):
    """bench.sync's profile of the in-place reload (worker_ext.rft_profile_reload) is a real reload."""
    trained = perturbed_hf(tiny_model_dir, seed=6)
    trained.save_pretrained(str(tmp_path))
    [parts] = engine.rpc("rft_profile_reload", str(tmp_path), timeout=120)
    assert max_logprob_diff(trained, rollouts(engine), 1.0) < LOGPROB_TOL
    assert engine.version == 0  # a benchmark's reload installs no version
    assert set(parts) == {"reload", "pack", "copy"}
    assert parts["reload"] > 0 and parts["copy"] > 0
    if not torch.cuda.is_available():
        assert parts["pack"] > 0  # vLLM's CPU linear layers are oneDNN handles, rebuilt on every reload
