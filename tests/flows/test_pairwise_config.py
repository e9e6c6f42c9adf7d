"""Features tested together, at the config level (no engines): every row of the pairwise matrix
(harness/pairwise.py, tests/flows/pairwise_rows.json) made through the real override path, a
flow run's `set` parameter on a validated config (and `rft run --set` on that config's file);
valid rows accepted, forbidden pairs refused naming the field, every valid pair in a valid row.
The end-to-end runs of the valid rows: tests/flows/test_pairwise.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.pairwise import DIMENSIONS, FORBIDDEN, all_pairs, matrix, row_overrides, row_pairs
from harness.runs import small_config
from rl_engine.config import ConfigError, RFTConfig, load_config, to_yaml, validate_config

ROWS_FILE = Path(__file__).with_name("pairwise_rows.json")
CTX = {
    "tasks": "/data/arith.jsonl",
    "storage": "/runs",
    "s3": ("s3://bucket/runs", {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}),
    "mlflow_uri": "sqlite:////runs/mlflow.db",
}


def base_config() -> RFTConfig:
    """A validated run config, as a deployment's `cfg` holds it (every field given)."""
    data = small_config("/models/tiny", CTX["tasks"], CTX["storage"], name="pairwise")
    data["synchronizer"]["collective"]["port"] = 29555  # small_config draws a free one per call
    return validate_config(data)


def row_config(row: dict[str, str], tmp_path: Path | None = None) -> RFTConfig:
    """`row`'s config: its overrides as a flow run's `set` parameter on the base config; with
    `tmp_path`, also as `rft run CONFIG --set ...` on the base config's file, which must agree."""
    from flows.common import with_overrides

    overrides = row_overrides(row, CTX)
    cfg = with_overrides(base_config(), overrides)
    if tmp_path is not None:
        path = tmp_path / "base.yaml"
        path.write_text(to_yaml(base_config()))
        assert load_config(path, overrides) == cfg
    return cfg


def test_rows_file_is_the_generators():
    assert json.loads(ROWS_FILE.read_text()) == json.loads(json.dumps(matrix())), (
        "regenerate: python -m harness.pairwise > tests/flows/pairwise_rows.json"
    )


def test_every_valid_pair_is_in_a_valid_row():
    rows = json.loads(ROWS_FILE.read_text())["rows"]
    covered = set().union(*(row_pairs(r, DIMENSIONS) for r in rows))
    forbidden = {tuple(sorted((a, b), key=lambda p: list(DIMENSIONS).index(p[0]))) for a, b, _ in FORBIDDEN}
    assert not covered & forbidden
    assert all_pairs(DIMENSIONS) - forbidden <= covered


@pytest.mark.parametrize("i", range(len(matrix()["rows"])))
def test_valid_row_is_accepted(i, tmp_path):
    row = json.loads(ROWS_FILE.read_text())["rows"][i]
    cfg = row_config(row, tmp_path)
    # What each dimension's value means reached the config (nothing of the base config overrode it).
    assert cfg.synchronizer.mode == row["mode"]
    assert cfg.synchronizer.sync_method == ("collective" if row["sync"] == "collective" else "checkpoint")
    assert cfg.synchronizer.delta.enabled == (row["sync"] == "checkpoint+delta")
    assert cfg.explorer.partial.enabled == (row["partial"] == "on")
    assert cfg.taskset.workflow.type == row["workflow"]
    assert (
        cfg.algorithm
        == validate_config(
            small_config("/m", "/t", "/s") | {"algorithm": {"preset": row["preset"], "repeat_times": 2}}
        ).algorithm
    )
    assert cfg.eval.enabled == (row["eval"] == "on")
    assert sorted(t.type for t in cfg.monitor.trackers) == (
        [] if row["trackers"] == "none" else ["mlflow", "tensorboard", "wandb"]
    )
    assert cfg.placement.type == row["placement"]
    assert cfg.buffer.storage.url.startswith("s3://") == (row["storage"] == "s3")


@pytest.mark.parametrize("i", range(len(matrix()["invalid"])))
def test_forbidden_pair_is_refused_naming_the_field(i):
    case = json.loads(ROWS_FILE.read_text())["invalid"][i]
    with pytest.raises(ConfigError) as e:
        row_config(case["row"])
    assert case["field"] in str(e.value), str(e.value)


# ---- regressions the matrix found


def test_set_placement_type_alone_switches_the_variant():
    # A validated config holds placement.devices: null (the local variant's); `set placement.type=deployments`
    # refused it as an unknown key of the deployments variant (issue 42, item 6, defect a). And back.
    from flows.common import with_overrides

    deployed = with_overrides(base_config(), ["placement.type=deployments"])
    assert deployed.placement.type == "deployments"
    assert with_overrides(deployed, ["placement.type=local"]).placement.type == "local"
    # A value the user gave that the new variant has no field for is still refused, naming it.
    with pytest.raises(ConfigError, match=r"placement\.deployments\.devices|placement\.devices"):
        with_overrides(
            base_config(), ["placement.devices={trainer: [0], explorers: [[1]]}", "placement.type=deployments"]
        )


def test_set_synchronizer_mode_alone_switches_the_variant():
    from flows.common import with_overrides

    decoupled = with_overrides(base_config(), ["synchronizer.mode=fully_async"])
    assert (
        with_overrides(decoupled, ["synchronizer.mode=synchronous"]).synchronizer.mode == "synchronous"
    )  # max_backlog_steps: 8 (the default) was refused
    with pytest.raises(ConfigError, match="synchronizer.max_backlog_steps"):
        with_overrides(decoupled, ["synchronizer.max_backlog_steps=2", "synchronizer.mode=synchronous"])


def test_set_algorithm_preset_on_a_validated_config_takes_the_presets_knobs():
    # A validated config holds the knobs its preset expanded to; `set algorithm.preset=gspo` kept grpo's
    # (ppo_clip loss, token-mean): the preset changed in name only. Knobs the config set itself stay.
    from flows.common import with_overrides

    for preset in ("gspo", "dapo", "rloo"):
        fresh = validate_config(
            small_config("/m", "/t", "/s") | {"algorithm": {"preset": preset, "repeat_times": 2}}
        ).algorithm
        assert with_overrides(base_config(), [f"algorithm.preset={preset}"]).algorithm == fresh
    tuned = with_overrides(base_config(), ["algorithm.loss.clip_eps_high=0.3"])
    assert with_overrides(tuned, ["algorithm.preset=rloo"]).algorithm.loss.clip_eps_high == 0.3


def test_mlflow_gets_the_evaluations_metrics(tmp_path):
    # An evaluation's metrics are named `<set>/pass@1`, `<set>/avg@2`: MLflow refuses `@`, and one refused
    # name fails the batch, which turned the tracker off for the run (issue 42, item 6, defect b).
    import time

    from mlflow.tracking import MlflowClient

    from rl_engine.run.context import start_run
    from rl_engine.run.report import record_step
    from rl_engine.run.trackers import TrackerFeed, build_trackers, load_tracker_state

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    data = {
        "name": "r",
        "model": {"path": str(tmp_path / "model")},
        "taskset": {"path": str(tmp_path / "tasks.jsonl")},
        "buffer": {"storage": {"url": str(tmp_path / "runs")}},
    }
    data["monitor"] = {"trackers": [{"type": "mlflow", "tracking_uri": store, "experiment": "unit"}]}
    run = start_run(validate_config(data))
    warnings: list[str] = []
    with TrackerFeed(
        run,
        build_trackers(run.cfg.monitor, run, warn=lambda m, *a: warnings.append(m % a)),
        poll_s=0.1,
        warn=lambda m, *a: warnings.append(m % a),
    ):
        record_step(run, "trainer", 1, {"step": 1, "version": 1, "reward_mean": 0.5})
        record_step(
            run, "eval", 1, {"version": 1, "heldout/pass@1": 0.25, "heldout/avg@2": 0.25, "heldout/reward_mean": 0.5}
        )
        time.sleep(0.3)
    assert warnings == []
    run_id = load_tracker_state(run, "mlflow")["run_id"]
    logged = MlflowClient(store).get_run(run_id).data.metrics
    assert (
        logged["eval/heldout/pass_at_1"] == logged["eval/heldout/avg_at_2"] == 0.25
        and logged["trainer/reward_mean"] == 0.5
    )


def test_resumed_trainer_drops_the_stopped_attempts_weights_from_its_version(tmp_path):
    # A resumed trainer announces each version before writing it; the stopped attempt's files of that
    # number were still committed: an explorer loaded them while the trainer deleted them (a fully_async
    # delta run's resume: `no *.safetensors files in checkpoint directory .../version=3`). The matrix's
    # row 2 (fully_async, checkpoint+delta, cancelled and resumed) found it.
    import fsspec

    from rl_engine.pruning import list_dirs
    from rl_engine.sync import drop_versions_from
    from rl_engine.sync.checkpoint import CHECKPOINTS
    from rl_engine.sync.delta import DELTAS

    cfg = with_set(
        ["synchronizer.sync_method=checkpoint", "synchronizer.delta.enabled=true", f"buffer.storage.url={tmp_path}"]
    ).resolved()
    for kind, numbers in ((CHECKPOINTS, [1, 2, 4]), (DELTAS, [3, 5])):
        for n in numbers:
            d = Path(kind.dir(str(tmp_path / "pairwise"), n))
            d.mkdir(parents=True)
            (d / kind.marker).write_text("{}")
    Path(DELTAS.dir(str(tmp_path / "pairwise"), 6)).mkdir()  # uncommitted: a write the stop cut short
    root = str(tmp_path / "pairwise")
    fs = fsspec.filesystem("file")
    assert drop_versions_from(cfg, fs, root, 3) == [3, 4, 5, 6]
    assert list_dirs(fs, root, CHECKPOINTS) == ([1, 2], [])
    assert list_dirs(fs, root, DELTAS) == ([], [])
    assert drop_versions_from(with_set(["synchronizer.sync_method=collective"]).resolved(), fs, root, 0) == []


def with_set(overrides: list[str]) -> RFTConfig:
    from flows.common import with_overrides

    return with_overrides(base_config(), overrides)
