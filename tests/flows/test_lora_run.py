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
def test_a_lora_run_syncs_the_adapter_the_engine_agrees_with(
    sync, prefect_server, tiny_model_dir, task_file, tmp_path, capsys
):
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
        assert_rft_eval(run, records, capsys)
        assert_exports(run, tiny_model_dir, records, tmp_path / "exported")
    if sync == "checkpoint-delta":  # full versions in peft's layout: the adapter only, loadable by peft
        full = max(Path(run, "checkpoints").glob("version=*"))
        assert {p.name for p in full.iterdir()} >= {"adapter_model.safetensors", "adapter_config.json"}
        assert all(".lora_" in n for n in load_file(full / "adapter_model.safetensors"))
        assert list(Path(run, "checkpoints").glob("delta=*")), "no delta version was written"


def assert_rft_eval(run: str, records: list[dict], capsys: pytest.CaptureFixture) -> None:
    """`rft eval RUN` on a LoRA run: its engine is the run's (the base with LoRA on) and loads each
    kept version's adapter, as evaluation during training did; so it scores version 0 (the base)
    and the final version (model/adapter) as the run's own evaluations of them did, metric for metric."""
    from cli.main import main as rft

    capsys.readouterr()
    assert rft(["eval", run]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["versions"]
    assert [r["version"] for r in got] == [0, 4]  # evaluated versions' weights go once evaluated
    for mine, theirs in zip(got, (records[0], records[-1])):
        scores = {k: v for k, v in mine.items() if k.startswith("heldout/")}
        assert scores and scores == {k: theirs[k] for k in scores}, (mine["version"], scores, theirs)


def assert_exports(run: str, base_dir: str, records: list[dict], out: Path) -> None:
    """`rft export`: the final merged model alone, the adapter alone on the run's base (peft loads
    it to the merged model's logprobs), version 0 (the base); refusals name the fix."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from cli.main import main as rft
    from rl_engine.errors import UserError
    from rl_engine.run.export import export
    from tests.flows.test_evaluation_flows import hf_probe_logprobs

    assert rft(["export", run, str(out / "model")]) == 0
    assert not (out / "model" / "adapter").exists()
    assert load_file(out / "model" / "model.safetensors").keys() == load_file(f"{run}/model/model.safetensors").keys()
    ids = records[-1]["probe"]["ids"]
    merged = hf_probe_logprobs(str(out / "model"), None, ids)
    assert torch.equal(merged, hf_probe_logprobs(f"{run}/model", None, ids))

    assert rft(["export", run, str(out / "adapter"), "--adapter"]) == 0
    assert {p.name for p in (out / "adapter").iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == base_dir
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32), out / "adapter"
    )
    with torch.no_grad():
        logits = peft_model(torch.tensor([ids])).logits[0, :-1].float()  # [L-1, V]
    by_peft = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]  # [L-1]
    assert (by_peft - merged).abs().max().item() < 1e-4

    # Evaluated versions' weights go once evaluated (no eval.keep_best): 0 (the base) and the final stay.
    assert export(run, str(out / "v0"), version="0")["version"] == 0
    probe = records[0]["probe"]
    assert (hf_probe_logprobs(str(out / "v0"), None, probe["ids"]) - torch.tensor(probe["logprobs"])).abs().max() < 1e-3
    with pytest.raises(UserError, match=r"no model of that version was kept; the run has versions \[0, 4\]"):
        export(run, str(out / "v2"), version="2")
    with pytest.raises(UserError, match="version 0 is the base model"):
        export(run, str(out / "a0"), version="0", adapter=True)
    with pytest.raises(UserError, match="is not an empty directory"):
        export(run, str(out / "model"))
    assert sorted(p.name for p in out.iterdir()) == ["adapter", "model", "v0"]  # nothing half-written
