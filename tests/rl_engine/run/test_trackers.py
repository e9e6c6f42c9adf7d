"""Experiment trackers (rl_engine/run/trackers.py): flattening, the x-axes, one warning and off for a
tracker whose server is down, and a resumed run continuing the same tracker runs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from harness.trackers import tensorboard_scalars, wandb_history
from rl_engine.config import ConfigError, validate_config
from rl_engine.run.context import open_run, start_run
from rl_engine.run.report import record_step
from rl_engine.run.trackers import (
    Guarded,
    TrackerFeed,
    build_trackers,
    flatten_metrics,
    hide_credentials,
    load_tracker_state,
    step_of,
)
from rl_engine.trainer.dist import free_port

FAKE_TOKEN = "fake-secret-token-0123456789"


def make_run(tmp_path: Path, trackers: list, name: str = "r"):
    data = {
        "name": name,
        "model": {"path": str(tmp_path / "model")},
        "taskset": {"path": str(tmp_path / "tasks.jsonl")},
        "buffer": {"storage": {"url": str(tmp_path / "runs")}},
    }
    data["monitor"] = {"trackers": trackers}
    return start_run(validate_config(data))


def trainer_step(v: int) -> dict:
    return {
        "step": v,
        "version": v,
        "reward_mean": 0.1 * v,
        "buffer": {"consumed": 4 * v},
        "staleness_hist": {"0": 4},
        "explorer_steps": [v],
        "note": "x",
        "flag": True,
    }


def test_flatten_metrics_keeps_numbers_only():
    m = {"a": 1, "b": 2.5, "nested": {"c": 3, "d": {"e": 4.0}, "s": "x"}, "list": [1], "flag": True, "none": None}
    assert flatten_metrics(m) == {"a": 1.0, "b": 2.5, "nested/c": 3.0, "nested/d/e": 4.0}


def test_step_of_each_role():
    assert step_of("trainer", {"step": 3, "version": 3}) == 3
    assert step_of("explorer-1", {"explorer_step": 5, "version": 2}) == 5
    assert step_of("eval", {"version": 7}) == 7  # a role added later: per-version records
    assert step_of("eval", {"note": "x"}) is None


def test_config_trackers_shorthand_settings_and_refusals(tmp_path):
    base = {"model": {"path": "m"}, "taskset": {"path": "t"}}
    cfg = validate_config(
        {
            **base,
            "monitor": {
                "trackers": [
                    "tensorboard",
                    {"type": "mlflow", "tracking_uri": "http://127.0.0.1:5000"},
                    {"type": "wandb", "mode": "offline"},
                ]
            },
        }
    )
    assert [t.type for t in cfg.monitor.trackers] == ["tensorboard", "mlflow", "wandb"]
    assert validate_config(base).monitor.trackers == []
    with pytest.raises(ConfigError, match="each tracker type at most once"):
        validate_config({**base, "monitor": {"trackers": ["tensorboard", "tensorboard"]}})
    with pytest.raises(ConfigError) as e:  # a credential in the URI: refused, and not echoed
        validate_config(
            {
                **base,
                "monitor": {
                    "trackers": [{"type": "mlflow", "tracking_uri": f"https://me:{FAKE_TOKEN}@mlflow.example"}]
                },
            }
        )
    assert "MLFLOW_TRACKING_PASSWORD" in str(e.value) and FAKE_TOKEN not in str(e.value)
    with pytest.raises(ConfigError, match="api_key"):
        validate_config({**base, "monitor": {"trackers": [{"type": "wandb", "api_key": FAKE_TOKEN}]}})
    assert hide_credentials(f"failed: https://me:{FAKE_TOKEN}@host/x") == "failed: https://<redacted>@host/x"


def test_tracker_on_a_dead_server_warns_once_and_the_rest_goes_on(tmp_path, caplog):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    run = make_run(tmp_path, [{"type": "mlflow", "tracking_uri": dead}, "tensorboard"])
    warnings: list[str] = []
    feed = TrackerFeed(
        run,
        build_trackers(run.cfg.monitor, run, warn=lambda msg, *a: warnings.append(msg % a)),
        poll_s=0.1,
        warn=lambda msg, *a: warnings.append(msg % a),
    )
    t0 = time.monotonic()
    with feed:
        for v in (1, 2, 3):
            record_step(run, "trainer", v, trainer_step(v))
            time.sleep(0.2)
    assert time.monotonic() - t0 < 60
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("tracker mlflow failed") and "off for the rest of the run" in warnings[0]
    # The other tracker got every step.
    scalars = tensorboard_scalars(str(Path(run.url, "trackers", "tensorboard")))
    assert [s for s, _, _ in scalars["trainer/reward_mean"]] == [1, 2, 3]


def test_guarded_tracker_failing_mid_run_warns_once():
    class Flaky:
        name = "flaky"
        calls = 0

        def log_metrics(self, *a):
            Flaky.calls += 1
            if Flaky.calls >= 2:
                raise ConnectionError("server gone")

        def log_config(self, cfg):
            pass

        def close(self):
            pass

    warnings = []
    g = Guarded("flaky", Flaky, lambda msg, *a: warnings.append(msg % a))
    for step in range(5):
        g.log_metrics({"x": 1.0}, step, time.time(), "trainer")
    g.close()
    assert Flaky.calls == 2 and len(warnings) == 1 and "ConnectionError: server gone" in warnings[0]


def test_resumed_run_continues_the_same_tracker_runs(tmp_path, monkeypatch):
    """Two feeds on one run, as a run and its resume make them: the second continues the first's
    MLflow run, W&B run and TensorBoard directory; the steps the resume redoes are logged again;
    no credential from the environment reaches the run's files."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_API_KEY", FAKE_TOKEN)
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", FAKE_TOKEN)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = make_run(
        tmp_path,
        [
            "tensorboard",
            {"type": "mlflow", "tracking_uri": store, "experiment": "unit"},
            {"type": "wandb", "mode": "offline"},
        ],
    )
    warnings: list[str] = []

    def attempt(steps: list[int], explorer_steps: list[int]) -> None:
        r = open_run(run.url)
        with TrackerFeed(r, build_trackers(r.cfg.monitor, r, warn=lambda m, *a: warnings.append(m % a)), poll_s=0.1):
            for v in steps:
                record_step(r, "trainer", v, trainer_step(v))
            for e in explorer_steps:
                record_step(
                    r, "explorer-0", e, {"explorer_id": 0, "explorer_step": e, "version": e - 1, "reward_mean": 0.5}
                )
            record_step(
                r, "eval", steps[-1], {"version": steps[-1], "exact_match": 0.25}
            )  # a role the feed has not seen before
            time.sleep(0.3)

    attempt([1, 2], [1, 2])
    ids = {name: load_tracker_state(run, name) for name in ("mlflow", "wandb", "tensorboard")}
    time.sleep(
        1.1
    )  # W&B names an attempt's offline directory by the second it started in: a real resume is never within the same one
    attempt([2, 3, 4], [3, 4])  # the resume redoes trainer step 2
    assert {name: load_tracker_state(run, name) for name in ids} == ids
    assert warnings == []

    history = MlflowClient(store).get_metric_history(ids["mlflow"]["run_id"], "trainer/reward_mean")
    assert sorted(m.step for m in history) == [1, 2, 2, 3, 4]
    assert all(abs(m.timestamp / 1000 - time.time()) < 300 for m in history)  # wall-clock time of the record
    assert [m.step for m in MlflowClient(store).get_metric_history(ids["mlflow"]["run_id"], "explorer-0/version")] == [
        1,
        2,
        3,
        4,
    ]
    assert len(MlflowClient(store).search_runs([MlflowClient(store).get_experiment_by_name("unit").experiment_id])) == 1

    rows = wandb_history(str(Path(run.url, "trackers", "wandb")), ids["wandb"]["run_id"])
    assert [json.loads(r["trainer/step"]) for r in rows if "trainer/step" in r] == [1, 2, 2, 3, 4]
    assert [json.loads(r["eval/exact_match"]) for r in rows if "eval/exact_match" in r] == [0.25, 0.25]

    scalars = tensorboard_scalars(str(Path(run.url, "trackers", "tensorboard")))
    assert [s for s, _, _ in scalars["trainer/buffer/consumed"]] == [1, 2, 2, 3, 4]
    assert [s for s, _, _ in scalars["explorer-0/reward_mean"]] == [1, 2, 3, 4]
    assert "trainer/note" not in scalars and "trainer/explorer_steps" not in scalars

    for path in Path(run.url).rglob("*"):
        if path.is_file():
            assert FAKE_TOKEN.encode() not in path.read_bytes(), f"{path} holds a credential"


def test_remote_run_copies_tracker_files_to_the_run_at_the_end(tmp_path):
    """A run on non-local storage (memory:// here, as S3): TensorBoard and W&B write locally and
    their files are copied under <run>/trackers/ when the feed stops."""
    import fsspec

    data = {
        "name": f"remote-{time.time_ns()}",
        "model": {"path": "m"},
        "taskset": {"path": "t"},
        "buffer": {"storage": {"url": "memory://trackers-test"}},
    }
    data["monitor"] = {"trackers": ["tensorboard", {"type": "wandb", "mode": "offline"}]}
    run = start_run(validate_config(data))
    warnings: list[str] = []
    with TrackerFeed(run, build_trackers(run.cfg.monitor, run, warn=lambda m, *a: warnings.append(m % a)), poll_s=0.1):
        for v in (1, 2):
            record_step(run, "trainer", v, trainer_step(v))
    assert warnings == []
    fs, root = run.fs()
    local = tmp_path / "copy"
    fs.get(f"{root}/trackers", str(local), recursive=True)
    assert [s for s, _, _ in tensorboard_scalars(str(local / "tensorboard"))["trainer/reward_mean"]] == [1, 2]
    rows = wandb_history(str(local / "wandb"), load_tracker_state(run, "wandb")["run_id"])
    assert [json.loads(r["trainer/step"]) for r in rows if "trainer/step" in r] == [1, 2]
    fsspec.filesystem("memory").rm(root, recursive=True)


class Recorder:
    """A tracker that keeps what it was given (and counts flushes)."""

    name = "recorder"

    def __init__(self):
        self.steps: list[tuple[str, int]] = []
        self.flushes = 0

    def log_metrics(self, metrics, step, wall_time, prefix):
        self.steps.append((prefix, step))

    def log_config(self, cfg):
        pass

    def flush(self):
        self.flushes += 1

    def close(self):
        pass


def test_a_killed_feed_resumes_from_its_cursor_not_from_what_is_on_storage(tmp_path):
    """Issue 45 item 7: a run killed after recording steps its tracker feed never logged (the kill
    came between a step's metrics and the feed's next poll) resumes logging them: the feed's
    cursor (trackers/feed.json), flushed with the trackers, says what reached them."""
    run = make_run(tmp_path, [])
    first = Recorder()
    feed = TrackerFeed(run, [first])
    for v in (1, 2, 3):
        record_step(run, "trainer", v, trainer_step(v))
    feed.poll()  # logged and flushed 1..3; then the process is killed (no stop())
    assert first.steps == [("trainer", 1), ("trainer", 2), ("trainer", 3)] and first.flushes == 1
    for v in (4, 5):  # recorded by the killed attempt, never polled
        record_step(run, "trainer", v, trainer_step(v))
    resumed = Recorder()
    TrackerFeed(run, [resumed]).poll()
    assert resumed.steps == [("trainer", 4), ("trainer", 5)]
    assert json.loads(Path(run.url, "trackers", "feed.json").read_text()) == {"trainer": 5}


def test_a_run_killed_before_its_feeds_first_poll_logs_every_step_on_resume(tmp_path):
    """The cursor is written when the feed is made: a first attempt killed before it ever polled
    (its steps recorded, none logged) resumes logging all of them (CI's kill case: steps 1-4 lost)."""
    run = make_run(tmp_path, [])
    TrackerFeed(run, [Recorder()])  # made at the run's start; the process is killed before a poll
    for v in (1, 2, 3, 4):
        record_step(run, "trainer", v, trainer_step(v))
    resumed = Recorder()
    TrackerFeed(run, [resumed]).poll()
    assert resumed.steps == [("trainer", v) for v in (1, 2, 3, 4)]
