"""A real synchronous run with model.lora: DeepSpeed trains the adapters only, the explorer's vLLM
engine serves the base model and receives the adapter only (by broadcast, or by checkpoints in
peft's layout, full and delta), and its behavior logprobs are the trainer's after every sync; the
run's model is the merged one, with the adapter beside it.

.venv/bin/python -m pytest tests/flows/test_lora_run.py -q -m slow
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cli.run import run_config
from harness.runs import small_config
from rl_engine.config import validate_config
from tests.flows.test_trainer_ranks import assert_synchronous_run_kept_logprobs

pytestmark = pytest.mark.slow

LORA = {"rank": 4, "alpha": 16.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


@pytest.mark.parametrize("sync", ["collective", "checkpoint-delta"])
def test_a_lora_run_syncs_the_adapter_the_engine_agrees_with(sync, prefect_server, tiny_model_dir, task_file, tmp_path):
    total = 4
    data = small_config(tiny_model_dir, task_file, str(tmp_path), mode="synchronous", total_steps=total)
    data["model"]["lora"] = LORA
    if sync == "checkpoint-delta":
        data["synchronizer"].update(sync_method="checkpoint", delta={"enabled": True, "full_every": 2})
    else:  # evaluation during training: the engine loads each due version's saved adapter (eval/version=N/model/adapter)
        data["eval"] = {
            "tasksets": [{"name": "heldout", "path": task_file, "n": 1, "max_tasks": 4}],
            "every_versions": 2,
        }
    data["trainer"]["lr"] = 1e-2
    data["taskset"]["reward"] = {
        "type": "python",
        "function": "tests.flows.test_lineage_flows:length_reward",
    }  # moves the weights
    summary = run_config(validate_config(data))

    # step t trained on what vLLM generated with merged version t-1: logprobs within 1e-3
    assert_synchronous_run_kept_logprobs(summary, total)

    run = summary["run"]
    trained, initial = load_file(f"{run}/model/model.safetensors"), load_file(f"{tiny_model_dir}/model.safetensors")
    assert trained.keys() == initial.keys()  # an ordinary model: no peft names
    moved = {n for n in initial if not torch.equal(trained[n], initial[n])}
    assert moved and all(n.rsplit(".", 2)[-2] in ("q_proj", "v_proj", "down_proj") for n in moved), moved
    adapter = json.loads(open(f"{run}/model/adapter/adapter_config.json").read())
    assert adapter["r"] == LORA["rank"] and sorted(adapter["target_modules"]) == sorted(LORA["target_modules"])
    state = load_file(f"{run}/trainer_state/step=2/model.safetensors")
    assert state and all(".lora_A." in n or ".lora_B." in n for n in state)  # the adapter only
    if sync == "collective":  # evaluated with each version's adapter: the last one's probe is the merged model's
        from rl_engine.run.context import open_run
        from rl_engine.run.report import load_evaluations
        from tests.flows.test_evaluation_flows import hf_probe_logprobs

        records = load_evaluations(open_run(run))
        assert [r["version"] for r in records] == [0, 2, 4]
        last = records[-1]["probe"]
        merged = hf_probe_logprobs(f"{run}/model", None, last["ids"])
        assert (merged - torch.tensor(last["logprobs"])).abs().max().item() < 1e-3
        base = hf_probe_logprobs(tiny_model_dir, None, records[0]["probe"]["ids"])
        assert (base - torch.tensor(records[0]["probe"]["logprobs"])).abs().max().item() < 1e-3  # version 0: the base
        moved = merged - hf_probe_logprobs(tiny_model_dir, None, last["ids"])
        assert moved.abs().max().item() > 1e-2  # the adapter moved the model
    if sync == "checkpoint-delta":  # full versions in peft's layout: the adapter only, loadable by peft
        full = max(Path(run, "checkpoints").glob("version=*"))
        assert {p.name for p in full.iterdir()} >= {"adapter_model.safetensors", "adapter_config.json"}
        assert all(".lora_" in n for n in load_file(full / "adapter_model.safetensors"))
        assert list(Path(run, "checkpoints").glob("delta=*")), "no delta version was written"
