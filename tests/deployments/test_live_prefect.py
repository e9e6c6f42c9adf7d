"""The documented Prefect operations against a real `prefect server start` and a real process worker.

What a README user types, from the repo root: create the pool, start a worker, `prefect deploy --all`,
`prefect deployment run 'synchronous/synchronous' --param cfg=...`; and the server's scheduler
creating runs from a schedule (it does not with SQLAlchemy 2.1; ephemeral servers never run it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from flows.common import SET_EXAMPLE
from harness.prefect_live import (
    REPO,
    ensure_process_pool,
    flow_run_id_from_cli,
    kill_process_group,
    log_tail,
    wait_flow_run,
)
from harness.runs import small_config

pytestmark = pytest.mark.slow

SPEC = yaml.safe_load((REPO / "prefect.yaml").read_text())


@pytest.mark.timeout(180)
def test_work_pool_create_and_worker_start(prefect_live, rft_worker):
    """The Prefect CLI's pool and worker commands work with the pinned set (importlib_metadata)."""
    pool = prefect_live.api("GET", "/work_pools/rft-cpu")
    assert pool["type"] == "process"
    assert rft_worker.workers_online(), rft_worker.log_tail()
    # The worker is shared by the session, so its start line may be far back in the log.
    assert f"Worker '{rft_worker.name}' started!" in rft_worker.log_tail(10**6)
    deadline = time.monotonic() + 30
    while prefect_live.api("GET", "/work_pools/rft-cpu")["status"] != "READY":
        assert time.monotonic() < deadline, f"pool never READY\n{rft_worker.log_tail()}"
        time.sleep(0.5)


@pytest.mark.timeout(420)
def test_deploy_all_from_repo_root(deployed):
    """Every deployment of prefect.yaml exists, on rft-cpu, with its `cfg`, and nothing machine-specific."""
    assert set(deployed) >= {
        "synchronous/synchronous",
        "one-step-off-policy/one-step-off-policy-nightly",
        "fully-async/fully-async",
        "multi-explorer/multi-explorer",
        "rft-explorer/default",
        "rft-trainer/default",
        "rft-reward/default",
        "rft-eval/default",
    }
    by_entry = {d["entrypoint"]: d for d in SPEC["deployments"]}
    for name, dep in deployed.items():
        if dep["entrypoint"] not in by_entry:
            continue  # another test's deployment on a shared server
        spec = by_entry[dep["entrypoint"]]
        assert dep["work_pool_name"] == "rft-cpu", name
        assert dep["pull_steps"] == SPEC["pull"], name
        assert str(REPO) not in json.dumps(dep["pull_steps"]) and dep["path"] in (None, ""), name
        if "cfg" in (spec.get("parameters") or {}):
            assert dep["parameters"]["cfg"] == spec["parameters"]["cfg"], name
            assert "cfg" in dep["parameter_openapi_schema"]["required"], name
            assert dep["enforce_parameter_schema"], name
            # The run form's `set` field: dotted overrides on top of `cfg`, described.
            set_ = dep["parameter_openapi_schema"]["properties"]["set"]
            assert {"type": "array", "items": {"type": "string"}} in set_["anyOf"] and "set" not in dep["parameters"], (
                name
            )
            assert set_["description"].startswith("Dotted overrides applied on top of `cfg`"), name
            # ... first in the form (the UI orders by `position`), with an example.
            assert set_["position"] == 0 and set_["examples"] == [SET_EXAMPLE], name
            assert_form_has_every_section(dep["parameter_openapi_schema"], name)
    for role, params in {
        "rft-explorer/default": {"run_url", "explorer_id"},
        "rft-trainer/default": {"run_url"},
        "rft-reward/default": {"run_url"},
    }.items():
        schema = deployed[role]["parameter_openapi_schema"]
        assert params <= set(schema["properties"]) and schema["required"] == ["run_url"], (role, schema)
    nightly = deployed["one-step-off-policy/one-step-off-policy-nightly"]
    assert [s["active"] for s in nightly["schedules"]] == [False]
    assert [s["schedule"]["cron"] for s in nightly["schedules"]] == ["0 3 * * *"]
    # one run at a time: the server keeps the limit as a global concurrency limit of the deployment
    assert nightly["global_concurrency_limit"]["limit"] == 1 and nightly["parameters"]["cfg"]["lineage"] == {
        "name": "nightly"
    }


def assert_form_has_every_section(schema: dict, name: str) -> None:
    """The UI's run form is drawn from this schema: `cfg` is RFTConfig with every section, and
    every field of every section (nested models too) carries its description."""
    from pydantic import BaseModel

    from rl_engine.config import RFTConfig

    defs = schema["definitions"]
    assert schema["properties"]["cfg"]["$ref"] == "#/definitions/RFTConfig", name
    assert set(defs["RFTConfig"]["properties"]) == set(RFTConfig.model_fields), name
    models, seen = [RFTConfig], set()
    while models:
        model = models.pop()
        if model.__name__ in seen:
            continue
        seen.add(model.__name__)
        props = defs[model.__name__]["properties"]
        for field, info in model.model_fields.items():
            ref = props[field].get("$ref") or next((a.get("$ref") for a in props[field].get("allOf", [])), None)
            described = props[field].get("description") or (ref and defs[ref.rsplit("/", 1)[-1]].get("description"))
            assert described, f"{name}: {model.__name__}.{field} has no description in the form"
            for sub in getattr(info.annotation, "__args__", ()) + (info.annotation,):
                if isinstance(sub, type) and issubclass(sub, BaseModel):
                    models.append(sub)
    assert len(seen) >= 10, (name, sorted(seen))


TICK_FLOW = """
from prefect import flow


@flow(name="rft-test-tick")
def tick() -> int:
    return 1
"""


@pytest.mark.timeout(240)
def test_schedule_creates_runs(prefect_live, deployed, tmp_path):
    """The server's scheduler turns an interval schedule into scheduled flow runs; an inactive one into none."""
    (tmp_path / "tick.py").write_text(TICK_FLOW)
    ensure_process_pool(prefect_live, "rft-test-schedules")  # no worker: the runs stay scheduled
    prefect_live.cli(
        "deploy",
        "./tick.py:tick",
        "--name",
        "every-2s",
        "--pool",
        "rft-test-schedules",
        "--interval",
        "2",
        cwd=tmp_path,
        timeout=120,
    )
    dep = prefect_live.deployment("rft-test-tick/every-2s")
    try:
        deadline = time.monotonic() + 90
        while True:
            runs = prefect_live.api(
                "POST", "/flow_runs/filter", json={"flow_runs": {"deployment_id": {"any_": [dep["id"]]}}, "limit": 20}
            )
            scheduled = [r for r in runs if r["auto_scheduled"] and r["state_type"] == "SCHEDULED"]
            if len(scheduled) >= 3:
                break
            assert time.monotonic() < deadline, (
                f"the scheduler made {len(runs)} runs in 90 s\n{prefect_live.log_tail()}"
            )
            time.sleep(1)
        starts = sorted(r["expected_start_time"] for r in scheduled)
        assert len(set(starts)) == len(starts)
        nightly = deployed["one-step-off-policy/one-step-off-policy-nightly"]
        assert (
            prefect_live.api(
                "POST", "/flow_runs/filter", json={"flow_runs": {"deployment_id": {"any_": [nightly["id"]]}}}
            )
            == []
        )
    finally:
        prefect_live.api("DELETE", f"/deployments/{dep['id']}")


def readme_schedule_snippet() -> str:
    """The schedules guide's Python snippet that creates a schedule with `set` overrides."""
    import re

    blocks = [
        b
        for b in re.findall(r"```python\n(.*?)```", (REPO / "docs" / "guides" / "schedules.md").read_text(), re.DOTALL)
        if "create_deployment_schedules" in b
    ]
    assert len(blocks) == 1, "docs/guides/schedules.md: one python block creating a deployment schedule"
    return blocks[0]


@pytest.mark.timeout(240)
def test_readme_schedule_with_set_overrides(prefect_live, deployed):
    """The schedules guide's snippet, run as written against the server, gives `synchronous/synchronous` a
    nightly schedule whose runs carry its `set` and the deployment's `cfg` (the scheduler's
    scheduled runs, read back; none runs before 02:00, and the test removes them)."""
    import ast

    snippet = readme_schedule_snippet()
    call = next(n for n in ast.walk(ast.parse(snippet)) if isinstance(n, ast.keyword) and n.arg == "parameters")
    overrides = ast.literal_eval(call.value)["set"]
    dep = prefect_live.deployment("synchronous/synchronous")
    before = {s["id"] for s in dep["schedules"]}
    res = subprocess.run(
        [sys.executable, "-c", snippet], cwd=REPO, env=prefect_live.env(), capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-4000:]
    mine: list[dict] = []
    try:
        mine = [s for s in prefect_live.deployment("synchronous/synchronous")["schedules"] if s["id"] not in before]
        assert len(mine) == 1 and mine[0]["schedule"]["cron"] == "0 2 * * *" and mine[0]["active"], mine
        assert mine[0]["parameters"] == {"set": overrides}
        deadline = time.monotonic() + 150
        while True:
            runs = prefect_live.api(
                "POST",
                "/flow_runs/filter",
                json={
                    "flow_runs": {"deployment_id": {"any_": [dep["id"]]}, "state": {"type": {"any_": ["SCHEDULED"]}}},
                    "limit": 20,
                },
            )
            scheduled = [r for r in runs if r["auto_scheduled"] and r["parameters"].get("set") == overrides]
            if scheduled:
                break
            assert time.monotonic() < deadline, (
                f"the scheduler made no run of the schedule in 150 s\n{prefect_live.log_tail()}"
            )
            time.sleep(2)
        for r in scheduled:
            assert r["parameters"] == {"cfg": dep["parameters"]["cfg"], "set": overrides}, r["parameters"]
            assert r["expected_start_time"][11:16] == "02:00", r["expected_start_time"]
        # What such a run's flow makes of them: the deployment's config with exactly those fields changed.
        from flows.common import with_overrides
        from rl_engine.config import RFTConfig

        cfg = with_overrides(RFTConfig.model_validate(dep["parameters"]["cfg"]), overrides)
        assert cfg.trainer.total_steps == 50 and cfg.lineage.name == "nightly-50"
    finally:
        for s in mine:
            prefect_live.api("DELETE", f"/deployments/{dep['id']}/schedules/{s['id']}", ok=(200, 204, 404))
        runs = prefect_live.api(
            "POST",
            "/flow_runs/filter",
            json={"flow_runs": {"deployment_id": {"any_": [dep["id"]]}, "state": {"type": {"any_": ["SCHEDULED"]}}}},
        )
        for r in runs:
            if r["auto_scheduled"] and r["parameters"].get("set") == overrides:
                prefect_live.api("DELETE", f"/flow_runs/{r['id']}", ok=(200, 204, 404))


@pytest.mark.timeout(600)
def test_synchronous_deployment_runs_on_the_worker(
    prefect_live, deployed, rft_worker, tiny_model_dir, task_file, tmp_path
):
    """`prefect deployment run 'synchronous/synchronous' --param cfg=...` trains to Completed on the process worker."""
    storage = tmp_path / "runs"
    cfg = small_config(tiny_model_dir, task_file, str(storage), mode="synchronous", total_steps=3)
    t0 = time.monotonic()
    out = prefect_live.cli(
        "deployment", "run", "synchronous/synchronous", "--param", f"cfg={json.dumps(cfg)}", timeout=60
    )
    run_id = flow_run_id_from_cli(out.stdout)
    state = wait_flow_run(prefect_live, run_id, ["COMPLETED"], timeout_s=480, worker=rft_worker)
    elapsed = time.monotonic() - t0
    run = prefect_live.flow_run(run_id)
    print(
        f"synchronous deployment run: {elapsed:.1f} s from `prefect deployment run` to Completed (flow run {run['total_run_time']:.1f} s)"
    )
    assert state["type"] == "COMPLETED"
    configs = list(storage.glob("*/config.yaml"))
    assert len(configs) == 1, list(storage.iterdir()) if storage.exists() else "no storage dir"
    stored = yaml.safe_load(configs[0].read_text())
    assert stored["synchronizer"]["mode"] == "synchronous" and stored["trainer"]["total_steps"] == 3
    assert Path(stored["model"]["path"]) == Path(tiny_model_dir)


@pytest.mark.timeout(180)
def test_serve_registers_mode_and_roles(prefect_live, tiny_model_dir, tmp_path):
    """`python -m deployments.serve CONFIG --name served` serves the mode's flow and the roles."""
    cfg_path = tmp_path / "cfg.yaml"
    cfg = yaml.safe_load((REPO / "configs" / "synchronous.yaml").read_text())
    cfg["model"]["path"] = tiny_model_dir
    cfg_path.write_text(yaml.safe_dump(cfg))
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deployments.serve", str(cfg_path), "--name", "served"],
            cwd=REPO,
            env=prefect_live.env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        want = {"synchronous/served", "rft-explorer/served", "rft-trainer/served", "rft-reward/served"}
        deadline = time.monotonic() + 120
        while True:
            found = {
                n
                for n in want
                if prefect_live.api("GET", f"/deployments/name/{n}", ok=(200, 404)).get("name") == "served"
            }
            if found == want:
                break
            assert proc.poll() is None, f"serve exited {proc.returncode}\n{log_tail(log)}"
            assert time.monotonic() < deadline, f"served only {sorted(found)} in 120 s\n{log_tail(log)}"
            time.sleep(1)
        served = prefect_live.deployment("synchronous/served")
        assert served["parameters"]["cfg"]["model"]["path"] == tiny_model_dir and served["work_pool_name"] is None
    finally:
        kill_process_group(proc)
        for name in want:
            dep = prefect_live.api("GET", f"/deployments/name/{name}", ok=(200, 404))
            if dep.get("id"):
                prefect_live.api("DELETE", f"/deployments/{dep['id']}")


@pytest.mark.timeout(180)
def test_readme_turns_the_nightly_schedule_on(prefect_live, deployed):
    """The schedules guide's bash block that turns the shipped nightly schedule on, run as written: its
    schedule is active; the test pauses it again and removes any run the scheduler made of it."""
    import re

    blocks = [
        b
        for b in re.findall(r"```bash\n(.*?)```", (REPO / "docs" / "guides" / "schedules.md").read_text(), re.DOTALL)
        if "schedule resume" in b
    ]
    assert len(blocks) == 1, "docs/guides/schedules.md: one bash block turning the nightly schedule on"
    name = "one-step-off-policy/one-step-off-policy-nightly"
    (schedule,) = prefect_live.deployment(name)["schedules"]
    assert not schedule["active"]  # as shipped
    try:
        res = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", blocks[0]],
            cwd=REPO,
            env=prefect_live.env(),
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        # Active is what the scheduler goes by (test_readme_schedule_with_set_overrides waits for its runs).
        assert "0 3 * * *" in res.stdout and [s["active"] for s in prefect_live.deployment(name)["schedules"]] == [
            True
        ], res.stdout
    finally:
        prefect_live.cli("deployment", "schedule", "pause", name, schedule["id"])
        dep = prefect_live.deployment(name)
        for r in prefect_live.api(
            "POST", "/flow_runs/filter", json={"flow_runs": {"deployment_id": {"any_": [dep["id"]]}}}
        ):
            prefect_live.api("DELETE", f"/flow_runs/{r['id']}", ok=(200, 204, 404))
    assert [s["active"] for s in dep["schedules"]] == [False]
