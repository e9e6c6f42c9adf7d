"""Cancel a running flow through the Prefect API, then resume it: nothing committed is lost,
nothing is trained twice, training continues from the last trainer checkpoint."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from cli.run import run_config
from harness.cancel import run_and_cancel
from harness.runs import small_config
from rl_engine.config import validate_config
from rl_engine.rewards import TaskIterator, load_taskset
from rl_engine.run.context import last_committed_steps, open_run
from rl_engine.run.state import latest_state_step
from rl_engine.storage import open_storage
from tests.flows.conftest import artifacts_of
from tests.flows.test_modes import stored_experiences

pytestmark = pytest.mark.slow


def test_cancel_mid_run_then_resume(prefect_server, tiny_model_dir, task_file, tmp_path):
    # Long enough that the cancel (seen within ~1 s) always lands mid-run, however fast the machine.
    total = 60
    cfg = validate_config(
        small_config(
            tiny_model_dir,
            task_file,
            str(tmp_path),
            name="cancel-me",
            mode="one_step_off_policy",
            sync_offset=1,
            total_steps=total,
            checkpoint_interval=2,
        )
    )
    started = time.monotonic()
    result, cancelled = run_and_cancel(cfg, 3)
    assert not isinstance(result, dict), f"the run was not cancelled: {result}"
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        assert len(cancelled) == 1 and client.read_flow_run(cancelled[0]).state.is_cancelled(), result
    # The cancelled run still published its report, under the mode flow's keys; its progress stopped short of 100%.
    arts = artifacts_of(cancelled[0])
    assert {
        f"one-step-off-policy-{what}" for what in ("summary", "metrics", "timeline", "reward-curve", "progress")
    } <= set(arts), sorted(arts)
    assert (
        0 < arts["one-step-off-policy-progress"].data < 100
        and "cancel-me" in arts["one-step-off-policy-summary"].description
    )
    run = open_run(str(tmp_path / "cancel-me"))
    saved = latest_state_step(run)
    committed = last_committed_steps(run)[0]
    assert saved is not None and 2 <= saved < total, f"cancelled too late or no checkpoint: trainer state at {saved}"
    # ... with how to resume it (no deployment: the CLI with the run's own config) and the model it reached.
    resume = arts["one-step-off-policy-resume"].data
    assert f"rft run {run.url}/config.yaml --resume {run.url}" in resume and f"version {saved} of {total}" in resume, (
        resume
    )
    reached = json.loads(Path(run.url, "report", "summary.json").read_text())["final_version"]
    assert 0 < reached < total and arts["one-step-off-policy-model"].data.startswith(f"[{run.url}/model]")
    assert saved == reached, (
        f"the cancel saved no state at version {reached}: its resume repeats steps {saved + 1}-{reached}"
    )
    model = load_file(str(Path(run.url, "model", "model.safetensors")))  # the policy it reached, a whole HF model
    assert (
        model.keys() == load_file(str(Path(tiny_model_dir, "model.safetensors"))).keys()
        and Path(run.url, "model", "config.json").is_file()
    )
    assert committed < total, "the explorer was not stopped"
    before = {r["experience_id"] for r in stored_experiences(run.url)}
    assert time.monotonic() - started < 240

    summary = run_config(run.cfg, resume=run.url)
    assert summary["final_version"] == total
    assert summary["max_staleness_seen"] <= 1  # the mode's bound (k - 1 + m) holds across the resume too
    rows = stored_experiences(run.url)
    ids = [r["experience_id"] for r in rows]
    assert len(ids) == len(set(ids)) and before <= set(ids)  # nothing committed before the cancel is lost
    steps = sorted((r["explorer_id"], r["explorer_step"]) for r in rows)
    assert sorted(set(steps)) == [(0, e) for e in range(1, total + 1)]  # the explorer continued after its last step
    assert len(rows) == total * 4  # ... and regenerated nothing
    # ... and continued its task stream: step e drew the e-th batch of its seeded order, no prompt replayed.
    stream = TaskIterator(
        load_taskset(run.cfg.taskset), run.cfg.explorer.batch_size, seed=run.cfg.seed, shuffle=run.cfg.taskset.shuffle
    )
    expected = {e: sorted(t.task_id for t in stream.next_batch()) for e in range(1, total + 1)}
    drawn: dict[int, set] = {}
    for r in rows:
        drawn.setdefault(r["explorer_step"], set()).add(r["group_id"].split("-", 2)[2])
    assert {e: sorted(ids) for e, ids in drawn.items()} == expected
    # The report covers the whole run across the resume; the resumed trainer trained steps
    # saved+1..total on exactly explorer steps saved+1..total: nothing twice.
    metrics = [json.loads(line) for line in Path(run.url, "report", "metrics.jsonl").read_text().splitlines()]
    trainer = [m for m in metrics if "explorer_steps" in m]
    assert [m["step"] for m in trainer] == list(range(1, total + 1))
    assert [m["explorer_steps"] for m in trainer if m["resumed_from"] == saved] == [
        [t] for t in range(saved + 1, total + 1)
    ]


def test_a_second_driver_of_a_running_run_is_refused(prefect_server, tiny_model_dir, task_file, tmp_path):
    import contextvars
    import os

    from rl_engine.board import Board, request_stop
    from rl_engine.errors import UserError
    from rl_engine.run.lease import read_lease

    # More steps than it can take before the test stops it: with warm engines 40 steps took 5 s, and
    # the first run was complete before the second driver's flow run had started (one suite run).
    cfg = validate_config(
        small_config(
            tiny_model_dir,
            task_file,
            str(tmp_path),
            name="busy",
            mode="one_step_off_policy",
            sync_offset=1,
            total_steps=10_000,
        )
    )
    out: list = []

    def first_run() -> None:
        try:
            out.append(run_config(cfg))
        except BaseException as e:  # noqa: BLE001 - stopped by a cancel, the flow run ends Cancelled and raises
            out.append(e)

    first = threading.Thread(target=contextvars.copy_context().run, args=(first_run,), daemon=True)
    first.start()
    board = Board.at(str(tmp_path / "busy"))
    deadline = time.monotonic() + 240
    while (board.get("trainer") or {}).get("version", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    attempt = board.get("start")["attempt"]
    with pytest.raises(
        UserError, match=rf"run {tmp_path}/busy is being run by pid {os.getpid()} on .*wait for that run to end"
    ):
        run_config(open_run(str(tmp_path / "busy")).cfg, resume=str(tmp_path / "busy"))
    assert board.get("start")["attempt"] == attempt  # the refused driver touched nothing of the running one
    request_stop(board, "cancelled", "test over", by="test")
    first.join(120)
    from prefect.exceptions import CancelledRun

    # Cancelled by its board's stop request alone (no cancel through the API): the flow run ends Cancelled.
    assert not first.is_alive() and out and isinstance(out[0], CancelledRun), out
    assert json.loads((tmp_path / "busy" / "report" / "summary.json").read_text())["final_version"] < 10_000
    assert read_lease(*open_storage(str(tmp_path / "busy")))["released"]  # released when the run ended
