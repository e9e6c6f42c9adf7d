"""rl_engine.roles.explorer.EnginePool: a warm engine is reused only by a run whose engine would be
the same: one serving a LoRA adapter is never handed to a run of the plain model, nor the reverse
(CI found a LoRA run handed a kept plain engine, whose workers then refused the adapter's tensors)."""

from __future__ import annotations

from types import SimpleNamespace

from rl_engine.config import validate_config
from rl_engine.roles.explorer import EnginePool


def run_of(model_dir: str, lora: dict | None) -> SimpleNamespace:
    cfg = validate_config({"model": {"path": model_dir, "lora": lora}, "taskset": {"path": "t.jsonl"}})
    return SimpleNamespace(cfg=cfg)


def test_a_lora_engine_and_a_plain_one_are_kept_apart(tmp_path):
    plain = EnginePool._key(run_of(str(tmp_path), None), 0)
    adapter = EnginePool._key(run_of(str(tmp_path), {"rank": 8}), 0)
    other_rank = EnginePool._key(run_of(str(tmp_path), {"rank": 16}), 0)
    merged = EnginePool._key(run_of(str(tmp_path), {"rank": 8, "sync": "merged"}), 0)
    assert len({plain, adapter, other_rank}) == 3
    assert merged == plain  # `sync: merged` serves the plain model: its engine is the plain one
