"""What a Prefect user sees of a mode's flow run, and the `set` parameter, on in-process flow runs
against the session's Prefect server (tests/flows/conftest.py): checked through the Prefect client.

One small synchronous run with `set=["trainer.total_steps=2"]` serves most tests: its stored config
differs from `cfg` in that field only; the flow run is named after the run; its result (stored as
JSON) is the run's summary; its artifacts sit under keys stable per mode flow (no run name in
them), images as markdown, a progress artifact at 100% and a link to the trained model.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from flows.rendezvous import synchronous
from harness.runs import small_config
from rl_engine.config import ConfigError, validate_config
from rl_engine.errors import UserError
from tests.flows.conftest import artifacts_of, flatten

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base_cfg(tiny_model_dir, task_file, tmp_path_factory) -> dict:
    data = small_config(
        tiny_model_dir, task_file, str(tmp_path_factory.mktemp("ops-runs")), mode="synchronous", total_steps=5
    )
    data["synchronizer"]["collective"]["port"] = None  # a free port per run
    return data


@pytest.fixture(scope="module")
def done_run(prefect_server, base_cfg) -> dict[str, Any]:
    """A synchronous flow run given `cfg` (5 steps) and `set=["trainer.total_steps=2"]`."""
    from prefect.client.orchestration import get_client

    state = synchronous(cfg=validate_config(base_cfg), set=["trainer.total_steps=2"], return_state=True)
    assert state.is_completed(), state
    summary = state.result()
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(state.state_details.flow_run_id)
    return {"summary": summary, "flow_run": flow_run, "artifacts": artifacts_of(flow_run.id)}


def test_set_changes_exactly_the_named_field(done_run, base_cfg):
    run = Path(done_run["summary"]["run"])
    stored = flatten(yaml.safe_load((run / "config.yaml").read_text()))
    given = flatten(validate_config(base_cfg).resolved().model_dump(mode="json"))
    differ = {k for k in stored.keys() | given.keys() if stored.get(k) != given.get(k)}
    assert differ == {"name", "trainer.total_steps"}, differ  # the name is drawn per run
    assert stored["trainer.total_steps"] == 2 and done_run["summary"]["final_version"] == 2


def test_flow_run_named_after_the_run_result_is_the_summary_as_json(done_run):
    flow_run, summary = done_run["flow_run"], done_run["summary"]
    name = Path(summary["run"]).name
    assert flow_run.name == name and re.fullmatch(r"synchronous-\d{8}-\d{6}-[0-9a-f]{6}", name), flow_run.name
    # The state's result, read back through the API from the result store, is the summary, stored as JSON (no pickle).
    assert flow_run.state.result() == summary and json.loads(json.dumps(summary)) == summary
    assert flow_run.state.data.serializer.type == "json"
    assert json.loads(Path(flow_run.state.data.storage_key).read_text()) == summary


def test_the_run_lifecycle_shows_as_tasks_of_the_flow_run(done_run):
    """The steps of rl_engine/run/driver.py are task runs of the mode's flow run, in order, all
    completed: what the UI draws in the run's graph (docs/concepts/roles.md, Run)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import TaskRunSort

    with get_client(sync_client=True) as client:
        tasks = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[done_run["flow_run"].id])),
            sort=TaskRunSort.EXPECTED_START_TIME_ASC,
        )
    names = [t.name for t in tasks]
    assert all(t.state.is_completed() for t in tasks), [(t.name, t.state.type) for t in tasks]
    steps = [n for n in names if n in ("preflight", "start-run", "sweep-buffer", "publish-report", "record-lineage")]
    assert steps == ["preflight", "start-run", "sweep-buffer", "publish-report", "record-lineage"], names
    assert {"trainer", "explorer-0"} <= set(names), names
    # The roles run between start-run and sweep-buffer.
    assert names.index("start-run") < names.index("trainer") < names.index("sweep-buffer"), names


def test_artifacts_under_stable_keys_with_the_run_in_the_description(done_run):
    arts, summary = done_run["artifacts"], done_run["summary"]
    name = Path(summary["run"]).name
    assert set(arts) == {
        f"synchronous-{what}" for what in ("metrics", "timeline", "reward-curve", "summary", "progress", "model")
    }
    for key, art in arts.items():
        assert name not in key and name in art.description, (key, art.description)
    assert [row["step"] for row in json.loads(arts["synchronous-metrics"].data)] == [1, 2]
    assert arts["synchronous-summary"].type == "markdown" and f"# Run `{name}`" in arts["synchronous-summary"].data
    # Images: markdown whose only content is the image (the UI prints nothing of the data: URL).
    for what in ("timeline", "reward-curve"):
        art = arts[f"synchronous-{what}"]
        m = re.fullmatch(r"!\[([^\]]+)\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", art.data)
        assert art.type == "markdown" and m, art.data[:200]
        png = base64.b64decode(m.group(2))
        assert png.startswith(b"\x89PNG") and png == (Path(summary["run"]) / "report" / f"{what}.png").read_bytes()
    progress = arts["synchronous-progress"]
    assert progress.type == "progress" and progress.data == 100.0 and progress.description.endswith("trainer step 2/2")
    model = arts["synchronous-model"]
    uri = (Path(summary["run"]) / "model").resolve().as_uri()
    assert (
        model.data == f"[{summary['run']}/model]({uri})" and (Path(summary["run"]) / "model" / "config.json").is_file()
    )


def test_buffer_stats_reports_the_finished_runs_trainer_state(done_run, capsys):
    """`rft buffer stats RUN` on a finished run reads the trainer's newest committed state
    (trainer_state/step=2/state.json, the cursor a resume loads), not the buffer/cursor/ the
    trainer never writes: every experience the run trained is consumed, none left unread."""
    from rl_engine.buffer.stats import main

    summary = done_run["summary"]
    assert main([summary["run"], "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    trained = summary["experiences"]["trained"]
    assert trained > 0 and s["experiences"] == summary["experiences"]["generated"]
    assert s["trainer_state"] == {
        "trainer_step": 2,
        "version": 2,
        "path": "trainer_state/step=2",
        "consumed": trained,
        "dropped_stale": 0,
        "skipped_corrupt": 0,
        "unread": s["experiences"] - trained,
    }
    assert s["buffer_cursor"] is None
    assert main([summary["run"]]) == 0
    out = capsys.readouterr().out
    assert f"trainer state:    trainer_state/step=2 (version 2): {trained} consumed" in out
    assert "none committed" not in out and "buffer cursor" not in out


def test_the_trainer_moves_the_progress_artifact_every_step(prefect_server, base_cfg):
    """The trainer's step callback (tasks/report.py) moves the run's progress artifact to t/T at every step t."""
    from prefect import flow
    from prefect.artifacts import Artifact

    from rl_engine.run.context import start_run
    from tasks.report import start_progress, trainer_step_done

    run = start_run(
        validate_config(dict(base_cfg, name="progress-steps", trainer=dict(base_cfg["trainer"], total_steps=4)))
    )

    @flow
    def four_trainer_steps() -> list[tuple[float, str]]:
        progress_id = start_progress(run, "test-ops")
        seen = [(Artifact.get("test-ops-progress").data, "")]
        on_step = trainer_step_done(run, progress_id)
        for t in range(1, 5):
            on_step(
                "trainer",
                {
                    "step": t,
                    "reward_mean": 0.5,
                    "reward_std": 0.1,
                    "staleness_max": 0,
                    "wait_experience_s": 0.0,
                    "train_s": 0.1,
                },
            )
            art = Artifact.get("test-ops-progress")
            seen.append((art.data, art.description))
        return seen

    assert four_trainer_steps() == [(0.0, "")] + [
        (25.0 * t, f"Run progress-steps: trainer step {t}/4") for t in range(1, 5)
    ]


def test_bad_override_is_refused_naming_the_key(prefect_server, base_cfg):
    cfg = validate_config(base_cfg)
    with pytest.raises(ConfigError, match=r"trainer\.total_stepz = 3: unknown key"):
        synchronous(cfg=cfg, set=["trainer.total_stepz=3"])
    with pytest.raises(ConfigError, match=r"trainer\.total_steps = -1: Input should be greater than or equal to 1"):
        synchronous(cfg=cfg, set=["trainer.total_steps=-1"])
    with pytest.raises(ConfigError, match=r"expected KEY=VALUE"):
        synchronous(cfg=cfg, set=["trainer.total_steps"])


def test_mode_mismatch_is_refused_by_name(prefect_server, base_cfg):
    from flows.decoupled import fully_async

    cfg = validate_config(base_cfg)
    with pytest.raises(UserError, match=r"synchronizer.mode = 'synchronous', but this is the 'fully_async' flow"):
        fully_async(cfg=cfg)
    async_cfg = validate_config(dict(base_cfg, synchronizer=dict(base_cfg["synchronizer"], mode="fully_async")))
    with pytest.raises(UserError, match=r"synchronizer.mode = 'fully_async', but this is the 'synchronous' flow"):
        synchronous(cfg=async_cfg)
    with pytest.raises(UserError, match=r"synchronizer.mode = 'fully_async', but this is the 'synchronous' flow"):
        synchronous(cfg=cfg, set=["synchronizer.mode=fully_async"])
    with pytest.raises(UserError, match=r"a resumed run keeps the config it was started with"):
        synchronous(cfg=cfg, resume="/nowhere/run", set=["trainer.total_steps=3"])


def test_a_flow_run_checks_its_inputs_before_any_engine_starts(prefect_server, base_cfg, tiny_model_dir, tmp_path):
    """A deployment or API run gets `rft run`'s preflight: a model without weights fails by name, no run is started."""
    import shutil

    model = tmp_path / "no-weights"
    model.mkdir()
    shutil.copy(Path(tiny_model_dir) / "config.json", model)
    runs = Path(base_cfg["buffer"]["storage"]["url"])
    before = set(runs.iterdir())
    with pytest.raises(
        UserError,
        match=r"model.path = .*no-weights.*: no \*\.safetensors weights; save the model with model.save_pretrained",
    ):
        synchronous(cfg=validate_config(base_cfg), set=[f"model.path={model}"])
    assert set(runs.iterdir()) == before  # nothing written: the run never started
