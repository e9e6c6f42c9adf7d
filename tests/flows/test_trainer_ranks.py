"""A run whose trainer has 2 data-parallel ranks (torchrun, gloo), on one machine or across two:
the schedule holds, the explorer's vLLM logprobs match the trainer's after every collective sync
from rank 0, and a rank killed mid-run fails the run, naming the rank, with nothing left running.

    .venv/bin/python -m pytest tests/flows/test_trainer_ranks.py
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

from cli.run import run_config
from rl_engine.config import validate_config
from rl_engine.run.report import load_metrics
from rl_engine.run.context import open_run
from rl_engine.schedule import rendezvous_version
from rl_engine.trainer.dist import free_port
from harness.runs import small_config
from tests.flows.test_modes import stored_experiences, versions_by_step

pytestmark = pytest.mark.slow


def _ranks() -> list[psutil.Process]:
    """This test process's trainer ranks (torchrun's rank_main processes), if any run."""
    return [p for p in psutil.Process().children(recursive=True) if "rl_engine.roles.trainer_rank" in " ".join(p.cmdline())]


def test_a_trainer_across_two_nodes_follows_the_schedule_and_syncs_from_rank_0(prefect_server, tiny_model_dir, task_file, tmp_path):
    # Two "machines" on loopback, one rank each: node 0 is the trainer role's, node 1 is started
    # as a user starts it on another machine, with the README's `rft trainer-node RUN --node-rank 1`
    # (single-machine ranks: the killed-rank test below).
    total = 4
    data = small_config(tiny_model_dir, task_file, str(tmp_path), mode="synchronous", total_steps=total, name="two-nodes")
    data["trainer"].update(num_ranks=2, nodes=2, rendezvous=f"127.0.0.1:{free_port()}", micro_batch_size=2)
    data["taskset"]["reward"] = {"type": "python", "function": "tests.flows.test_lineage_flows:length_reward"}  # moves the weights
    node_1 = subprocess.Popen([str(Path(sys.executable).with_name("rft")), "trainer-node", str(tmp_path / "two-nodes"), "--node-rank", "1", "--wait-s", "120"])
    try:
        summary = run_config(validate_config(data))
        assert node_1.wait(60) == 0
    finally:
        node_1.kill()

    by_step = versions_by_step(stored_experiences(summary["run"]))
    assert {e: v for (_, e), v in by_step.items()} == {e: {rendezvous_version(e, 1, 0)} for e in range(1, total + 1)}
    trainer, _ = load_metrics(open_run(summary["run"]))
    assert [m["step"] for m in trainer] == list(range(1, total + 1)) and summary["final_version"] == total
    # Step t trains on what vLLM generated with version t-1, which rank 0 broadcast after step
    # t-1: the trainer's logprobs of those tokens are vLLM's (float32 on both sides).
    for m in trainer:
        assert m["logprob_diff"] < 1e-3, m
    assert sum(m["grad_norm"] > 0 for m in trainer[:-1]) >= 2  # the weights moved before those syncs
    trained, initial = load_file(f"{summary['run']}/model/model.safetensors"), load_file(f"{tiny_model_dir}/model.safetensors")
    assert max(float((trained[n] - initial[n]).abs().max()) for n in initial) > 1e-4  # rank 0 wrote what the ranks trained
    assert not _ranks()


def test_a_killed_trainer_rank_fails_the_run_naming_it(prefect_server, tiny_model_dir, task_file, tmp_path):
    data = small_config(tiny_model_dir, task_file, str(tmp_path), mode="synchronous", total_steps=200)
    data["trainer"].update(num_ranks=2, micro_batch_size=2)
    data["placement"] = {"type": "local", "heartbeat_s": 1.0, "heartbeat_timeout_s": 20.0}
    killed: list[float] = []  # when rank 1 was killed

    def kill_rank_1() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not killed:
            if list(tmp_path.glob("*/metrics/role=trainer/step=*.json")):  # mid-run: the ranks trained a step
                for p in _ranks():
                    if p.environ().get("RANK") == "1":
                        p.kill()
                        killed.append(time.monotonic())
            time.sleep(0.5)

    killer = threading.Thread(target=kill_rank_1, daemon=True)
    killer.start()
    with pytest.raises(Exception, match=r"trainer rank 1 \(pid \d+\) failed: Signal 9 \(SIGKILL\)"):
        run_config(validate_config(data))
    killer.join(5)
    assert killed, "rank 1 never came up"
    assert time.monotonic() - killed[0] < data["placement"]["heartbeat_timeout_s"]  # torchrun saw it, not a silent heartbeat
    deadline = time.monotonic() + 30
    while _ranks() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _ranks()
