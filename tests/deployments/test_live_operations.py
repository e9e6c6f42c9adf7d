"""Runs of a mode deployment changed with the `set` parameter, and what they show, on a real
`prefect server start` and a real process worker, with the README's own commands.

The README's `synchronous/synchronous` deployment (`prefect deploy --all`) gets a test config
for the test (tiny model, storage under the test's tmp dir, the session's engine server; PATCHed
as a UI user would edit it, restored after; the pool runs one run at a time meanwhile); then the bash block of "Operate it with Prefect" that starts runs with `set`
(`prefect deployment run ... --param set=...` and `curl ... /create_flow_run`) runs as written.
Both runs complete; each stored config differs from the deployment's `cfg` exactly in the
overridden field; their artifacts sit under the deployment's stable keys and their results are
the runs' summaries. A bad override fails its run naming the key, and a run cancelled through the
API on the worker ends Cancelled within CANCELLED_WITHIN_S, leaves none of its processes (flow
process, vLLM engine core and worker, by PID) running after GONE_WITHIN_S, exits cleanly, still
publishes its report, the model it reached and how to resume it (whose command then resumes it on
the worker), and gave the worker's terminal a few lines (the engines' output is in the run's log).
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from harness.prefect_live import (
    REPO,
    TERMINAL_STATES,
    LiveServer,
    assert_exited_cleanly,
    flow_run_id_from_cli,
    wait_flow_run,
)
from harness.runs import small_config
from rl_engine.config import validate_config
from tests.flows.conftest import flatten

pytestmark = pytest.mark.slow

KEYS = "synchronous-synchronous"  # <flow>-<deployment>
# A worker-run flow cancelled through the API: measured 31.5 s to Cancelled, every process of the
# run gone by then, on the 2-core dev machine at load ~7 (vLLM's engine shutdown 5 s, the report
# 4 s, the flow process's exit 9 s, then the worker loads the flow again, pull steps included, to
# look for on_cancellation hooks before it sets Cancelled). Twice that, for a busier machine.
CANCELLED_WITHIN_S = 60.0
GONE_WITHIN_S = 60.0
CANCELLED_TOTAL = 100  # trainer steps of the run cancelled at version 2, then resumed to its end (a step of this config takes ~0.1-0.3 s: the run must outlast the cancel, ~15 s under load)


def readme_set_block() -> str:
    """The Prefect guide's bash block that starts deployment runs with `set`."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "docs" / "guides" / "prefect.md").read_text(), re.DOTALL)
    found = [b for b in blocks if "--param set=" in b]
    assert len(found) == 1, "docs/guides/prefect.md: one bash block with `prefect deployment run ... --param set=`"
    return found[0]


def artifacts(live: LiveServer, flow_run_id: str) -> dict[str, dict]:
    rows = live.api("POST", "/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})
    return {a["key"]: a for a in rows if a["key"]}


def create_run(live: LiveServer, deployment_id: str, overrides: list[str]) -> dict[str, Any]:
    """The flow run created, as the API answers it (`id`, `name`, ...)."""
    return live.api("POST", f"/deployments/{deployment_id}/create_flow_run", json={"parameters": {"set": overrides}})


@pytest.fixture
def test_deployment(prefect_live, deployed, tiny_model_dir, task_file, tmp_path):
    """synchronous/synchronous with a 2-step test `cfg` while the test runs; yields (deployment, cfg, storage)."""
    dep = prefect_live.deployment("synchronous/synchronous")
    storage = tmp_path / "runs"
    cfg = small_config(tiny_model_dir, task_file, str(storage), mode="synchronous", total_steps=2)
    cfg["synchronizer"]["collective"]["port"] = None  # runs side by side: a free port each
    prefect_live.api("PATCH", f"/deployments/{dep['id']}", json={"parameters": {"cfg": cfg}})
    try:
        yield dep, cfg, storage
    finally:
        prefect_live.api("PATCH", f"/deployments/{dep['id']}", json={"parameters": dep["parameters"]})
        cancel_unfinished_runs(prefect_live, dep["id"])


def cancel_unfinished_runs(live: LiveServer, deployment_id: str) -> None:
    """Cancels the deployment's runs a failed test left going, so they load neither the worker nor
    its terminal during the next test."""
    live_states = ["SCHEDULED", "PENDING", "RUNNING"]
    rows = live.api(
        "POST",
        "/flow_runs/filter",
        json={"flow_runs": {"deployment_id": {"any_": [deployment_id]}, "state": {"type": {"any_": live_states}}}},
    )
    for row in rows:
        live.cancel(row["id"])
    for row in rows:
        with contextlib.suppress(AssertionError):  # best effort: the test already failed on its own
            wait_flow_run(live, row["id"], TERMINAL_STATES, timeout_s=CANCELLED_WITHIN_S)


def lines_of_run(lines: list[str], names: set[str]) -> list[str]:
    """The worker's terminal lines that name no flow run, or one of `names` (a run's id, its name at
    creation and the run name the flow gives it): another run's lines are not this run's."""
    named = re.compile(r"[Ff]low run '([^']+)'")
    return [ln for ln in lines if all(m in names for m in named.findall(ln))]


@pytest.fixture
def one_run_at_a_time(prefect_live):
    """The README's pool runs one flow run at a time while the test runs (its limit put back after)."""
    limit = prefect_live.api("GET", "/work_pools/rft-cpu")["concurrency_limit"]
    prefect_live.api("PATCH", "/work_pools/rft-cpu", json={"concurrency_limit": 1})
    try:
        yield
    finally:
        prefect_live.api("PATCH", "/work_pools/rft-cpu", json={"concurrency_limit": limit})


@pytest.mark.timeout(900)
def test_readme_set_commands_change_exactly_that_field(
    prefect_live, test_deployment, rft_worker, engine_server, one_run_at_a_time
):
    dep, cfg, storage = test_deployment
    # Both runs generate on the session's engine server (no engine start of their own), which
    # serves one run at a time: the pool runs them one after the other.
    cfg = {
        **cfg,
        "explorer": {**cfg["explorer"], "engine": {**cfg["explorer"]["engine"], "servers": [engine_server.url]}},
    }
    prefect_live.api("PATCH", f"/deployments/{dep['id']}", json={"parameters": {"cfg": cfg}})
    block = readme_set_block()
    overrides = set(re.findall(r'"(trainer\.total_steps=\d+)"', block))
    assert len(overrides) == 1, block
    total = int(next(iter(overrides)).split("=")[1])
    assert total != cfg["trainer"]["total_steps"]

    res = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=REPO,
        env=prefect_live.env(),
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    created = json.loads(res.stdout.rstrip().splitlines()[-1])  # the REST call's answer: the flow run, or why not
    assert "id" in created, res.stdout[-3000:]
    runs = {"cli": flow_run_id_from_cli(res.stdout), "rest": created["id"]}
    t0 = time.monotonic()
    for run_id in runs.values():
        wait_flow_run(prefect_live, run_id, ["COMPLETED"], timeout_s=600, worker=rft_worker)
    print(
        f"CLI and REST runs with set, one after the other on the worker and the engine server: {time.monotonic() - t0:.0f} s to both Completed"
    )

    given = flatten(validate_config(cfg).resolved().model_dump(mode="json"))
    for how, run_id in runs.items():
        flow_run = prefect_live.flow_run(run_id)
        assert flow_run["parameters"] == {"cfg": cfg, "set": [f"trainer.total_steps={total}"]}, (
            how
        )  # cfg: the deployment's, whole
        run_dir = storage / flow_run["name"]  # the flow run is named after its run
        stored = flatten(yaml.safe_load((run_dir / "config.yaml").read_text()))
        differ = {k for k in stored.keys() | given.keys() if stored.get(k) != given.get(k)}
        assert differ == {"name", "trainer.total_steps"} and stored["trainer.total_steps"] == total, (how, differ)

        summary = json.loads((run_dir / "report" / "summary.json").read_text())
        assert summary["final_version"] == total
        result = flow_run["state"]["data"]  # the result record's metadata; the record is JSON on the worker's machine
        assert (
            result["serializer"]["type"] == "json" and json.loads(Path(result["storage_key"]).read_text()) == summary
        ), how

        arts = artifacts(prefect_live, run_id)
        assert set(arts) == {
            f"{KEYS}-{what}" for what in ("progress", "metrics", "timeline", "reward-curve", "summary", "model")
        }, (how, sorted(arts))
        assert all(flow_run["name"] in a["description"] for a in arts.values()), how
        assert arts[f"{KEYS}-progress"]["data"] == 100.0 and arts[f"{KEYS}-timeline"]["data"].startswith(
            "![timeline of run "
        )
        assert arts[f"{KEYS}-model"]["data"] == f"[{run_dir}/model]({(run_dir / 'model').resolve().as_uri()})"
    # One key, both runs: the UI's page of the key lists them as its history.
    history = prefect_live.api("POST", "/artifacts/filter", json={"artifacts": {"key": {"any_": [f"{KEYS}-summary"]}}})
    assert set(runs.values()) <= {a["flow_run_id"] for a in history}


@pytest.mark.timeout(600)
def test_bad_override_from_rest_fails_naming_the_key(prefect_live, test_deployment, rft_worker):
    dep, _, storage = test_deployment
    run_id = create_run(prefect_live, dep["id"], ["trainer.total_stepz=3"])["id"]
    state = wait_flow_run(prefect_live, run_id, ["FAILED"], timeout_s=300, worker=rft_worker)
    assert "trainer.total_stepz = 3: unknown key" in state["message"], state["message"]
    assert not storage.exists() or not list(storage.iterdir())  # nothing started


# One live case per kind of union (tests/rl_engine/config/test_overrides.py checks every variant of
# every union on files and deployment configs): each `set` switches its union's key alone. The
# synchronizer's mode is the deployment's own (another mode is refused: test_bad_override...), the
# workflow's variants need their own task sets (their runs: tests/flows/test_workflow*.py).
SWITCHES = {
    "placement.type=deployments": ("placement.type", "deployments"),
    "algorithm.advantage.type=rloo": ("algorithm.advantage.type", "rloo"),
    "algorithm.loss.type=cispo": ("algorithm.loss.type", "cispo"),
    "taskset.reward.type=final_answer": ("taskset.reward.type", "final_answer"),
    "eval.tasksets.0.reward.type=final_answer": ("eval.tasksets.0.reward.type", "final_answer"),
    "monitor.trackers.0.type=tensorboard": ("monitor.trackers.0.type", "tensorboard"),
}


@pytest.mark.timeout(900)
def test_set_switches_a_variant_of_each_union_kind_on_a_live_run(
    prefect_live, test_deployment, rft_worker, engine_server, heavy_turn, task_file
):
    """`set: ["placement.type=deployments", ...]` over REST on a mode deployment whose `cfg` is a
    whole validated config (placement local, `devices: null`): it failed in 12 s naming
    `placement.deployments.devices` (issue 44); the run completes with each role a flow run of
    its deployment (`prefect deploy --all`'s rft-trainer/default, rft-explorer/default), in a
    process of its own, and with the other unions' switched variants (SWITCHES) at their defaults
    in its stored config: a score each evaluated version under the switched eval reward, and
    TensorBoard's event files. The explorer generates on the session's engine server (no engine start)."""
    dep, cfg, storage = test_deployment
    cfg = {
        **cfg,
        "explorer": {**cfg["explorer"], "engine": {**cfg["explorer"]["engine"], "servers": [engine_server.url]}},
        "eval": {
            "tasksets": [
                {"name": "heldout", "path": task_file, "reward": {"type": "arithmetic"}, "n": 1, "max_tasks": 2}
            ]
        },
        "monitor": {**cfg["monitor"], "trackers": [{"type": "mlflow"}]},
    }
    cfg = validate_config(cfg).model_dump(mode="json")  # what a deployment made from a validated config holds
    assert cfg["placement"] == {"type": "local", "devices": None, "heartbeat_s": 5.0, "heartbeat_timeout_s": 60.0}
    assert all(dotted(cfg, key) != value for key, value in SWITCHES.values())
    prefect_live.api("PATCH", f"/deployments/{dep['id']}", json={"parameters": {"cfg": cfg}})
    run_id = create_run(prefect_live, dep["id"], list(SWITCHES))["id"]
    wait_flow_run(prefect_live, run_id, ["COMPLETED"], timeout_s=780, worker=rft_worker)
    run_dir = storage / prefect_live.flow_run(run_id)["name"]
    stored = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert stored["placement"]["type"] == "deployments" and "devices" not in stored["placement"]
    assert {key: dotted(stored, key) for key, _ in SWITCHES.values()} == dict(SWITCHES.values())
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    assert summary["final_version"] == cfg["trainer"]["total_steps"]
    roles = {m.stem: json.loads(m.read_text())["pid"] for m in (run_dir / "control").glob("role-*.json")}
    assert {"role-trainer", "role-explorer-0"} <= set(roles) and len(set(roles.values())) == len(roles), roles
    scored = json.loads((run_dir / "metrics" / "role=eval" / f"step={summary['final_version']:08d}.json").read_text())
    assert 0.0 <= scored["heldout/reward_mean"] <= 1.1, scored  # final_answer: 1 + 0.1 at most
    assert list((run_dir / "trackers" / "tensorboard").rglob("events.out.tfevents.*")), sorted(run_dir.rglob("*"))


def dotted(cfg: dict, key: str) -> Any:
    """The value at a dotted path of a nested config (list items by index)."""
    for part in key.split("."):
        cfg = cfg[int(part)] if isinstance(cfg, list) else cfg[part]
    return cfg


def run_processes(control: Path) -> list[psutil.Process]:
    """Every process of a worker-run flow: each role's process (the `pid` of its marker under
    `<run>/control/role-*.json`) and all its descendants (vLLM engine cores and workers)."""
    pids = {json.loads(m.read_text())["pid"] for m in control.glob("role-*.json")}
    assert pids, f"no role markers under {control}"
    procs = {}
    for pid in pids:
        p = psutil.Process(pid)
        procs |= {q.pid: q for q in [p, *p.children(recursive=True)]}
    return list(procs.values())


def still_running(procs: list[psutil.Process], deadline: float) -> list[psutil.Process]:
    """Those of `procs` still running at `deadline` (returns as soon as none is). An exited process
    that nobody reaped yet (a zombie re-parented to a PID 1 that does not reap) counts as gone."""

    def running(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    while (alive := [p for p in procs if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


@pytest.mark.release
@pytest.mark.timeout(1200)
def test_cancelled_worker_run_publishes_its_report(prefect_live, test_deployment, rft_worker):
    dep, _, storage = test_deployment
    worker_lines = len(rft_worker.log_path.read_text().splitlines())
    created = create_run(prefect_live, dep["id"], [f"trainer.total_steps={CANCELLED_TOTAL}"])
    run_id = created["id"]
    deadline = time.monotonic() + 480
    while True:  # until the trainer is 2 steps in
        markers = list(storage.glob("*/control/trainer.json"))
        if markers and json.loads(markers[0].read_text()).get("version", 0) >= 2:
            break
        assert time.monotonic() < deadline, f"the trainer never reached version 2\n{rft_worker.log_tail()}"
        assert prefect_live.flow_run(run_id)["state_type"] in ("SCHEDULED", "PENDING", "RUNNING"), (
            prefect_live.flow_run(run_id)["state"]
        )
        time.sleep(0.5)
    procs = run_processes(markers[0].parent)
    assert len(procs) >= 3, procs  # the flow process, vLLM's engine core and its worker at least
    t0 = time.monotonic()
    prefect_live.cancel(run_id)
    wait_flow_run(prefect_live, run_id, ["CANCELLED"], timeout_s=CANCELLED_WITHIN_S, worker=rft_worker, poll_s=0.25)
    cancelled_s = time.monotonic() - t0
    alive = still_running(procs, deadline=t0 + GONE_WITHIN_S)
    gone_s = time.monotonic() - t0
    for p in alive:  # never leave them to the next test
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    assert not alive, f"left running {gone_s:.0f} s after the cancel request: {[f'{p.pid} {p.name()}' for p in alive]}"
    print(
        f"cancel request -> Cancelled {cancelled_s:.1f} s, -> all {len(procs)} processes of the run gone {gone_s:.1f} s"
    )
    assert_exited_cleanly(prefect_live, run_id)
    arts = artifacts(prefect_live, run_id)
    assert {f"{KEYS}-{what}" for what in ("progress", "metrics", "timeline", "reward-curve", "summary")} <= set(arts), (
        sorted(arts)
    )
    assert 0 < arts[f"{KEYS}-progress"]["data"] < 100
    run_name = prefect_live.flow_run(run_id)["name"]
    run_dir = storage / run_name
    assert run_name in arts[f"{KEYS}-summary"]["description"] and (run_dir / "report" / "summary.json").is_file()
    # The worker's terminal got a few lines of its own for the run; the engines' and libraries'
    # output went to the run's log (no "Failed to load weights" at a sync: tied head, rebuilt).
    run_lines = lines_of_run(
        rft_worker.log_path.read_text().splitlines()[worker_lines:], {run_id, created["name"], run_name}
    )
    assert len(run_lines) < 30 and f"engine and library output in {run_dir}/logs/engines.log" in "\n".join(run_lines), (
        "\n".join(run_lines)
    )
    engines = (run_dir / "logs" / "engines.log").read_text()
    assert (
        "Initializing a V1 LLM engine" in engines
        and "(VllmWorker-0 pid=" in engines
        and "Failed to load weights" not in engines
    ), engines[-3000:]
    print(f"worker terminal: {len(run_lines)} lines for the run; engines.log: {len(engines.splitlines())} lines")
    assert (
        "run summary:" in prefect_live.cli("flow-run", "logs", run_id).stdout
    )  # the flow run's own lines, where the README says
    # How to resume it, and the model it reached, as artifacts; the artifact's command resumes it on the worker.
    assert (
        arts[f"{KEYS}-model"]["data"] == f"[{run_dir}/model]({(run_dir / 'model').resolve().as_uri()})"
        and (run_dir / "model" / "config.json").is_file()
    )
    (command,) = [
        line for line in arts[f"{KEYS}-resume"]["data"].splitlines() if line.startswith("prefect deployment run")
    ]
    assert command == f"prefect deployment run 'synchronous/synchronous' --param resume={run_dir}", command
    resumed = flow_run_id_from_cli(prefect_live.cli(*shlex.split(command)[1:]).stdout)
    wait_flow_run(prefect_live, resumed, ["COMPLETED"], timeout_s=600, worker=rft_worker)
    assert json.loads((run_dir / "report" / "summary.json").read_text())["final_version"] == CANCELLED_TOTAL


@pytest.mark.release
@pytest.mark.timeout(780)
def test_bench_ops(prefect_live, test_deployment, rft_worker, engine_server, tiny_model_dir, task_file, tmp_path):
    """`python -m bench.ops --smoke` (its smallest path end to end, tests/bench/test_bench_smoke.py's
    way) on this module's server, worker and deployments (--attach) and the session's engine server
    (the README runs' above): no server, worker, `prefect deploy --all` or engine server of its own.
    The database figures are those of the session's server (PostgreSQL where the machine has it)."""
    from tests.bench.test_bench_smoke import has_keys, non_negative, number, positive, run_bench

    params = prefect_live.deployment("synchronous/synchronous")["parameters"]
    attached = (
        "--attach",
        prefect_live.api_url,
        "--worker-log",
        str(rft_worker.log_path),
        "--model",
        tiny_model_dir,
        "--tasks",
        task_file,
        "--engine-server",
        engine_server.url,
        str(engine_server.start_s),
        "--db",
        prefect_live.db,
        "--server-log",
        str(prefect_live.log_path),
    )
    r = run_bench("ops", "--smoke", *attached, timeout_s=720, tmp_path=tmp_path)
    parts = (
        "api_call_s",
        "worker_pickup_s",
        "process_spawn_s",
        "flow_import_s",
        "run_setup_s",
        "engine_start_s",
        "to_rollout_s",
    )
    has_keys(r, "api_to_first_rollout_s", "runs", "worker_terminal_lines_per_run", "op_rebuilt_during_runs", *parts)
    assert r["runs"] == 1 and r["op_rebuilt_during_runs"] in (
        0,
        1,
    )  # smoke: no warm-up run, so the op may be built in it
    assert 0 < r["worker_terminal_lines_per_run"] < 100  # at least the worker's own lines, never the engines' hundreds
    for k in parts:
        if k != "worker_pickup_s":
            non_negative(r[k])
    # The worker may take the run before the POST that created it has returned, not before it was sent
    # (the process's start time is read to the clock tick, 10 ms).
    assert number(r["worker_pickup_s"]) >= -r["api_call_s"] - 0.02
    positive(r["api_to_first_rollout_s"])
    assert sum(r[k] for k in parts) == pytest.approx(r["api_to_first_rollout_s"], abs=0.01)  # one run: its parts add up
    # The same run against an engine server kept up (`rft engine serve`): its explorer starts no engine.
    has_keys(r, "engine_server_start_s", "server_api_to_first_rollout_s", *(f"server_{k}" for k in parts))
    positive(r["engine_server_start_s"])
    assert sum(r[f"server_{k}"] for k in parts) == pytest.approx(r["server_api_to_first_rollout_s"], abs=0.01)
    # The database under the runs: the probe's API latency and the server log's `database is locked` lines
    db = prefect_live.db
    assert r["dbs"] == db
    for what in ("read_flow_runs", "create_flow_run"):
        assert 0 < r[f"{db}_{what}_p50_ms"] <= r[f"{db}_{what}_p95_ms"]
    assert r[f"{db}_api_calls"] > r[f"{db}_api_errors"] >= 0 and r[f"{db}_minutes"] > 0
    assert r[f"{db}_db_locked_lines"] >= 0 and r[f"{db}_server_log_tracebacks"] >= 0
    if db == "postgres":
        assert r["postgres_db_locked_lines"] == 0  # SQLite's own message
    # --attach leaves the deployment's config as it found it, and no probe flow run behind
    assert prefect_live.deployment("synchronous/synchronous")["parameters"] == params
    left = prefect_live.api("POST", "/flow_runs/filter", json={"flow_runs": {"tags": {"all_": ["bench-ops-probe"]}}})
    assert not left
