"""rl_engine/run/lineage.py without engines (the S3 cases, marked slow, use moto's server): the latest pointer, runs.jsonl, unused-task selection over a
folder where new task files arrive (local and S3), the lineage's lock, and begin/end of a run.

    .venv/bin/python -m pytest tests/rl_engine/run/test_lineage.py
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from rl_engine.config import LineageConfig, TasksetConfig, validate_config
from rl_engine.errors import UserError
from rl_engine.rewards import load_taskset, write_taskset
from rl_engine.run import lineage
from rl_engine.run.context import start_run
from rl_engine.run.lease import LEASE_DIR
from rl_engine.storage import open_storage, write_json


def rows(prefix: str, n: int) -> list[dict]:
    return [{"question": f"{prefix}{i}+1=", "answer": str(i + 1)} for i in range(n)]


def test_latest_moves_atomically_and_runs_append(tmp_path):
    url = lineage.lineage_url(str(tmp_path), "nightly")
    assert url == f"{tmp_path}/lineages/nightly"
    assert lineage.read_latest(url) is None and lineage.read_runs(url) == []
    entry = lineage.move_latest(url, {}, "runs/a", "runs/a/model")
    assert lineage.read_latest(url) == entry and entry["run"] == "runs/a" and entry["model"] == "runs/a/model"
    lineage.move_latest(url, {}, "runs/b", "runs/b/model")
    assert lineage.read_latest(url)["run"] == "runs/b"
    # temp-then-rename leaves no temp file beside it
    assert sorted(p.name for p in (tmp_path / "lineages" / "nightly").iterdir()) == ["latest.json"]

    lineage.append_run(url, {}, {"run": "runs/a", "tasks": ["t1", "t2"], "status": "completed"})
    lineage.append_run(url, {}, {"run": "runs/b", "tasks": ["t3"], "status": "failed"})
    lineage.append_run(url, {}, {"run": "runs/c", "tasks": ["t4"], "status": "completed"})
    lines = (tmp_path / "lineages" / "nightly" / "runs.jsonl").read_text().splitlines()
    assert [json.loads(x)["run"] for x in lines] == ["runs/a", "runs/b", "runs/c"]
    # a failed run consumes nothing: its tasks are drawn again
    assert lineage.used_task_ids(lineage.read_runs(url)) == {"t1", "t2", "t4"}


@pytest.mark.slow  # moto's S3 server
def test_pointer_and_runs_on_s3(s3_bucket):
    root, opts = s3_bucket
    url = lineage.lineage_url(root, "nightly")
    lineage.move_latest(url, opts, f"{root}/r1", f"{root}/r1/model")
    lineage.append_run(url, opts, {"run": f"{root}/r1", "tasks": ["a"], "status": "completed"})
    lineage.append_run(url, opts, {"run": f"{root}/r2", "tasks": ["b"], "status": "completed"})
    assert lineage.read_latest(url, opts)["model"] == f"{root}/r1/model"
    assert [r["run"] for r in lineage.read_runs(url, opts)] == [f"{root}/r1", f"{root}/r2"]


def test_unused_tasks_from_a_folder_where_new_files_arrive(tmp_path):
    folder = tmp_path / "tasks"
    folder.mkdir()
    write_taskset(str(folder / "day-1.jsonl"), rows("a", 3))
    (folder / "notes.txt").write_text("not a task file")
    cfg = validate_config({"model": {"path": str(_model(tmp_path))}, "taskset": {"path": str(folder)}}).taskset
    first = load_taskset(cfg)
    assert [t.task_id for t in first] == ["day-1.jsonl#1", "day-1.jsonl#2", "day-1.jsonl#3"]
    used = {"day-1.jsonl#1", "day-1.jsonl#3"}
    assert [t.task_id for t in lineage.unused_tasks(first, used)] == ["day-1.jsonl#2"]

    write_taskset(str(folder / "day-2.jsonl"), rows("b", 2))  # new files arrive
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows("c", 1)), folder / "day-3.parquet")
    fresh = lineage.unused_tasks(load_taskset(cfg), used)
    assert [t.task_id for t in fresh] == ["day-1.jsonl#2", "day-2.jsonl#1", "day-2.jsonl#2", "day-3.parquet#1"]

    # a prefix selects the files whose path starts with it
    prefix = cfg.model_copy(update={"path": str(folder / "day-2")})
    assert [t.task_id for t in load_taskset(prefix)] == ["day-2.jsonl#1", "day-2.jsonl#2"]

    # frozen for the run: the same ids, prompts and answers come back from the lineage's task view,
    # which leaves out what the completed runs before it consumed, however runs.jsonl grows after
    url = lineage.lineage_url(str(tmp_path / "runs"), "nightly")
    lineage.append_run(url, {}, {"run": "runs/r0", "tasks": sorted(used), "status": "completed"})
    path = lineage.freeze_tasks(url, {}, "run-1", cfg, 1)
    lineage.append_run(url, {}, {"run": "runs/run-1", "tasks": ["day-2.jsonl#1"], "status": "completed"})
    back = load_taskset(cfg.model_copy(update={"path": path}))
    assert [(t.task_id, t.prompt, t.answer) for t in back] == [(t.task_id, t.prompt, t.answer) for t in fresh]

    with pytest.raises(UserError, match="no task files"):
        load_taskset(cfg.model_copy(update={"path": str(folder / "week-")}))


@pytest.mark.slow  # moto's S3 server
def test_taskset_folder_on_s3(s3_bucket):
    root, opts = s3_bucket
    write_taskset(f"{root}/tasks/day-1.jsonl", rows("a", 2), opts)
    write_taskset(f"{root}/tasks/day-2.jsonl", rows("b", 1), opts)
    got = load_taskset(TasksetConfig(path=f"{root}/tasks"), opts)
    assert [t.task_id for t in got] == ["day-1.jsonl#1", "day-1.jsonl#2", "day-2.jsonl#1"]
    got = load_taskset(TasksetConfig(path=f"{root}/tasks/day-2"), opts)
    assert [t.task_id for t in got] == ["day-2.jsonl#1"]


def test_lock_refuses_waits_and_expires(tmp_path):
    url = lineage.lineage_url(str(tmp_path), "nightly")
    held = lineage.lock(url, {}, LineageConfig(name="nightly", lock_ttl_s=30))
    try:
        with pytest.raises(UserError, match="lineage 'nightly' is busy"):
            lineage.lock(url, {}, LineageConfig(name="nightly", when_busy="refuse"))
        started = time.monotonic()
        with pytest.raises(UserError, match="waited lineage.wait_timeout_s = 1 s"):
            lineage.lock(url, {}, LineageConfig(name="nightly", wait_timeout_s=1.0), poll_s=0.2)
        assert 0.5 < time.monotonic() - started < 5

        # a waiter gets the lock once the holder lets go
        got: list = []
        waiter = threading.Thread(
            target=lambda: got.append(
                lineage.lock(url, {}, LineageConfig(name="nightly", wait_timeout_s=20), poll_s=0.1)
            ),
            daemon=True,
        )
        waiter.start()
        time.sleep(0.5)
        assert not got
    finally:
        held.release()
    waiter.join(20)
    assert got, "the waiting run never got the lock"
    got[0].release()

    # a dead holder (elsewhere: no process to check) stops renewing and its lock expires after its ttl
    fs, root = open_storage(url)
    write_json(
        fs,
        f"{root}/{LEASE_DIR}/gen=00000009.json",
        {"holder": "x", "host": "elsewhere", "pid": 1, "time": time.time() - 5, "ttl_s": 2},
    )
    lineage.lock(url, {}, LineageConfig(name="nightly", when_busy="refuse")).release()


def test_lock_survives_a_long_cpu_bound_run(tmp_path):
    """The lease is renewed by a thread: a holder busy in pure Python for 3 ttl keeps it."""
    url = lineage.lineage_url(str(tmp_path), "nightly")
    held = lineage.lock(url, {}, LineageConfig(name="nightly", lock_ttl_s=2.0))
    try:
        end, x = time.monotonic() + 6.0, 0
        while time.monotonic() < end:  # CPU-bound, holding the GIL between switches
            x += sum(i * i for i in range(1000))
        with pytest.raises(UserError, match="busy"):
            lineage.lock(url, {}, LineageConfig(name="nightly", when_busy="refuse"))
    finally:
        held.release()


def _model(tmp_path):
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text("{}")
    return d


def test_begin_points_at_latest_model_and_unused_tasks_end_moves_latest_on_success_only(tmp_path):
    base = _model(tmp_path)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    write_taskset(str(tasks / "a.jsonl"), rows("a", 4))
    data = {
        "name": "r1",
        "model": {"path": str(base)},
        "taskset": {"path": str(tasks)},
        "buffer": {"storage": {"url": str(tmp_path / "runs")}},
        "lineage": {"name": "nightly", "when_busy": "refuse"},
    }
    cfg = validate_config(data)
    assert validate_config({**data, "name": None}).resolved().name.startswith("synchronous-nightly-")

    first = lineage.begin(cfg, log=lambda _: None)
    try:
        assert first.cfg.model.path == str(base) and first.previous is None  # no successful run yet: the base model
        assert len(load_taskset(first.cfg.taskset)) == 4
        with pytest.raises(UserError, match="busy"):
            lineage.begin(cfg.model_copy(update={"name": "r2"}), log=lambda _: None)
        run = start_run(first.cfg)
        assert first.adopt(run) == {}
        # the run's buffer is empty: it consumed nothing; a failed run never moves latest
        entry = first.end(run, "failed")
        assert entry["status"] == "failed" and lineage.read_latest(first.url) is None
    finally:
        first.release()

    # a completed run that consumed two tasks (recorded as the flow does) and saved its model
    trained = tmp_path / "runs" / "r1" / "model"
    trained.mkdir()
    (trained / "config.json").write_text("{}")
    lineage.append_run(first.url, {}, {"run": run.url, "tasks": ["a.jsonl#1", "a.jsonl#3"], "status": "completed"})
    lineage.move_latest(first.url, {}, run.url, str(trained))

    second = lineage.begin(validate_config({**data, "name": "r2"}), log=lambda _: None)
    try:
        assert second.cfg.model.path == str(trained) and second.previous["run"] == run.url
        assert [t.task_id for t in load_taskset(second.cfg.taskset)] == ["a.jsonl#2", "a.jsonl#4"]
        assert second.cfg.taskset.path == f"{second.url}/tasks/r2.taskview.json"
    finally:
        second.release()
    base_start = lineage.begin(
        validate_config({**data, "name": "r3", "lineage": {"name": "nightly", "start_from": "base"}}),
        log=lambda _: None,
    )
    base_start.release()
    assert base_start.cfg.model.path == str(base)

    # every task used: refused naming the fix, and the lock is free again
    lineage.append_run(first.url, {}, {"run": "x", "tasks": ["a.jsonl#2", "a.jsonl#4"], "status": "completed"})
    with pytest.raises(UserError, match="used all 4 tasks"):
        lineage.begin(validate_config({**data, "name": "r4"}), log=lambda _: None)
    lineage.lock(first.url, {}, LineageConfig(name="nightly", when_busy="refuse")).release()


def test_task_pools_are_stored_once_and_old_lineages_stay_readable(tmp_path):
    """Each run of a lineage froze a copy of the tasks it could still draw (~120 KB a run of 4000
    tasks, issue 44); now the task file is stored once, by content, and each run's view names it
    and how many runs.jsonl lines' consumed ids it leaves out. A lineage whose runs froze copies
    (before task views) goes on: their configs still load, its next run draws what none consumed."""
    tasks = tmp_path / "tasks.jsonl"
    write_taskset(str(tasks), rows("a", 400))
    data = {
        "model": {"path": str(_model(tmp_path))},
        "taskset": {"path": str(tasks)},
        "buffer": {"storage": {"url": str(tmp_path / "runs")}},
        "lineage": {"name": "nightly"},
    }
    url = lineage.lineage_url(str(tmp_path / "runs"), "nightly")
    # an older lineage: run r0 froze a copy of its tasks and consumed the first 100
    old = [{"question": f"a{i}+1=", "answer": str(i + 1), "id": f"tasks.jsonl#{i + 1}"} for i in range(400)]
    old_copy = write_taskset(f"{url}/tasks/r0.jsonl", old)
    lineage.append_run(
        url, {}, {"run": "runs/r0", "tasks": [f"tasks.jsonl#{i}" for i in range(1, 101)], "status": "completed"}
    )
    assert len(load_taskset(TasksetConfig(path=old_copy))) == 400

    drawn = []
    for n, name in enumerate(("r1", "r2", "r3")):
        run = lineage.begin(validate_config({**data, "name": name}), log=lambda _: None)
        try:
            ids = [t.task_id for t in load_taskset(run.cfg.taskset)]
            drawn.append(len(ids))
            assert ids[0] == f"tasks.jsonl#{101 + 100 * n}" and run.cfg.taskset.path.endswith(f"/{name}.taskview.json")
            consumed = ids[:100]
        finally:
            run.release()
        lineage.append_run(url, {}, {"run": f"runs/{name}", "tasks": consumed, "status": "completed"})
        assert [t.task_id for t in load_taskset(run.cfg.taskset)] == ids  # a resume draws the same, runs.jsonl grown
    assert drawn == [300, 200, 100]
    pool = sorted(p.name for p in Path(url, "tasks", "pool").iterdir())
    assert len(pool) == 1 and pool[0].startswith("tasks-")  # the task file, stored once for all three runs
    views = [Path(url, "tasks", f"{name}.taskview.json").stat().st_size for name in ("r1", "r2", "r3")]
    assert max(views) < 400, views  # bytes a run, whatever the pool's size (a copy: 19.8, 13.2, 6.6 KB here)


def test_no_lineage_is_a_standalone_run(tmp_path):
    cfg = validate_config({"model": {"path": str(_model(tmp_path))}, "taskset": {"path": "x.jsonl"}})
    assert lineage.begin(cfg) is None


def test_consumed_tasks_and_carried_continuations(tmp_path):
    from rl_engine.buffer import BufferWriter, ContinuationStore
    from rl_engine.buffer.synthetic import make_batch

    task_file = tmp_path / "tasks.jsonl"
    write_taskset(
        str(task_file), [{"id": t, "question": f"q {t}", "answer": "1"} for t in ("b-g0", "b-g1", "p-g0", "x-g0")]
    )
    data = {
        "name": "r1",
        "model": {"path": str(_model(tmp_path))},
        "taskset": {"path": str(task_file)},
        "buffer": {"storage": {"url": str(tmp_path / "runs")}},
        "lineage": {"name": "nightly"},
        "explorer": {"partial": {"enabled": True, "segment_max_tokens": 4, "max_response_tokens": 100}},
    }
    prev = start_run(validate_config(data))
    BufferWriter(*open_storage(prev.url, {}), 0).write(1, make_batch(4, id_prefix="b", group_size=2, response_len=4))
    pending = make_batch(2, id_prefix="p", group_size=2, response_len=4, explorer_step=1, version=2)
    ContinuationStore(*open_storage(prev.url, {}), 0).save(pending, explorer_step=1)
    assert lineage.consumed_task_ids(prev) == ["b-g0", "b-g1", "p-g0"]  # committed and still pending
    from rl_engine.trainer.checkpoint import COMMIT_MARKER

    (Path(prev.url) / "trainer_state" / "step=3").mkdir(parents=True)
    (Path(prev.url) / "trainer_state" / "step=3" / COMMIT_MARKER).write_text(
        "{}"
    )  # the previous run ended at version 3

    write_taskset(str(tmp_path / "other.jsonl"), [{"id": "x-g0", "question": "q", "answer": "1"}])
    run = start_run(validate_config({**data, "name": "r2", "taskset": {"path": str(tmp_path / "other.jsonl")}}))
    assert lineage.carry_continuations(prev, run) == {0: ["p-0", "p-1"]}
    store = ContinuationStore(*run.fs(), 0)
    (entry,) = store.list()
    got = store.load().to_table()
    assert entry.kind == "pending" and got.drop(["versions", "segments", "explorer_step"]).equals(
        pending.to_table().drop(["versions", "segments", "explorer_step"])
    )
    # renumbered: the previous run's version 3 is this run's 0, its last step (1) this run's step 0
    assert got.column("versions").to_pylist() == [[-1] * 4] * 2 and got.column("explorer_step").to_pylist() == [0, 0]
    assert got.column("segments").to_pylist() == [[{"explorer_step": 0, "version": -1, "start": 0, "end": 4}]] * 2
    # the task resolves in the new run although its task set does not have it
    assert store.carried_tasks() == {
        "p-g0": {
            "task_id": "p-g0",
            "prompt": "q p-g0",
            "answer": "1",
            "row": {"id": "p-g0", "question": "q p-g0", "answer": "1"},
        }
    }
    # a run after that one carries them on, with their tasks, from the store that holds them now
    third = start_run(validate_config({**data, "name": "r3", "taskset": {"path": str(tmp_path / "other.jsonl")}}))
    assert lineage.carry_continuations(run, third) == {0: ["p-0", "p-1"]}
    assert set(ContinuationStore(*open_storage(third.url, {}), 0).carried_tasks()) == {"p-g0"}


@pytest.mark.slow  # moto's S3 server
def test_latest_model_on_s3_is_fetched_to_a_local_directory(s3_bucket, tmp_path):
    root, opts = s3_bucket
    fs, _ = open_storage(root, opts)
    fs.pipe({f"{root}/r1/model/config.json": b"{}", f"{root}/r1/model/model.safetensors": b"weights"})
    local = lineage.local_model(f"{root}/r1/model", opts, str(tmp_path / "cache"))
    assert (tmp_path / "cache" / "config.json").read_bytes() == b"{}" and (
        tmp_path / "cache" / "model.safetensors"
    ).read_bytes() == b"weights"
    assert local == str(tmp_path / "cache")
    assert lineage.local_model(str(tmp_path / "cache"), {}, "unused") == str(tmp_path / "cache")  # local: used in place
    with pytest.raises(UserError, match="no config.json"):
        lineage.local_model(f"{root}/r2/model", opts, str(tmp_path / "other"))
