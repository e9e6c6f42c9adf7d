"""Lineages as real flow runs (one_step_off_policy, partial rollouts on): a second run continues the
first one's trained weights and pending continuations on tasks the lineage has not used, `latest`
moves only when a run succeeds, a failing run leaves it, and a run whose lineage is busy waits for
the lock (or is refused) and never overlaps.

    .venv/bin/python -m pytest tests/flows/test_lineage_flows.py
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from cli.run import run_config
from harness.cancel import run_and_cancel
from harness.runs import PARTIAL, small_config
from rl_engine.buffer import ContinuationStore
from rl_engine.config import LineageConfig, validate_config
from rl_engine.errors import UserError
from rl_engine.rewards import load_taskset
from rl_engine.run import lineage
from rl_engine.run.context import open_run
from rl_engine.storage import open_storage
from tests.flows.test_lora_run import LORA

pytestmark = pytest.mark.slow

SYNC = {"mode": "one_step_off_policy", "sync_offset": 1}


def raising_reward(prompt: str, response: str, task) -> float:
    raise ValueError("reward service down")


def length_reward(prompt: str, response: str, task) -> float:
    """Rewards that differ within a group (the random tiny model never answers right), so training moves the weights."""
    return float(len(response))


def lineage_config(model_dir: str, task_file: str, storage: str, **extra) -> dict:
    data = small_config(
        model_dir, task_file, storage, name=extra.pop("name", None), total_steps=extra.pop("total_steps", 4), **SYNC
    )
    data["explorer"]["partial"] = dict(PARTIAL)
    data["lineage"] = {"name": "nightly", **extra.pop("lineage", {})}
    data["taskset"]["reward"] = {"type": "python", "function": "tests.flows.test_lineage_flows:length_reward"}
    return data


def pending_rows(run_url: str) -> dict[str, dict]:
    store = ContinuationStore(*open_storage(run_url, {}), 0)
    t = store.load([e.id for e in store.list() if e.kind == "pending"])
    return {r["experience_id"]: r for r in t.to_table().select(["experience_id", "task_id", "segments"]).to_pylist()}


def test_two_runs_of_a_lineage_continue_and_a_failed_run_leaves_latest(
    prefect_server, tiny_model_dir, task_file, tmp_path
):
    storage = str(tmp_path / "runs")
    url = lineage.lineage_url(storage, "nightly")

    first = run_config(validate_config(lineage_config(tiny_model_dir, task_file, storage)))
    run1 = first["run"]
    assert Path(run1).name.startswith(
        "one_step_off_policy-nightly-"
    )  # the run directory carries the lineage, and so does its flow run
    assert [r.state.type.value for r in flow_runs_named(Path(run1).name)] == ["COMPLETED"]
    assert lineage.read_latest(url)["run"] == run1 and lineage.read_latest(url)["model"] == f"{run1}/model"
    (entry1,) = lineage.read_runs(url)
    consumed1 = set(entry1["tasks"])
    assert entry1["status"] == "completed" and entry1["base_model"] == tiny_model_dir
    held1 = pending_rows(run1)
    assert held1, "the first run left no pending continuation"
    assert consumed1 == {r["task_id"] for r in stored_rows_with_tasks(run1)} | {r["task_id"] for r in held1.values()}

    # The second run; meanwhile latest.json keeps pointing at the first.
    seen, done = [], threading.Event()
    watcher = threading.Thread(target=watch_latest, args=(url, Path(storage), run1, seen, done), daemon=True)
    watcher.start()
    try:
        # With LoRA: it starts from the first run's merged model with a fresh (zero) adapter, and
        # continues the first run's partial generations with its newer adapters.
        data = lineage_config(tiny_model_dir, task_file, storage, name="second")
        data["model"]["lora"] = LORA
        second = run_config(validate_config(data))
    finally:
        done.set()
        watcher.join(10)
    run2 = second["run"]
    assert seen and set(seen) == {run1}, f"latest.json moved during the second run: {seen}"
    assert lineage.read_latest(url)["run"] == run2

    # Its weights before its first step are the first run's final weights.
    cfg2 = open_run(run2).cfg
    assert cfg2.model.path == f"{run1}/model"
    final1 = load_file(f"{run1}/trainer_state/step=4/model.safetensors")
    start2 = load_file(f"{cfg2.model.path}/model.safetensors")
    assert set(start2) <= set(final1) and len(start2) > 5
    for name, w in start2.items():
        assert (w == final1[name]).all(), name
    assert any(
        (w != load_file(f"{tiny_model_dir}/model.safetensors")[n]).any() for n, w in start2.items()
    )  # trained, not the base

    # It drew no task the first consumed: its task set is the unused tasks, frozen under the lineage.
    drawable = {t.task_id for t in load_taskset(cfg2.taskset)}
    assert drawable and not drawable & consumed1 and cfg2.taskset.path == f"{url}/tasks/second.taskview.json"
    rows2 = stored_rows_with_tasks(run2)
    carried_tasks = {r["task_id"] for r in held1.values()}
    assert not ({r["task_id"] for r in rows2} - carried_tasks) & consumed1
    assert {r["task_id"] for r in rows2} - carried_tasks <= drawable

    # It continued the first run's pending generations: same experience ids, the first run's segments
    # first, renumbered (the first run's final version 4 is version 0, its explorer step 4 is step 0).
    continued = [r for r in rows2 if r["experience_id"] in held1]
    assert continued, "none of the first run's continuations reached the second run's buffer"
    v1, e1 = first["final_version"], first["explorer_steps"]
    for r in continued:
        before = [
            {**s, "version": s["version"] - v1, "explorer_step": s["explorer_step"] - e1}
            for s in held1[r["experience_id"]]["segments"]
        ]
        assert r["segments"][: len(before)] == before and r["task_id"] == held1[r["experience_id"]]["task_id"]
        assert all(s["version"] <= 0 and s["explorer_step"] <= 0 for s in before)
    trained2 = [json.loads(p.read_text()) for p in Path(run2, "metrics", "role=trainer").glob("step=*.json")]
    assert len(trained2) == 4 and all(
        m["version_gap_mean"] >= 0 for m in trained2
    )  # no token newer than the weights it is trained with
    assert any(len(r["segments"]) > len(held1[r["experience_id"]]["segments"]) for r in continued)  # given new segments
    still = pending_rows(run2)
    assert set(held1) <= {r["experience_id"] for r in continued} | set(still)  # none lost
    assert Path(
        run2, "model", "adapter", "adapter_model.safetensors"
    ).is_file()  # its model: merged, the adapter beside
    entry2 = lineage.read_runs(url)[-1]
    assert (
        entry2["status"] == "completed"
        and entry2["base_model"] == f"{run1}/model"
        and carried_tasks <= set(entry2["tasks"])
    )

    # A run that fails (its reward raises on every sample) leaves latest where it was.
    bad = lineage_config(tiny_model_dir, task_file, storage, name="third")
    bad["taskset"]["reward"] = {"type": "python", "function": "tests.flows.test_lineage_flows:raising_reward"}
    with pytest.raises(Exception, match="reward"):
        run_config(validate_config(bad))
    assert lineage.read_latest(url)["run"] == run2
    last = lineage.read_runs(url)[-1]
    assert last["run"].endswith("/third") and last["status"] == "failed"
    assert lineage.used_task_ids(lineage.read_runs(url)) == consumed1 | set(
        entry2["tasks"]
    )  # a failed run consumes none
    lineage.lock(url, {}, LineageConfig(name="nightly", when_busy="refuse")).release()  # and its lock is free


def flow_runs_named(name: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))


def flow_run_state(flow_run_id) -> str:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).state.type.value


def stored_rows_with_tasks(run_url: str) -> list[dict]:
    import pyarrow.dataset as ds

    table = ds.dataset(f"{run_url}/buffer", format="ipc", partitioning="hive", exclude_invalid_files=True).to_table()
    return table.select(["experience_id", "task_id", "segments"]).to_pylist()


def watch_latest(url: str, storage: Path, run1: str, seen: list, done: threading.Event) -> None:
    """What latest.json says while the second run goes on: from its start until its report is
    written (the flow publishes the report, then records the run's success)."""
    run = storage / "second"
    while not done.wait(0.1):
        now = (lineage.read_latest(url) or {}).get("run")
        if (run / "config.yaml").exists() and not (run / "report" / "summary.json").exists():  # still so after the read
            seen.append(now)


def test_a_busy_lineage_waits_or_refuses_and_never_overlaps(prefect_server, tiny_model_dir, task_file, tmp_path):
    storage = str(tmp_path / "runs")
    url = lineage.lineage_url(storage, "nightly")
    held = lineage.lock(url, {}, LineageConfig(name="nightly"))  # another run of the lineage holds it
    try:
        refused = lineage_config(
            tiny_model_dir, task_file, storage, name="refused", total_steps=2, lineage={"when_busy": "refuse"}
        )
        with pytest.raises(UserError, match="lineage 'nightly' is busy"):
            run_config(validate_config(refused))
        assert not (tmp_path / "runs" / "refused").exists()  # refused before it touched anything

        waiting = lineage_config(
            tiny_model_dir, task_file, storage, name="waiting", total_steps=2, lineage={"wait_timeout_s": 300}
        )
        result: list = []
        runner = threading.Thread(target=lambda: result.append(run_config(validate_config(waiting))), daemon=True)
        runner.start()
        time.sleep(8)
        assert runner.is_alive() and not (tmp_path / "runs" / "waiting").exists(), (
            "the run started while the lineage was busy"
        )
        released = time.time()
    finally:
        held.release()
    runner.join(300)
    assert not runner.is_alive() and result and result[0]["final_version"] == 2
    assert (
        tmp_path / "runs" / "waiting" / "config.yaml"
    ).stat().st_mtime >= released  # it began after the lock was free
    assert lineage.read_latest(url)["run"].endswith("/waiting")


def test_a_cancelled_run_leaves_latest_and_its_resume_moves_it(prefect_server, tiny_model_dir, task_file, tmp_path):
    storage = str(tmp_path / "runs")
    url = lineage.lineage_url(storage, "nightly")
    data = lineage_config(tiny_model_dir, task_file, storage, name="cancel-me", total_steps=60)  # outlasts the cancel
    result, cancelled = run_and_cancel(validate_config(data), 3)
    assert cancelled and not isinstance(result, dict), f"the run was not cancelled: {result}"
    assert [flow_run_state(i) for i in cancelled] == ["CANCELLED"]
    assert lineage.read_latest(url) is None  # a cancelled run never moves latest
    (entry,) = lineage.read_runs(url)
    assert (
        entry["status"] == "cancelled"
        and entry["run"].endswith("/cancel-me")
        and lineage.used_task_ids([entry]) == set()
    )

    # Its resume holds the lineage's lock, keeps the model and tasks it started with, and moves latest on success.
    run = open_run(str(tmp_path / "runs" / "cancel-me"))
    summary = run_config(run.cfg, resume=run.url)
    assert (
        summary["final_version"] == 60 and open_run(run.url).cfg.taskset.path == f"{url}/tasks/cancel-me.taskview.json"
    )
    assert lineage.read_latest(url)["run"] == run.url
    assert [r["status"] for r in lineage.read_runs(url)] == ["cancelled", "completed"]
