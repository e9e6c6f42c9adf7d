"""Placement `deployments`: every role its own flow run, in its own OS process, on a real process worker.

A real `prefect server start` on loopback and a real `prefect worker start` (harness/prefect_live.py);
the role deployments are deployed with the README's `prefect deploy --all`. The mode's flow runs
in this test process against that server and starts the roles with `run_deployment`. What is
asserted comes from the run's storage (versions in the buffer, role markers on the board) and
from the server (flow-run states), never from in-memory state.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import os
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pyarrow.dataset as ds
import pytest

from cli.run import run_config
from harness.prefect_live import DEPLOY_ALL, assert_exited_cleanly
from harness.runs import small_config, stored_rows
from rl_engine.config import validate_config
from rl_engine.run.context import last_committed_steps, open_run
from rl_engine.run.state import latest_state_step
from tests.flows.test_modes import stored_experiences, versions_by_step

# Each run's roles are processes of their own (engines, a trainer): they take the real-model runs'
# turn (heavy_turn), and the wait for it counts toward the deadline.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.usefixtures("heavy_turn")]

HEARTBEAT_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def live(prefect_live, prefect_worker):
    """The live server with the role deployments deployed and a worker on their pool; while a
    test uses it, in-process flows (the mode's flow) talk to it instead of the ephemeral server."""
    prefect_worker("rft-cpu")  # creates the pool first, as the README's first command does
    prefect_live.cli(*DEPLOY_ALL, timeout=300)
    return prefect_live


@pytest.fixture
def on_live_server(live):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: live.api_url}):
        yield live


def deployments_config(model: str, tasks: str, root: Path, **sync) -> dict:
    data = small_config(model, tasks, str(root), **sync)
    data["synchronizer"]["collective"].pop("port")  # the trainer picks a free one and publishes it
    # Each role starts cold in a process of its own: the trainer's first read (and its first
    # collective sync) waits for the explorers' vLLM engines to come up, which on a loaded 2-core
    # machine took over small_config's 120 s (the trainer failed with a BufferTimeout). The
    # product's defaults (600 s) then, not the in-process tests' tighter ones.
    data["buffer"]["read_timeout_s"] = 600
    data["synchronizer"]["wait_timeout_s"] = 600
    data["placement"] = {
        "type": "deployments",
        "heartbeat_s": 1.0,
        "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
        "start_timeout_s": 300,
    }
    return data


def role_markers(run_url: str, options: dict | None = None) -> dict[str, dict]:
    """{role: its liveness marker on the run's board}, on local disk or (with storage `options`) S3."""
    if options is None:
        return {
            p.stem.removeprefix("role-"): json.loads(p.read_text())
            for p in Path(run_url, "control").glob("role-*.json")
        }
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    return {
        p.rsplit("/", 1)[1].removeprefix("role-").removesuffix(".json"): json.loads(fs.cat_file(p))
        for p in fs.glob(f"{run_url}/control/role-*.json")
    }


def _stored_experiences(run_url: str, options: dict) -> list[dict]:
    """tests/flows/test_modes.stored_experiences on S3: every buffer row, read with plain pyarrow."""
    import pyarrow.dataset as ds
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    path = f"{run_url.removeprefix('s3://')}/buffer"
    table = ds.dataset(path, filesystem=fs, format="ipc", partitioning="hive", exclude_invalid_files=True).to_table()
    return table.select(["experience_id", "explorer_id", "explorer_step", "versions", "group_id", "reward"]).to_pylist()


def child_runs(live, run_name: str) -> dict[str, dict]:
    """{role: its flow run} on the server, found by the names the mode's flow gave them."""
    rows = live.api("POST", "/flow_runs/filter", json={"flow_runs": {"name": {"like_": f"{run_name}-"}}, "limit": 50})
    return {r["name"].removeprefix(f"{run_name}-"): r for r in rows}


def process_tree(pid: int) -> list[psutil.Process]:
    p = psutil.Process(pid)
    return [p, *p.children(recursive=True)]


def processes(*pids: int) -> list[psutil.Process]:
    """The processes of `pids` that still exist."""
    out = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            out.append(psutil.Process(pid))
    return out


def assert_all_gone(procs: list[psutil.Process], timeout_s: float = 30.0) -> None:
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    assert not alive, f"processes of the run left behind: {[(p.pid, p.name()) for p in alive]}"


def assert_roles_ran_apart(
    live, run_url: str, num_explorers: int, options: dict | None = None, reward: bool = False
) -> None:
    """Every role (the reward role too, with `reward`) ran to its end in an OS process of its own,
    none of them this (the test's) process, as a completed flow run of its deployment named after the run."""
    markers = role_markers(run_url, options)
    assert set(markers) == {"trainer"} | {f"explorer-{i}" for i in range(num_explorers)} | (
        {"reward"} if reward else set()
    )
    pids = {m["pid"] for m in markers.values()}
    assert len(pids) == len(markers) and os.getpid() not in pids, markers
    assert {m["state"] for m in markers.values()} == {"done"}
    children = child_runs(live, run_url.rsplit("/", 1)[-1])
    assert set(children) == set(markers) and {c["state_type"] for c in children.values()} == {"COMPLETED"}


def test_readme_command_runs_every_role_on_the_worker(live, tiny_model_dir, task_file, tmp_path):
    """`rft run configs/synchronous.yaml --set placement.type=deployments`, as the README shows it."""
    from harness.prefect_live import REPO, VENV_BIN

    total = 4
    sets = [
        f"model.path={tiny_model_dir}",
        "model.max_model_len=64",
        f"taskset.path={task_file}",
        f"buffer.storage.url={tmp_path}",
        "name=readme",
    ]
    sets += [
        "explorer.batch_size=2",
        "algorithm.repeat_times=2",
        "explorer.engine.kv_cache_space_gib=0.25",
        f"trainer.total_steps={total}",
        "trainer.micro_batch_size=4",
    ]
    cmd = [str(VENV_BIN / "rft"), "run", "configs/synchronous.yaml", "--set", "placement.type=deployments"] + [
        a for kv in sets for a in ("--set", kv)
    ]
    res = subprocess.run(
        cmd, cwd=REPO, env=live.env(), capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run_url = str(tmp_path / "readme")
    assert f"trained:    {total} steps -> version {total}" in res.stdout
    assert_roles_ran_apart(live, run_url, 1)
    by_step = versions_by_step(stored_experiences(run_url))
    assert {e: vs for (_, e), vs in by_step.items()} == {
        e: {e - 1} for e in range(1, total + 1)
    }  # synchronous: step e by v(e-1)


# One mode/sync pair per run here; the suite's time goes to what nothing else covers across processes:
# - multi_explorer/checkpoint, on S3, with a model reward whose service is a role of its own:
#   test_every_role_in_its_own_process (below);
# - one_step_off_policy/collective (small_config's default method): test_killed_explorer_fails_the_run_then_resume_loses_nothing;
# - multi_explorer/collective: test_cancelling_the_mode_flow_cancels_every_role (it reaches version 2 by broadcasts);
# - synchronous: test_readme_command_runs_every_role_on_the_worker.
# fully_async/collective is no run of its own: fully_async and multi_explorer are one mode flow
# (flows/decoupled.py: run_mode), multi_explorer with one explorer, and collective sync across
# processes runs in the kill and cancel tests; fully_async in one process: tests/flows/test_modes.py.
@pytest.mark.release
@pytest.mark.parametrize("mode,method", [("multi_explorer", "checkpoint")])
def test_every_role_in_its_own_process(
    mode, method, on_live_server, prefect_worker, tiny_model_dir, task_file, s3_bucket, tmp_path
):
    """Every role its own flow run and OS process on a worker, the schedule held across processes,
    on S3 storage. The run's reward is a model (`taskset.reward: {type: model}`), whose service is
    the reward role's (a flow run and OS process of its own), which both explorers score with: one
    service is started for the run, by the reward role; every experience's reward is the
    classifier's score of its prompt and response; the role ends with the run, its service too.
    The same run checks issue 28: credentials go to the workers' environment, never
    the config; a run on S3 whose roles run on a worker holding them leaves them in none of the
    run's objects (config.yaml, logs, report, checkpoints), the worker's terminal, the flow runs'
    logs, parameters or artifacts."""
    from prefect.artifacts import Artifact

    from rl_engine.config import ConfigError
    from rl_engine.proc.starts import ENV as STARTS_ENV
    from rl_engine.tiny_model import make_tiny_classifier

    live = on_live_server
    url, options = s3_bucket
    secret = f"rft-secret-{os.urandom(6).hex()}"  # moto takes any key; this one must show up nowhere
    total, k, name = 4, 2, "s3-roles"
    data = deployments_config(
        tiny_model_dir,
        task_file,
        tmp_path,
        name=name,
        mode=mode,
        sync_method=method,
        sync_interval=k,
        total_steps=total,
        count=2,
        max_staleness=3,
    )
    data["buffer"]["storage"] = {"url": url, "options": options}
    rm = str(make_tiny_classifier(tmp_path / "rm"))
    data["taskset"]["reward"] = {"type": "model", "path": rm, "batch_size": 4}
    with pytest.raises(
        ConfigError, match="job_variables.trainer.env.AWS_SECRET_ACCESS_KEY: credentials must not be in the config"
    ) as refused:
        validate_config(
            {
                **data,
                "placement": {
                    **data["placement"],
                    "job_variables": {"trainer": {"env": {"AWS_SECRET_ACCESS_KEY": secret}}},
                },
            }
        )
    assert secret not in str(refused.value)

    # Roles on a pool of their own whose worker has the key in its environment, as the README says.
    worker = prefect_worker(
        "rft-s3", AWS_ACCESS_KEY_ID="rft-test-key", AWS_SECRET_ACCESS_KEY=secret
    )  # creates the pool
    for role in ("rft-trainer", "rft-explorer", "rft-reward"):
        _copy_deployment(live, f"{role}/default", name, "rft-s3")
    data["placement"] |= {
        "trainer_deployment": f"rft-trainer/{name}",
        "explorer_deployment": f"rft-explorer/{name}",
        "reward_deployment": f"rft-reward/{name}",
    }
    cfg = validate_config(data)
    tally = Path(os.environ[STARTS_ENV])  # every process of the session appends its starts here
    summary = run_config(cfg)
    assert summary["final_version"] == total
    assert summary["run"].rstrip("/").endswith(f"/{name}"), summary["run"]
    assert_roles_ran_apart(live, summary["run"], cfg.explorer.count, options, reward=True)
    assert_one_reward_service(summary["run"], options, rm, tally)
    progress = Artifact.get(
        f"{mode.replace('_', '-')}-progress"
    )  # the mode flow run's, moved by the trainer's flow run
    assert progress.data == 100.0 and progress.description == f"Run {name}: trainer step {total}/{total}"

    # The schedule holds across processes, read from the stored versions alone.
    by_step = versions_by_step(_stored_experiences(summary["run"], options))
    used = {v for vs in by_step.values() for v in vs}
    # Which explorers wrote is a race in separate processes: one whose engine starts late may
    # find every admitted batch already made (each one's run to its end is asserted above).
    assert used <= {0, 2, 4} and {i for i, _ in by_step} <= set(range(cfg.explorer.count)) and by_step

    # The secret shows up nowhere.
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    objects = fs.find(f"{url}/{name}")
    logs_of_roles = {f"logs/engines-{r}.log" for r in ("trainer", "explorer-0", "explorer-1", "reward")}
    assert {"config.yaml", "report/summary.json", *logs_of_roles} <= {o.split(f"/{name}/", 1)[1] for o in objects}
    leaks = [o for o in objects if secret.encode() in fs.cat_file(o)]
    runs = live.api("POST", "/flow_runs/filter", json={"flow_runs": {"name": {"like_": name}}, "limit": 50})
    ids = [r["id"] for r in runs]
    logs: list = []
    while page := live.api(
        "POST", "/logs/filter", json={"logs": {"flow_run_id": {"any_": ids}}, "limit": 200, "offset": len(logs)}
    ):
        logs += page
    arts = live.api("POST", "/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": ids}}})
    shown = {
        "worker terminal": worker.log_path.read_text(),
        "flow runs": json.dumps(runs),
        "flow run logs": json.dumps(logs),
        "artifacts": json.dumps(arts),
    }
    leaks += [where for where, text in shown.items() if secret in text]
    assert len(logs) > 10 and len(arts) >= 5 and not leaks, leaks


def assert_one_reward_service(run_url: str, options: dict, rm: str, tally: Path) -> None:
    """The run's one reward service was the reward role's (started by its process, none by an
    explorer's), every stored reward is the classifier `rm`'s own score of its prompt and response,
    no explorer step failed a request, and nothing of the role is left (its process, its service)."""
    import s3fs

    from rl_engine.rewards.run_service import SERVICE_KEY
    from rl_engine.run.report import load_metrics
    from tests.rl_engine.rewards.test_reward_model import direct_scores

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    markers = role_markers(run_url, options)
    service = json.loads(fs.cat_file(f"{run_url}/control/{SERVICE_KEY}.json"))
    assert service["starts"] == 1 and service["url"].startswith("http://127.0.0.1:")
    tallied = [line.split() for line in tally.read_text().splitlines()]
    started_by = [int(t[1]) for t in tallied if len(t) == 2 and t[0] == "reward_service"]
    assert [pid for pid in started_by if pid in {m["pid"] for m in markers.values()}] == [markers["reward"]["pid"]]

    path = f"{run_url.removeprefix('s3://')}/buffer"
    table = ds.dataset(path, filesystem=fs, format="ipc", partitioning="hive", exclude_invalid_files=True).to_table()
    rows = table.select(["prompt_text", "response_text", "reward"]).to_pylist()
    assert rows and all(math.isfinite(r["reward"]) for r in rows)
    want = direct_scores(rm, [(r["prompt_text"], r["response_text"]) for r in rows])
    assert [r["reward"] for r in rows] == pytest.approx(want, abs=1e-4)  # the classifier's own scores
    _, explorer = load_metrics(open_run(run_url, options))
    assert explorer and all(m["reward_errors"] == m["reward/model/failures"] == 0 for m in explorer)
    assert_all_gone(processes(markers["reward"]["pid"], service["pid"]))


def _run_in_thread(cfg, resume=None) -> tuple[threading.Thread, list]:
    out: list = []

    def target():
        try:
            out.append(run_config(cfg, resume=resume))
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            out.append(e)

    t = threading.Thread(
        target=contextvars.copy_context().run, args=(target,), daemon=True
    )  # keeps the live server's settings
    t.start()
    return t, out


def _wait_trainer_version(run_dir: Path, version: int, out: list, timeout_s: float = 300) -> None:
    """Until the trainer's marker shows `version`; fails at once if the run (`out` of
    _run_in_thread) ended first, and at the deadline with what the board shows (roles, stop request)."""
    marker = run_dir / "control" / "trainer.json"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not out:
        if marker.exists() and json.loads(marker.read_text())["version"] >= version:
            return
        time.sleep(0.1)
    board = {p.name: p.read_text() for p in sorted(run_dir.glob("control/*.json"))}
    why = f"the run ended first: {out[0]!r}" if out else f"not within {timeout_s:.0f} s"
    raise AssertionError(f"the trainer did not reach version {version}: {why}; the board: {board}")


@pytest.mark.release
def test_killed_explorer_fails_the_run_then_resume_loses_nothing(on_live_server, tiny_model_dir, task_file, tmp_path):
    total = 10  # the trainer cannot pass the dead explorer by more than a step or two (one step off policy)
    cfg = validate_config(
        deployments_config(
            tiny_model_dir,
            task_file,
            tmp_path,
            name="kill-me",
            mode="one_step_off_policy",
            sync_offset=1,
            total_steps=total,
        )
    )
    run_dir = tmp_path / "kill-me"
    thread, out = _run_in_thread(cfg)
    _wait_trainer_version(run_dir, 3, out)
    explorer = role_markers(str(run_dir))["explorer-0"]
    trainer = role_markers(str(run_dir))["trainer"]
    doomed = process_tree(explorer["pid"])  # the role's process, its vLLM engine core and worker
    assert len(doomed) >= 2, "the explorer's engine runs in processes of its own"
    doomed[0].kill()  # SIGKILL: no word on the board from the explorer
    killed_at = time.monotonic()
    thread.join(HEARTBEAT_TIMEOUT_S + 60)
    assert not thread.is_alive(), "the run did not notice the dead explorer"
    took = time.monotonic() - killed_at
    [error] = out
    assert isinstance(error, Exception) and "explorer-0" in str(error), error
    assert took < HEARTBEAT_TIMEOUT_S + 30, f"noticed after {took:.0f} s"
    # The trainer stopped too (the run's stop request names the dead explorer), and nothing of the explorer survives.
    # The stop request comes from whoever noticed first: the parent (explorer-0's flow run crashed)
    # or the trainer (its weight-sync peer closed the connection); the run's error names both.
    stop = json.loads((run_dir / "control" / "stop.json").read_text())
    assert stop["kind"] == "failed" and (
        "explorer-0" in stop["reason"] or "Connection closed by peer" in stop["reason"]
    ), stop
    assert_all_gone(doomed[1:])
    assert_all_gone([psutil.Process(trainer["pid"])] if psutil.pid_exists(trainer["pid"]) else [])

    run = open_run(str(run_dir))
    saved, committed = latest_state_step(run), last_committed_steps(run)[0]
    # What commit records name: the explorer, killed between a step's data file and its record,
    # leaves that file uncommitted (the step is written again on resume, and the resumed attempt's
    # sweep removes the file; the count below checks that).
    before = {r["experience_id"] for r in stored_rows(run.url)}
    assert saved is not None and committed < total

    summary = run_config(run.cfg, resume=run.url)
    assert summary["final_version"] == total
    rows = stored_experiences(run.url)
    ids = [r["experience_id"] for r in rows]
    assert len(ids) == len(set(ids)) and before <= set(ids)  # nothing committed before the kill is lost
    assert sorted({r["explorer_step"] for r in rows}) == list(range(1, total + 1)) and len(rows) == total * 4
    metrics = [json.loads(line) for line in Path(run.url, "report", "metrics.jsonl").read_text().splitlines()]
    trainer_steps = [m for m in metrics if "explorer_steps" in m]
    assert [m["step"] for m in trainer_steps] == list(range(1, total + 1))
    assert [m["explorer_steps"] for m in trainer_steps if m["resumed_from"] == saved] == [
        [t] for t in range(saved + 1, total + 1)
    ]


def test_cancelling_the_mode_flow_cancels_every_role(on_live_server, tiny_model_dir, task_file, tmp_path):
    cfg = validate_config(
        deployments_config(
            tiny_model_dir,
            task_file,
            tmp_path,
            name="cancel-roles",
            mode="multi_explorer",
            count=2,
            sync_method="collective",
            sync_interval=1,
            total_steps=400,
        )
    )  # outlasts the cancel by far
    run_dir = tmp_path / "cancel-roles"
    thread, out = _run_in_thread(cfg)
    _wait_trainer_version(run_dir, 2, out)
    procs = [p for m in role_markers(str(run_dir)).values() for p in process_tree(m["pid"])]
    parents = on_live_server.api(
        "POST", "/flow_runs/filter", json={"flows": {"name": {"any_": ["multi-explorer"]}}, "limit": 200}
    )
    [parent] = [r for r in parents if r["parameters"].get("cfg", {}).get("name") == "cancel-roles"]
    on_live_server.cancel(parent["id"])
    cancelled_at = time.monotonic()
    thread.join(120)
    assert not thread.is_alive(), "the run did not stop after its cancellation"
    took = time.monotonic() - cancelled_at
    [result] = out
    assert not isinstance(result, dict), f"the run was not cancelled: {result}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        children = child_runs(on_live_server, "cancel-roles")
        if all(c["state_type"] in ("CANCELLED", "COMPLETED", "FAILED", "CRASHED") for c in children.values()):
            break
        time.sleep(1)
    assert set(children) == {"trainer", "explorer-0", "explorer-1"}
    assert {c["state_type"] for c in children.values()} == {"CANCELLED"}, {
        r: (c["state_type"], c["state"]["message"]) for r, c in children.items()
    }
    assert_all_gone(procs)
    for child in (
        children.values()
    ):  # cancelled on purpose: no CancelledRun traceback, exit status 0 (flows.common.end_cancelled)
        assert_exited_cleanly(on_live_server, child["id"])
    print(f"cancel -> mode flow ended in {took:.1f} s")


def _copy_deployment(live, name: str, new_name: str, pool: str) -> None:
    """`name` (flow/deployment) again as `flow/new_name` on `pool`, through the REST API."""
    dep = live.deployment(name)
    keep = (
        "flow_id",
        "entrypoint",
        "pull_steps",
        "parameters",
        "parameter_openapi_schema",
        "enforce_parameter_schema",
        "job_variables",
        "path",
        "tags",
    )
    live.api(
        "POST", "/deployments/", json={k: dep[k] for k in keep if k in dep} | {"name": new_name, "work_pool_name": pool}
    )
