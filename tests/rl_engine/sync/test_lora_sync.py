"""Adapter-only weight sync into a live vLLM engine serving the base model with LoRA (model.lora):
the engine's version 0 is the base model exactly; each synced version's adapter, by broadcast or by
checkpoint (full and delta, in peft's layout), is installed in place in the engine's one slot, and
its behavior logprobs are the trainer's (a peft model); 1,000 installs grow neither the engine's
adapters nor its memory; loading the base model again drops the adapter.

One LoRA engine for the module (a different engine from the suite's shared ones: LoRA is an engine
start option).

    .venv/bin/python -m pytest tests/rl_engine/sync/test_lora_sync.py -q
"""

from __future__ import annotations

import json

import pytest
import torch

from rl_engine.board import Board
from rl_engine.config import LoRAConfig
from rl_engine.rollout.engine import build_rollout_engine
from rl_engine.sync import build_weight_receiver, build_weight_sender
from rl_engine.trainer.dist import free_port
from rl_engine.trainer.lora import adapter_weights, wrap
from tests.rl_engine.rollout.engines import load_hf, make_config, max_logprob_diff
from tests.rl_engine.sync.helpers import rollouts, run_concurrently

pytestmark = pytest.mark.slow

LORA = {"rank": 4, "alpha": 16.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}
LOGPROB_TOL = 1e-4  # fp32 both sides; measured ~5e-7
CHANGED = 1e-2  # an adapter of this size moves logprobs by far more


def lora_config(model_dir: str, **sections):
    return make_config(model_dir, model={"path": model_dir, "max_model_len": 128, "lora": LORA}, **sections)


def trained_peft(model_dir: str, seed: int, scale: float = 0.3):
    """The tiny model with a LoRA adapter of N(0, scale^2) values (the trainer's after some steps)."""
    model = wrap(load_hf(model_dir), LoRAConfig(**LORA))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model.eval()


@pytest.fixture(scope="module")
def lora_engine(tiny_model_dir):
    eng = build_rollout_engine(lora_config(tiny_model_dir))
    yield eng
    eng.close()


def test_version_0_is_the_base_model_exactly(lora_engine, tiny_model_dir):
    assert max_logprob_diff(load_hf(tiny_model_dir), rollouts(lora_engine), 1.0) < LOGPROB_TOL
    [probe] = lora_engine.rpc("rft_adapter_probe")
    assert probe["adapters"] == [1] and probe["slots"] == [1] and probe["slot_abs_sum"] == 0.0


def test_collective_sync_sends_the_adapter_only_and_the_engine_serves_it(lora_engine, tiny_model_dir, tmp_path):
    cfg = lora_config(
        tiny_model_dir,
        synchronizer={"mode": "fully_async", "sync_method": "collective", "collective": {"port": free_port()}},
    )
    trained, base = trained_peft(tiny_model_dir, seed=1), load_hf(tiny_model_dir)
    board = Board.at(str(tmp_path))
    sender, receiver = build_weight_sender(cfg, board), build_weight_receiver(cfg, board)
    run_concurrently(sender.connect, lambda: receiver.connect(lora_engine))
    try:
        for v in (1, 2):
            model = trained if v == 1 else trained_peft(tiny_model_dir, seed=2)
            got = run_concurrently(
                lambda: (sender.prepare(v), sender.send(adapter_weights(model), version=v)),
                lambda: (receiver.prepare(v), receiver.receive(lora_engine))[1],
            )
            assert got[1] == v == lora_engine.version
            after = rollouts(lora_engine)
            assert max_logprob_diff(model, after, 1.0) < LOGPROB_TOL
            assert max_logprob_diff(base, after, 1.0) > CHANGED
            adapter_bytes = sum(t.numel() * t.element_size() for _, t in adapter_weights(model))
            assert sender.last.bytes == adapter_bytes  # nothing of the base travels
    finally:
        receiver.close()
        sender.close()


def test_checkpoint_sync_writes_peft_layout_full_and_delta_and_the_engine_serves_each(
    lora_engine, tiny_model_dir, tmp_path
):
    from peft import PeftModel
    from safetensors.torch import load_file

    cfg = lora_config(
        tiny_model_dir,
        synchronizer={"mode": "fully_async", "sync_method": "checkpoint", "delta": {"enabled": True, "full_every": 2}},
    )
    lora_engine.rpc("rft_load_checkpoint", tiny_model_dir, 0)  # a new run's engine: the base model
    lora_engine.mark_synced(0)
    board = Board.at(str(tmp_path))
    sender, receiver = build_weight_sender(cfg, board), build_weight_receiver(cfg, board)
    for v in (1, 2, 3):  # full, delta, full
        model = trained_peft(tiny_model_dir, seed=10 + v, scale=0.3)
        sender.send(adapter_weights(model), version=v)
        assert receiver.receive(lora_engine) == v == lora_engine.version
        assert max_logprob_diff(model, rollouts(lora_engine), 1.0) < LOGPROB_TOL
    full = tmp_path / "checkpoints" / "version=3"
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in full.iterdir()}
    assert json.loads((full / "adapter_config.json").read_text())["r"] == LORA["rank"]
    assert all(".lora_" in n for n in load_file(full / "adapter_model.safetensors"))
    # peft loads the committed version as it is: the same model the engine serves
    loaded = PeftModel.from_pretrained(load_hf(tiny_model_dir), str(full)).eval()
    assert max_logprob_diff(loaded, rollouts(lora_engine), 1.0) < LOGPROB_TOL


def test_installs_reuse_one_slot_and_the_base_model_comes_back(lora_engine, tiny_model_dir, tmp_path):
    """1,000 versions installed in place (issue 46): one adapter, one slot, the slot's buffers
    holding exactly the last version, no adapter object left behind by any install (their count in
    the worker), and the worker's memory grown by less than a quarter of what keeping each version's
    adapter would take; loading the base model drops the adapter. What it does grow by, about 1 KB
    an install here, is safetensors' own: ~30 B kept per `get_tensor` call (vllm-project/vllm-omni#7143).
    (SmolLM2's adapter over 200 installs: bench.lora's engine_mem_growth_mb.)"""
    from safetensors.torch import save_file

    d = tmp_path / "adapter"
    d.mkdir()
    adapter = dict(adapter_weights(trained_peft(tiny_model_dir, seed=5)))
    save_file(adapter, str(d / "adapter_model.safetensors"))
    lora_engine.rpc("rft_load_checkpoint", str(d), 1)
    [first] = lora_engine.rpc("rft_adapter_probe")
    for v in range(2, 102):  # the allocator's and vLLM's first-use growth, not counted
        lora_engine.rpc("rft_load_checkpoint", str(d), v)
    rss = lora_engine.worker_rss()
    for v in range(102, 1102):
        lora_engine.rpc("rft_load_checkpoint", str(d), v)
    grown = lora_engine.worker_rss() - rss
    kept_each = sum(t.numel() * t.element_size() for t in adapter.values())  # one version's adapter, bytes
    print(
        f"engine RSS growth over 1,000 adapter installs: {grown / 2**20:.2f} MB (an adapter: {kept_each / 2**10:.0f} KB)"
    )
    assert grown < 0.25 * 1000 * kept_each
    [last] = lora_engine.rpc("rft_adapter_probe")
    assert last == first and last["adapters"] == [1] and last["slots"] == [1] and last["adapter_objects"] == 1
    lora_engine.rpc("rft_load_checkpoint", tiny_model_dir, 0)
    lora_engine.mark_synced(0)
    assert max_logprob_diff(load_hf(tiny_model_dir), rollouts(lora_engine), 1.0) < LOGPROB_TOL
