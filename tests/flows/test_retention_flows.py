"""Retention in a real run (rl_engine/run/retention.py, rl_engine/sync/checkpoint.py): one-step-off-policy with checkpoint sync,
keeping 2 trainer states and 2 checkpoints, stopped mid-run and resumed.

    .venv/bin/python -m pytest tests/flows/test_retention_flows.py -q
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from cli.run import run_config
from harness.runs import small_config
from rl_engine.board import Board, request_stop
from rl_engine.config import validate_config
from rl_engine.pruning import list_dirs
from rl_engine.run.context import RunContext, open_run
from rl_engine.run.retention import STATES
from rl_engine.run.state import latest_state_step
from rl_engine.sync.checkpoint import CHECKPOINTS

pytestmark = pytest.mark.slow


def _left(run: RunContext, kind) -> tuple[list[int], list[int]]:
    fs, root = run.fs()
    return list_dirs(fs, root, kind)


def _stop_at(run_dir: Path, version: int, done: threading.Event, timeout_s: float = 300) -> None:
    marker, deadline = run_dir / "control" / "trainer.json", time.monotonic() + timeout_s
    while time.monotonic() < deadline and not done.is_set():
        try:
            if json.loads(marker.read_text())["version"] >= version:
                request_stop(Board.at(str(run_dir)), "cancelled", "test: stop mid-run", by="test")
                return
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            pass
        time.sleep(0.05)


def test_run_keeps_two_of_each_and_resumes(prefect_server, tiny_model_dir, task_file, tmp_path):
    total = 8
    data = small_config(
        tiny_model_dir,
        task_file,
        str(tmp_path),
        name="keep2",
        mode="one_step_off_policy",
        sync_offset=1,
        sync_method="checkpoint",
        keep_last_checkpoints=2,
        total_steps=total,
    )
    data["trainer"]["keep_last_states"] = 2
    done = threading.Event()
    stopper = threading.Thread(target=_stop_at, args=(tmp_path / "keep2", 3, done), daemon=True)
    stopper.start()
    try:
        first = run_config(validate_config(data))
    except BaseException as e:  # noqa: BLE001 - the stop request cancels the run: its flow run ends Cancelled and raises
        first = e
    finally:
        done.set()
        stopper.join(10)
    assert not isinstance(first, dict), f"the run was not stopped: {first}"
    run = open_run(str(tmp_path / "keep2"))
    saved = latest_state_step(run)
    reached = json.loads((tmp_path / "keep2" / "report" / "summary.json").read_text())["final_version"]
    assert reached < total and saved is not None and saved >= 2, (reached, saved)
    # States every 2 steps and the one the cancel saved at the version reached; the last 2 kept.
    assert saved == reached, (reached, saved)
    assert _left(run, STATES) == (sorted({*range(2, reached + 1, 2), reached})[-2:], [])

    summary = run_config(run.cfg, resume=run.url)
    assert summary["final_version"] == total
    # Sent at the rendezvous: versions 1..total-2 (sync after explorer steps 2..total-1); kept: the last 2.
    assert _left(run, STATES) == ([total - 2, total], [])
    assert _left(run, CHECKPOINTS) == ([total - 3, total - 2], [])
    assert set(os.listdir(tmp_path / "keep2" / "trainer_state")) == {f"step={total - 2}", f"step={total}"}
    assert set(os.listdir(tmp_path / "keep2" / "checkpoints")) == {f"version={total - 3}", f"version={total - 2}"}
