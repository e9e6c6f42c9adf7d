"""A run whose explorer's vLLM engine is killed mid-run fails, naming the explorer and the engine
process, instead of waiting for it (also tests/gpu: the engine on its own GPU).

    .venv/bin/python -m pytest tests/flows/test_killed_engine.py
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psutil
import pytest

from cli.run import run_config
from harness.runs import small_config
from rl_engine.config import validate_config

pytestmark = pytest.mark.slow


def engine_workers() -> list[psutil.Process]:
    """This test process's vLLM worker processes (vLLM titles them `VLLM::Worker...`): on CPU its
    children (the EngineCore runs in this process), on GPU the EngineCores' children."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "VLLM::Worker" in p.name() or "VLLM::Worker" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            pass
    return out


def kill_engine_mid_run(data: dict, tmp_path: Path) -> None:
    """Run `data` (many steps), SIGKILL explorer 0's worker once the trainer trained a step:
    the run fails naming explorer 0's engine, the process and its signal, within the heartbeat timeout."""
    data["placement"] = {**data.get("placement", {}), "type": "local", "heartbeat_s": 1.0, "heartbeat_timeout_s": 20.0}
    data["seed"] = 4242  # an engine of its own: the session's engine pool never hands a killed one to another test
    before = {p.pid for p in engine_workers()}  # warm engines of earlier runs (RFT_KEEP_ENGINES): not this run's
    killed: list[tuple[int, float]] = []

    def kill_core() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not killed:
            if list(tmp_path.glob("*/metrics/role=trainer/step=*.json")):
                for p in engine_workers():
                    if p.pid not in before:
                        p.kill()
                        killed.append((p.pid, time.monotonic()))
                        break
            time.sleep(0.5)

    killer = threading.Thread(target=kill_core, daemon=True)
    killer.start()
    with pytest.raises(
        Exception, match=r"the vLLM engine of explorer 0 died \(VLLM::Worker\S* pid \d+ (killed by SIGKILL|exited)"
    ) as failed:
        run_config(validate_config(data))
    killer.join(5)
    assert killed, "the run's engine never came up"
    pid, at = killed[0]
    assert f"pid {pid}" in str(failed.value)
    assert (
        time.monotonic() - at < data["placement"]["heartbeat_timeout_s"]
    )  # the explorer saw it, not a silent heartbeat


def test_a_killed_engine_fails_the_run_naming_it(prefect_server, tiny_model_dir, task_file, tmp_path):
    kill_engine_mid_run(
        small_config(tiny_model_dir, task_file, str(tmp_path), mode="synchronous", total_steps=200), tmp_path
    )
