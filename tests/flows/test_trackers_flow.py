"""A real run with all three trackers (monitor.trackers), cancelled mid-run and resumed: TensorBoard's
event files, an `mlflow server` on loopback and W&B's offline files hold every step's metrics, by
the trainer version and the explorer step, with wall-clock time; the resume continues the same
tracker runs."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

from cli.run import run_config
from harness.cancel import run_and_cancel
from harness.runs import small_config
from harness.trackers import mlflow_server, tensorboard_scalars, wandb_history, wandb_records
from rl_engine.config import validate_config
from rl_engine.run.context import open_run
from rl_engine.run.trackers import load_tracker_state

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
        yield uri


def recorded(run_url: str, role: str) -> dict[int, dict]:
    return {
        int(p.stem.split("=")[1]): json.loads(p.read_text())
        for p in Path(run_url, "metrics", f"role={role}").glob("step=*.json")
    }


def test_run_with_all_trackers_then_resume_continues_them(
    prefect_server, mlflow_uri, tiny_model_dir, task_file, tmp_path
):
    from mlflow.tracking import MlflowClient

    total = 60  # long enough that the cancel (seen within ~1 s) lands mid-run
    data = small_config(
        tiny_model_dir,
        task_file,
        str(tmp_path),
        name="tracked",
        mode="one_step_off_policy",
        sync_offset=1,
        total_steps=total,
        checkpoint_interval=2,
    )
    data["monitor"]["trackers"] = [
        "tensorboard",
        {"type": "mlflow", "tracking_uri": mlflow_uri, "experiment": "flow-test"},
        {"type": "wandb", "mode": "offline", "project": "flow-test"},
    ]
    started = time.time()
    result, cancelled = run_and_cancel(validate_config(data), 3)
    assert cancelled and not isinstance(result, dict), f"the run was not cancelled: {result}"
    run = open_run(str(tmp_path / "tracked"))
    ids = {name: load_tracker_state(run, name) for name in ("tensorboard", "mlflow", "wandb")}
    assert all(ids.values()), ids
    first = set(recorded(run.url, "trainer"))
    assert 3 <= max(first) < total

    summary = run_config(run.cfg, resume=run.url)
    assert summary["final_version"] == total
    assert {name: load_tracker_state(run, name) for name in ids} == ids  # the same tracker runs
    trainer, explorer = recorded(run.url, "trainer"), recorded(run.url, "explorer-0")
    assert sorted(trainer) == list(range(1, total + 1))

    # TensorBoard: one directory, an event file per attempt; every trainer version and explorer step, at the time it was recorded.
    log_dir = Path(run.url, "trackers", "tensorboard")
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 2
    scalars = tensorboard_scalars(str(log_dir))
    last = {s: (v, w) for s, v, w in scalars["trainer/reward_mean"]}  # a step the resume redid: its last value
    assert sorted(last) == list(range(1, total + 1))
    assert all(
        v == pytest.approx(trainer[s]["reward_mean"]) and w == pytest.approx(trainer[s]["time"])
        for s, (v, w) in last.items()
    )
    assert started <= min(w for _, w in last.values()) and max(w for _, w in last.values()) <= time.time()
    assert {s for s, _, _ in scalars["trainer/buffer/consumed"]} == set(trainer)
    assert {s for s, _, _ in scalars["explorer-0/version"]} == set(explorer)

    # MLflow: the server holds one run of the experiment, continued by the resume, with every step and the config.
    client = MlflowClient(mlflow_uri)
    runs = client.search_runs([client.get_experiment_by_name("flow-test").experiment_id])
    assert [r.info.run_id for r in runs] == [ids["mlflow"]["run_id"]] and runs[0].info.status == "FINISHED"
    history = client.get_metric_history(ids["mlflow"]["run_id"], "trainer/reward_mean")
    assert {m.step for m in history} == set(trainer)
    by_step = {m.step: m for m in sorted(history, key=lambda m: m.timestamp)}
    assert all(
        by_step[s].value == pytest.approx(trainer[s]["reward_mean"])
        and by_step[s].timestamp == int(trainer[s]["time"] * 1000)
        for s in trainer
    )
    assert {m.step for m in client.get_metric_history(ids["mlflow"]["run_id"], "explorer-0/reward_mean")} == set(
        explorer
    )
    assert runs[0].data.params["trainer.total_steps"] == str(total) and runs[0].data.params["name"] == "tracked"

    # W&B offline: a run directory per attempt, one run id; every step and the config in its transaction logs.
    wandb_dir = Path(run.url, "trackers", "wandb")
    attempts = sorted(wandb_dir.glob(f"wandb/offline-run-*-{ids['wandb']['run_id']}"))
    assert len(attempts) == 2
    rows = wandb_history(str(wandb_dir), ids["wandb"]["run_id"])
    assert {json.loads(r["trainer/step"]) for r in rows if "trainer/step" in r} == set(trainer)
    assert {json.loads(r["explorer-0/step"]) for r in rows if "explorer-0/step" in r} == set(explorer)
    updates = [
        rec.config.update
        for rec in wandb_records(str(next(attempts[0].glob("*.wandb"))))
        if rec.WhichOneof("record_type") == "config"
    ]
    config = {item.key: item.value_json for update in updates for item in update}
    assert json.loads(config["trainer"])["total_steps"] == total


def flow_run_warnings(name: str, timeout_s: float = 30.0) -> list[str]:
    """The warnings (and worse) in the log of the flow run named `name`, as the Prefect API has them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterName,
        LogFilter,
        LogFilterFlowRunId,
        LogFilterLevel,
    )

    with get_client(sync_client=True) as client:
        (flow_run,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
        deadline = time.monotonic() + timeout_s
        while True:  # the log handler ships records in batches
            logs = client.read_logs(
                log_filter=LogFilter(
                    flow_run_id=LogFilterFlowRunId(any_=[flow_run.id]), level=LogFilterLevel(ge_=logging.WARNING)
                )
            )
            if logs or time.monotonic() > deadline:
                return [log.message for log in logs]
            time.sleep(0.5)


def test_tracker_at_a_dead_server_warns_once_and_the_run_completes(prefect_server, tiny_model_dir, task_file, tmp_path):

    from rl_engine.trainer.dist import free_port

    data = small_config(
        tiny_model_dir,
        task_file,
        str(tmp_path),
        name="dead-tracker",
        mode="one_step_off_policy",
        sync_offset=1,
        total_steps=3,
    )
    data["monitor"]["trackers"] = [
        {"type": "mlflow", "tracking_uri": f"http://127.0.0.1:{free_port()}"},
        "tensorboard",
    ]  # nothing listens there
    summary = run_config(validate_config(data))
    assert summary["final_version"] == 3
    warned = [m for m in flow_run_warnings("one_step_off_policy-dead-tracker") if "tracker" in m]
    assert len(warned) == 1 and warned[0].startswith("tracker mlflow failed"), warned
    assert load_tracker_state(open_run(summary["run"]), "mlflow") is None
    assert {
        s
        for s, _, _ in tensorboard_scalars(str(Path(summary["run"], "trackers", "tensorboard")))["trainer/reward_mean"]
    } == {1, 2, 3}
