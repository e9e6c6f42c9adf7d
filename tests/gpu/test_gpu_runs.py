"""The GPU path, with the CPU tests' assertions: runs on one GPU (checkpoint sync) and on two
(collective sync over NCCL; with LoRA too), two trainer ranks on two GPUs, a killed rank and a killed engine, each
on the devices the run's plan gives (rl_engine.run.devices). Every test skips without CUDA (and
the two-GPU ones below two GPUs); `make test-gpu` runs them in the CUDA virtualenv.

    .venv-gpu/bin/python -m pytest -m gpu tests/gpu

Not run yet on any GPU (no machine was lent when they were written): see docs/guides/gpus.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.run import run_config
from harness.runs import small_config
from rl_engine.config import validate_config
from rl_engine.errors import UserError
from rl_engine.run.devices import PLAN_FILE, cuda_visible
from rl_engine.run.timeline import load_spans
from tests.flows.test_killed_engine import engine_workers, kill_engine_mid_run
from tests.flows.test_trainer_ranks import assert_synchronous_run_kept_logprobs, kill_rank_1_mid_run
from tests.gpu.helpers import needs_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
TOTAL = 4
MOVES_WEIGHTS = {
    "type": "python",
    "function": "tests.flows.test_lineage_flows:length_reward",
}  # rewards that differ within a group


def _run(
    model: str, task_file: str, tmp_path: Path, method: str, name: str, lora: dict | None = None, **placement
) -> dict:
    data = small_config(
        model, task_file, str(tmp_path), mode="synchronous", sync_method=method, total_steps=TOTAL, name=name
    )
    data["taskset"]["reward"] = MOVES_WEIGHTS
    data["model"]["lora"] = lora
    data["placement"] = {"type": "local", **placement}
    return run_config(validate_config(data))


def _plan(summary: dict) -> dict:
    return json.loads(Path(summary["run"], PLAN_FILE).read_text())


@needs_gpus(1)
def test_one_gpu_run_with_checkpoint_sync(prefect_server, tiny_model_dir, task_file, tmp_path):
    import torch

    summary = _run(
        tiny_model_dir, task_file, tmp_path, "checkpoint", "one-gpu", devices={"trainer": [0], "explorers": [[0]]}
    )
    assert_synchronous_run_kept_logprobs(summary, TOTAL)
    plan = _plan(summary)
    assert (plan["trainer"], plan["explorers"]) == ([0], [[0]])
    assert torch.cuda.max_memory_allocated(0) > 0  # the trainer (in this process) trained on GPU 0
    assert {s.method for s in load_spans(summary["run"]) if s.kind == "sync"} == {"checkpoint"}


@needs_gpus(1)
def test_collective_sync_on_one_gpu_is_refused_before_any_engine_starts(
    prefect_server, tiny_model_dir, task_file, tmp_path
):
    before = {p.pid for p in engine_workers()}
    with pytest.raises(UserError, match=r"collective on a single GPU.*NCCL refuses.*use sync_method: checkpoint"):
        _run(tiny_model_dir, task_file, tmp_path, "collective", "refused", devices={"trainer": [0], "explorers": [[0]]})
    assert {p.pid for p in engine_workers()} <= before


@needs_gpus(2)
def test_two_gpu_run_with_collective_nccl_sync_keeps_vllms_logprobs_the_trainers(
    prefect_server, tiny_model_dir, task_file, tmp_path
):
    import torch

    before = {p.pid for p in engine_workers()}
    summary = _run(
        tiny_model_dir, task_file, tmp_path, "collective", "two-gpus"
    )  # the default split: trainer GPU 0, engine GPU 1
    assert_synchronous_run_kept_logprobs(summary, TOTAL)
    plan = _plan(summary)
    assert (plan["trainer"], plan["explorers"]) == ([0], [[1]])
    assert {s.method for s in load_spans(summary["run"]) if s.kind == "sync"} == {"collective"}
    assert (
        torch.cuda.max_memory_allocated(0) > 0 and torch.cuda.max_memory_allocated(1) == 0
    )  # GPU 1 is the engine's alone
    ours = [p for p in engine_workers() if p.pid not in before]  # kept warm after the run (RFT_KEEP_ENGINES)
    assert ours and all(p.environ().get("CUDA_VISIBLE_DEVICES") == cuda_visible([1]) for p in ours)


@needs_gpus(2)
def test_two_gpu_lora_run_syncs_the_adapter_and_keeps_vllms_logprobs_the_trainers(
    prefect_server, tiny_model_dir, task_file, tmp_path
):
    """LoRA on GPUs: the engine (GPU 1) serves the base with vLLM's LoRA, each version's adapter
    arrives by NCCL broadcast and is installed in place; behavior logprobs stay the trainer's."""
    summary = _run(
        tiny_model_dir,
        task_file,
        tmp_path,
        "collective",
        "two-gpus-lora",
        lora={"rank": 4, "alpha": 16.0, "target_modules": ["q_proj", "v_proj", "down_proj"]},
    )
    assert_synchronous_run_kept_logprobs(summary, TOTAL)
    assert Path(summary["run"], "model", "adapter", "adapter_config.json").is_file()


@needs_gpus(2)
def test_two_trainer_ranks_on_two_gpus_make_one_ranks_update(tiny_model_dir, tmp_path):
    from tests.rl_engine.trainer.test_ranks import test_two_ranks_make_the_same_update_as_one

    test_two_ranks_make_the_same_update_as_one(tiny_model_dir, tmp_path)  # torchrun: rank r on cuda:r, NCCL all-reduce


@needs_gpus(2)
def test_a_killed_trainer_rank_on_a_gpu_fails_the_run_naming_it(prefect_server, tiny_model_dir, task_file, tmp_path):
    data = small_config(
        tiny_model_dir, task_file, str(tmp_path), mode="synchronous", sync_method="checkpoint", total_steps=200
    )
    data["trainer"].update(
        num_ranks=2, micro_batch_size=2
    )  # ranks on GPUs 0 and 1; the engine on GPU 2, or beside rank 0
    kill_rank_1_mid_run(data, tmp_path)


@needs_gpus(2)
def test_a_killed_engine_on_its_gpu_fails_the_run_naming_it(prefect_server, tiny_model_dir, task_file, tmp_path):
    kill_engine_mid_run(
        small_config(tiny_model_dir, task_file, str(tmp_path), mode="synchronous", total_steps=200), tmp_path
    )  # collective: NCCL
