"""Lineages: a series of runs (scheduled retraining) in which each run continues the last successful one.

A run with `lineage.name` set belongs to the lineage kept under `<storage>/lineages/<name>/`:

    latest.json        the last successful run and its trained model (moved atomically, on success only)
    runs.jsonl         one JSON line per run: run, base_model, model, tasks (ids it consumed), status, time
    lease/             the lineage's lock (a RunLease, rl_engine.run.lease): one run of a lineage at a time
    tasks/pool/<file>-<hash>.jsonl
                       each task file of `taskset.path` as a run found it, stored once (by content)
                       for every run that draws from it
    tasks/<run>.taskview.json
                       the tasks a run may draw, frozen when it started (a resume draws the same): its
                       pool files minus the ids consumed by the completed runs runs.jsonl held then
                       (rl_engine.rewards.tasks.read_task_view), a few hundred bytes per run
    tasks/<run>.jsonl  (lineages before task views) a copy of the tasks a run could draw: still read

A new run of a lineage (`begin`): takes the lock (waits up to `lineage.wait_timeout_s`, or refuses
at once with `when_busy: refuse`); starts from `latest.json`'s model unless `start_from: base` or
no run has succeeded yet; draws only tasks of `taskset.path` (a file, a folder or a prefix where
new task files arrive) that no completed run consumed; and, once its directory exists (`adopt`),
takes over the previous run's pending continuations (copied from that run's stores, whose
manifests are the source of truth) so its explorers continue them, with their tasks carried in
the new store's manifest and their versions and explorer steps renumbered (the previous run's
final weights are the new run's version 0, its last explorer step is step 0). `end(run, status)` records the run in runs.jsonl and, for `completed`
only, moves `latest.json`; `release()` frees the lock. A resumed run of a lineage takes the lock
and records itself on success, but keeps the model, tasks and continuations it started with.

Consumed tasks are those a run drew: every task id in its committed buffer and in its
continuation stores (groups still pending). Runs that failed or were cancelled are recorded but
consume nothing: their tasks are drawn again. Used by flows/common.py:run_mode; no Prefect here.

Tests: `.venv/bin/python -m pytest tests/rl_engine/run/test_lineage.py tests/flows/test_lineage_flows.py`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from rl_engine.config import LineageConfig, RFTConfig, validate_config
from rl_engine.errors import UserError
from rl_engine.rewards import Task, load_taskset
from rl_engine.rewards.tasks import VIEW_SUFFIX, taskset_files
from rl_engine.run.context import RunContext, open_run
from rl_engine.run.lease import RunLease
from rl_engine.storage import is_local, join, open_storage, read_json, write_bytes_atomic, write_json

LINEAGES_DIR = "lineages"
LATEST_FILE = "latest.json"
RUNS_FILE = "runs.jsonl"
TASKS_DIR = "tasks"
POOL_DIR = "pool"  # under TASKS_DIR: task files stored once


def lineage_url(storage_url: str, name: str) -> str:
    """`<storage>/lineages/<name>`: where a lineage's pointer, runs and lock live."""
    return f"{storage_url.rstrip('/')}/{LINEAGES_DIR}/{name}"


# --------------------------------------------------------------------------- pointer and runs


def read_latest(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The lineage's `latest.json` ({run, model, time}), or None before its first successful run."""
    fs, root = open_storage(url, storage_options)
    fs.invalidate_cache()
    try:
        return read_json(fs, join(root, LATEST_FILE))
    except FileNotFoundError:
        return None


def move_latest(url: str, storage_options: dict[str, Any] | None, run_url: str, model_url: str) -> dict[str, Any]:
    """Point `latest.json` at a run and its model: temp-then-rename on local disk, one PUT on object stores."""
    fs, root = open_storage(url, storage_options)
    entry = {"run": run_url, "model": model_url, "time": time.time()}
    write_json(fs, join(root, LATEST_FILE), entry)
    return entry


def read_runs(url: str, storage_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The lineage's runs.jsonl, oldest first ([] before its first run)."""
    fs, root = open_storage(url, storage_options)
    fs.invalidate_cache()
    try:
        text = fs.cat_file(join(root, RUNS_FILE)).decode()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def append_run(url: str, storage_options: dict[str, Any] | None, entry: dict[str, Any]) -> None:
    """Add one line to runs.jsonl. Object stores cannot append, so the whole file is rewritten
    (atomically); the lineage's lock keeps writers to one."""
    fs, root = open_storage(url, storage_options)
    lines = [json.dumps(r, sort_keys=True) for r in read_runs(url, storage_options)] + [
        json.dumps(entry, sort_keys=True)
    ]
    write_bytes_atomic(fs, join(root, RUNS_FILE), ("\n".join(lines) + "\n").encode())


def used_task_ids(runs: list[dict[str, Any]]) -> set[str]:
    """Task ids consumed by the lineage's completed runs (failed and cancelled runs consume none)."""
    return {t for r in runs if r.get("status") == "completed" for t in r.get("tasks", [])}


def unused_tasks(tasks: list[Task], used: set[str]) -> list[Task]:
    """The tasks not used yet, in task-set order."""
    return [t for t in tasks if t.task_id not in used]


def task_record(t: Task) -> dict[str, Any]:
    """A task as JSON: a frozen task-set row (with its id) or a task carried with continuations."""
    return {
        "task_id": t.task_id,
        "prompt": t.prompt,
        "answer": t.answer,
        "row": json.loads(json.dumps(t.row, default=str)),
    }


def freeze_tasks(
    url: str, storage_options: dict[str, Any] | None, run_name: str, taskset: Any, runs_before: int
) -> str:
    """The tasks run `run_name` may draw, frozen: every task file of `taskset.path` stored once
    under `<lineage>/tasks/pool/` (by content: a file no run changed is not stored again), and the
    run's task view `<lineage>/tasks/<run>.taskview.json` naming those files and leaving out the
    ids consumed by the completed runs among the first `runs_before` lines of runs.jsonl (each
    run's consumed ids are stored once, in its line; `used_task_ids`). Returns the view's URL,
    the run's `taskset.path`."""
    fs, root = open_storage(url, storage_options)
    pool = []
    for path in taskset_files(taskset.path, storage_options):
        tasks = load_taskset(taskset.model_copy(update={"path": path}), storage_options)  # ids as in the whole set
        rows = [
            {**task_record(t)["row"], taskset.prompt_key: t.prompt, taskset.answer_key: t.answer, "id": t.task_id}
            for t in tasks
        ]
        body = "".join(json.dumps(r) + "\n" for r in rows).encode()
        stem = "".join(c if c.isalnum() or c in "-_" else "-" for c in path.rsplit("/", 1)[-1].split(".", 1)[0])
        name = f"{POOL_DIR}/{stem}-{hashlib.sha256(body).hexdigest()[:16]}.jsonl"
        if not fs.exists(join(root, TASKS_DIR, name)):
            write_bytes_atomic(fs, join(root, TASKS_DIR, name), body)
        pool.append(name)
    view = {
        "task_view": 1,
        "files": pool,
        "exclude_ids_in": {
            "path": f"../{RUNS_FILE}",
            "lines": runs_before,
            "field": "tasks",
            "where": {"status": "completed"},
        },
    }
    write_json(fs, join(root, TASKS_DIR, f"{run_name}{VIEW_SUFFIX}"), view)
    return f"{url}/{TASKS_DIR}/{run_name}{VIEW_SUFFIX}"


def consumed_task_ids(run: RunContext) -> list[str]:
    """Task ids a run drew: those in its committed buffer and in its continuation stores."""
    from rl_engine.buffer.continuations import ContinuationStore, store_explorer_ids
    from rl_engine.buffer.stats import committed_files

    fs, root = run.fs()
    ids: set[str] = set()
    for path in committed_files(fs, root):
        ids.update(pa.ipc.open_file(pa.py_buffer(fs.cat_file(path))).read_all().column("task_id").to_pylist())
    for i in store_explorer_ids(fs, root):
        store = ContinuationStore(fs, root, i)
        ids.update(str(t) for t in store.load().column("task_id"))
    return sorted(ids)


# --------------------------------------------------------------------------- the lock


def lock(url: str, storage_options: dict[str, Any] | None, cfg: LineageConfig, poll_s: float = 1.0) -> RunLease:
    """Hold the lineage's lock (`<lineage>/lease/`, a RunLease renewed by a background thread,
    so a long CPU-bound run keeps it; a dead holder's lock expires after `cfg.lock_ttl_s`). When
    another run holds it: refuse (`when_busy: refuse`) or retry every `poll_s` up to `wait_timeout_s`."""
    deadline = time.monotonic() + cfg.wait_timeout_s
    fs, root = open_storage(url, storage_options)
    while True:
        try:
            return RunLease(fs, root, ttl_s=cfg.lock_ttl_s).acquire()
        except UserError as e:
            if cfg.when_busy == "refuse":
                raise UserError(
                    f"lineage {cfg.name!r} is busy: {e} (lineage.when_busy = 'refuse'; set it to 'wait' to queue behind it)"
                ) from None
            if time.monotonic() + poll_s > deadline:
                raise UserError(
                    f"lineage {cfg.name!r}: waited lineage.wait_timeout_s = {cfg.wait_timeout_s:g} s for its lock: {e}"
                ) from None
        time.sleep(poll_s)


# --------------------------------------------------------------------------- continuations


def renumber(batch: Any, version_offset: int, step_offset: int) -> Any:
    """Rows of a previous run in the next run's numbering: the previous run's final weights are
    the next run's version 0 and its last explorer step is step 0, so what came before counts
    below 0 (staleness, version gaps, `max_version_gap` masking and group age stay true)."""
    from rl_engine.experience import ExperienceBatch

    table = batch.to_table()
    rows = table.to_pylist()
    for r in rows:
        r["versions"] = [v - version_offset for v in r["versions"]]
        r["segments"] = [
            {**s, "version": s["version"] - version_offset, "explorer_step": s["explorer_step"] - step_offset}
            for s in r["segments"]
        ]
        r["explorer_step"] -= step_offset
    return ExperienceBatch.from_table(pa.Table.from_pylist(rows, schema=table.schema), source="carried continuations")


def carry_continuations(prev: RunContext, run: RunContext) -> dict[int, list[str]]:
    """Copy the previous run's pending continuations into `run`'s stores before its explorers
    start (previous explorer i goes to explorer i mod count), renumbered (`renumber`), with the
    tasks they belong to (from the previous run's task set, or carried into it), so they resolve
    although this run does not draw them. Returns {explorer id: experience ids taken over}."""
    from rl_engine.buffer.continuations import ContinuationStore, store_explorer_ids
    from rl_engine.experience import ExperienceBatch
    from rl_engine.run.context import last_committed_steps
    from rl_engine.run.state import latest_state_step

    sources = store_explorer_ids(*prev.fs())
    if not sources or not run.cfg.explorer.partial.enabled:
        return {}
    final_version, last_steps = latest_state_step(prev) or 0, last_committed_steps(prev)
    known: dict[str, dict[str, Any]] | None = None
    out: dict[int, list[str]] = {}
    count = run.cfg.explorer.count
    for j in range(count):
        batches, tasks = [], {}
        for i in (i for i in sources if i % count == j):
            src = ContinuationStore(*prev.fs(), i)
            pending = src.load([e.id for e in src.list() if e.kind == "pending"])
            if not len(pending):
                continue
            carried = src.carried_tasks()
            for tid in {str(t) for t in pending.column("task_id")}:
                if tid in carried:
                    tasks[tid] = carried[tid]
                    continue
                if known is None:
                    known = {t.task_id: task_record(t) for t in load_taskset(prev.cfg.taskset, prev.storage_options)}
                if tid not in known:
                    raise UserError(
                        f"{src.manifest_uri}: pending continuation of task {tid!r}, which {prev.cfg.taskset.path} no longer has; restore that task file"
                    )
                tasks[tid] = known[tid]
            batches.append(renumber(pending, final_version, last_steps.get(i, 0)))
        if batches:
            batch = ExperienceBatch.concat(batches)
            ContinuationStore(*run.fs(), j).commit([(batch, "pending")], tasks=tasks)
            out[j] = [str(x) for x in batch.column("experience_id")]
    return out


# --------------------------------------------------------------------------- a run of a lineage


def local_model(model_url: str, storage_options: dict[str, Any] | None, cache_dir: str) -> str:
    """A local directory holding the model at `model_url` (downloaded into `cache_dir` from an object store)."""
    fs, root = open_storage(model_url, storage_options)
    if is_local(fs):
        return root
    if not fs.exists(join(root, "config.json")):
        raise UserError(
            f"lineage model {model_url}: no config.json there; the run that latest.json names did not save its model"
        )
    fs.get(root + "/", cache_dir.rstrip("/") + "/", recursive=True)
    return cache_dir


@dataclasses.dataclass
class LineageRun:
    """One run's membership in its lineage, from `begin` to `end`/`release`."""

    name: str
    url: str
    storage_options: dict[str, Any]
    lease: RunLease
    cfg: RFTConfig  # the config the run starts with (model and task set of the lineage)
    previous: dict[str, Any] | None  # latest.json when the run began
    new: bool = True

    def adopt(self, run: RunContext) -> dict[int, list[str]]:
        """Take over the pending continuations of the run `latest.json` named (a new run only)."""
        if not self.new or self.previous is None:
            return {}
        return carry_continuations(open_run(self.previous["run"], self.storage_options), run)

    def end(self, run: RunContext, status: str) -> dict[str, Any]:
        """Record the run in runs.jsonl (with its best evaluated version, if it kept one); move
        `latest.json` to it only if it `completed`: to its last model, or with
        `lineage.promote: best` to its best version's."""
        from rl_engine.run.report import read_best

        best = read_best(run)
        entry = {
            "run": run.url,
            "base_model": run.cfg.model.path,
            "model": f"{run.url}/model",
            **({"best": best} if best is not None else {}),
            "tasks": consumed_task_ids(run),
            "status": status,
            "time": time.time(),
        }
        self.lease.check()  # a run that lost the lineage's lock records nothing over its new holder's
        append_run(self.url, self.storage_options, entry)
        if status == "completed":
            promoted = best["model"] if run.cfg.lineage.promote == "best" and best is not None else entry["model"]
            move_latest(self.url, self.storage_options, run.url, promoted)
        return entry

    def release(self) -> None:
        self.lease.release()


def begin(
    cfg: RFTConfig, new: bool = True, log: Callable[[str], Any] = print, poll_s: float = 1.0
) -> LineageRun | None:
    """Join `cfg.lineage.name` (None without one): take the lock, then for a new run (`cfg` with
    its name set) point model.path at the latest model and taskset.path at the unused tasks,
    frozen under the lineage. The lock is released if anything here fails."""
    lc = cfg.lineage
    if lc.name is None:
        return None
    opts = cfg.buffer.storage.fs_options()
    url = lineage_url(cfg.buffer.storage.url, lc.name)
    lease = lock(url, opts, lc, poll_s)
    try:
        previous = read_latest(url, opts)
        if not new:
            return LineageRun(lc.name, url, opts, lease, cfg, previous, new=False)
        if cfg.name is None:
            raise ValueError("lineage.begin needs the run's name (cfg.name) set")
        data = cfg.model_dump(mode="json")
        if previous is not None and lc.start_from == "latest":
            import tempfile

            model = local_model(
                previous["model"],
                opts,
                f"{tempfile.gettempdir()}/rft-lineage-models/{lc.name}/{previous['run'].rstrip('/').rsplit('/', 1)[-1]}",
            )
            data["model"]["path"] = model  # the saved model has its tokenizer beside it
            log(f"lineage {lc.name}: starting from the model of {previous['run']} ({model})")
        tasks, runs = load_taskset(cfg.taskset, opts), read_runs(url, opts)
        fresh = unused_tasks(tasks, used_task_ids(runs))
        if not fresh:
            raise UserError(
                f"lineage {lc.name!r} has used all {len(tasks)} tasks of taskset.path = {cfg.taskset.path!r}; add new task files there (a folder or prefix of task files takes new ones)"
            )
        data["taskset"]["path"] = freeze_tasks(url, opts, cfg.name, cfg.taskset, len(runs))
        log(f"lineage {lc.name}: {len(fresh)} of {len(tasks)} tasks not used yet ({data['taskset']['path']})")
        return LineageRun(lc.name, url, opts, lease, validate_config(data, f"lineage {lc.name}"), previous)
    except BaseException:
        lease.release()
        raise
