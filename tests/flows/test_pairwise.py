"""Features tested together, end to end: every valid row of the pairwise matrix
(harness/pairwise.py, tests/flows/pairwise_rows.json) as a real flow run of a few trainer steps on
the tiny model with warm engines (RFT_KEEP_ENGINES, tests/flows/conftest.py), checked for what the
one-feature tests check: every experience written once, in whole groups, explorer steps without
gaps, the staleness bound, every trainer step recorded, tracker metrics present (MLflow's
evaluation metrics too), evaluation records, and a run stopped mid-run resuming to the end.

To keep the matrix within minutes, two values stand in for what they name: placement
`deployments` (each role a flow run of its own process on a Prefect worker, engines started cold
per role and run) is covered at the config level only (tests/flows/test_pairwise_config.py) and
runs here as `local`, the rest of its row as given; resume `kill` cancels the run mid-run in this
process (the flow run's cancel through the Prefect API and its board's stop request at once:
harness/cancel.py, which test_cancel_resume.py uses too), then resumes it from its last
trainer checkpoint, rather than SIGKILLing an `rft run` (tests/flows/test_kill_resume.py does that).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from cli.run import run_config
from harness.cancel import run_and_cancel
from harness.kill_resume import schedule_breaks
from harness.pairwise import row_overrides
from harness.runs import small_config
from harness.trackers import tensorboard_scalars, wandb_history
from rl_engine.config import validate_config
from rl_engine.run.context import RunContext, open_run
from rl_engine.run.report import load_evaluations, read_best
from rl_engine.run.trackers import load_tracker_state
from rl_engine.storage import join

pytestmark = pytest.mark.slow

ROWS = json.loads(Path(__file__).with_name("pairwise_rows.json").read_text())["rows"]
TOTAL = 3  # trainer steps of a row's run
KILLED_TOTAL = 6  # of a row stopped at version >= KILL_AT and resumed (checkpoints every 2 steps)
KILL_AT = 2


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory) -> str:
    """An MLflow sqlite store (offline: no server), its tables created once for the module."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()
    return uri


def row_run_config(
    row: dict[str, str],
    name: str,
    total: int,
    tiny_model_dir: str,
    task_file: str,
    storage: str,
    s3: tuple | None,
    mlflow_uri: str,
):
    """The row's config: its overrides as a flow run's `set` parameter on a small run's config;
    placement `deployments` is run as `local` (module docstring)."""
    from flows.common import with_overrides

    base = validate_config(
        small_config(tiny_model_dir, task_file, storage, name=name, total_steps=total, checkpoint_interval=2)
    )
    overrides = row_overrides(row, {"tasks": task_file, "storage": storage, "s3": s3, "mlflow_uri": mlflow_uri})
    cfg = with_overrides(base, overrides)
    assert cfg.placement.type == row["placement"]
    return with_overrides(cfg, ["placement.type=local"])


def stored(run: RunContext) -> list[dict]:
    """Every committed experience row of the run (the data files its commit records name), on any storage."""
    fs, root = run.fs()
    fs.invalidate_cache()
    records = [json.loads(fs.cat_file(p)) for p in fs.glob(join(root, "buffer", "_commits", "*", "*.json"))]
    files = [join(root, "buffer", r["path"]) for r in records]
    table = ds.dataset(files, format="ipc", filesystem=fs).to_table()
    return table.select(
        ["experience_id", "explorer_id", "explorer_step", "group_id", "versions", "segments"]
    ).to_pylist()


def recorded_steps(run: RunContext, role: str) -> set[int]:
    fs, root = run.fs()
    fs.invalidate_cache()
    return {
        int(p.rsplit("step=", 1)[1].split(".")[0])
        for p in fs.glob(join(root, "metrics", f"role={role}", "step=*.json"))
    }


def local_trackers_dir(run: RunContext, tmp_path: Path) -> Path:
    """The run's trackers/ directory on this machine (copied from object storage)."""
    fs, root = run.fs()
    if run.url.startswith("s3://"):
        fs.get(join(root, "trackers"), str(tmp_path / "trackers"), recursive=True)
        return tmp_path / "trackers"
    return Path(run.url, "trackers")


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "i", range(len(ROWS)), ids=[f"{i}-{r['mode']}-{r['sync']}-{r['workflow']}" for i, r in enumerate(ROWS)]
)
def test_pairwise_row_end_to_end(i, request, prefect_server, tiny_model_dir, task_file, mlflow_store, tmp_path):
    row = ROWS[i]
    s3 = request.getfixturevalue("s3_bucket") if row["storage"] == "s3" else None
    name, killed = f"pw{i}", row["resume"] == "kill"
    total = KILLED_TOTAL if killed else TOTAL
    cfg = row_run_config(row, name, total, tiny_model_dir, task_file, str(tmp_path / "runs"), s3, mlflow_store)
    url, options = cfg.run_url, cfg.buffer.storage.fs_options()

    if killed:
        # The stop request first, as the flow's cancel watcher posts it (it polls every second, by
        # when a tiny run's few steps may all be done), then the flow run's cancel through the API.
        first, cancelled = run_and_cancel(cfg, KILL_AT, post_stop=True, timeout_s=200)
        assert cancelled and not isinstance(first, dict), (
            f"the run ended before the trainer reached version {KILL_AT}: {first}"
        )
        assert max(recorded_steps(open_run(url, options), "trainer")) < total, (
            f"the run was not stopped mid-run: {first}"
        )
        summary = run_config(open_run(url, options).cfg, resume=url)
    else:
        summary = run_config(cfg)
    run = open_run(summary["run"], options)
    assert summary["final_version"] == total

    # Exactly once, whole groups, explorer steps without gaps (tests/flows/test_modes.py, test_partial_flows.py).
    rows = stored(run)
    assert rows and len({r["experience_id"] for r in rows}) == len(rows)
    assert set(Counter(r["group_id"] for r in rows).values()) == {cfg.algorithm.repeat_times}
    for e in range(cfg.explorer.count):
        steps = sorted({r["explorer_step"] for r in rows if r["explorer_id"] == e})
        assert steps == list(range(1, len(steps) + 1)), f"explorer {e}: steps {steps}"
    # Versions and staleness: every segment generated by a version the mode allows (harness/kill_resume.py's
    # check: rendezvous, the schedule's; decoupled, admission control's floor); without partial rollouts
    # (whose continued generations span versions) the trained staleness within the mode's bound too.
    assert schedule_breaks({"run": run, "rows": rows, "before": set()}) == []
    s = cfg.synchronizer
    if row["partial"] == "off":
        assert summary["max_staleness_seen"] <= (
            s.max_staleness if s.mode in ("fully_async", "multi_explorer") else s.sync_interval - 1 + s.sync_offset
        )
    assert all(v <= total for r in rows for v in r["versions"])
    assert recorded_steps(run, "trainer") == set(range(1, total + 1))

    if row["lora"] == "on":  # the run's model: merged, the adapter beside it (on S3 too)
        fs, root = run.fs()
        assert fs.exists(join(root, "model", "adapter", "adapter_config.json"))

    if row["eval"] == "on":  # at the start and at the end, each with its @-named metrics; the best kept
        records = load_evaluations(run)
        assert {0, total} <= {r["version"] for r in records}
        assert all(0.0 <= r["heldout/pass@1"] <= 1.0 and "heldout/avg@2" in r for r in records)
        assert read_best(run) is not None

    if row["trackers"] == "all":
        from mlflow.tracking import MlflowClient

        ids = {t: load_tracker_state(run, t) for t in ("tensorboard", "mlflow", "wandb")}
        assert all(ids.values()), ids
        client = MlflowClient(mlflow_store)
        assert {m.step for m in client.get_metric_history(ids["mlflow"]["run_id"], "trainer/reward_mean")} == set(
            range(1, total + 1)
        )
        logged = client.get_run(ids["mlflow"]["run_id"]).data.metrics
        if row["eval"] == "on":
            assert "eval/heldout/pass_at_1" in logged and "eval/heldout/avg_at_2" in logged, sorted(logged)
        trackers = local_trackers_dir(run, tmp_path)
        assert {st for st, _, _ in tensorboard_scalars(str(trackers / "tensorboard"))["trainer/reward_mean"]} == set(
            range(1, total + 1)
        )
        history = wandb_history(str(trackers / "wandb"), ids["wandb"]["run_id"])
        assert {json.loads(h["trainer/step"]) for h in history if "trainer/step" in h} == set(range(1, total + 1))
